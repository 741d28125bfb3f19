// A rendezvous store in a directory, for tests whose ranks are processes of their own.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <string>
#include <system_error>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "worker/dataplane/key_value_store.h"

namespace shard {

// A store in a directory, so that ranks in different processes can rendezvous: a key is a
// file, written whole under another name and renamed into place.
class DirectoryKeyValueStore : public KeyValueStore {
 public:
  explicit DirectoryKeyValueStore(std::string dir) : dir_(std::move(dir)) {}

  absl::Status Set(const std::string& key, const std::string& value) override {
    const std::string path = Path(key);
    const std::string temporary = absl::StrCat(path, ".tmp-", ::getpid());
    {
      std::ofstream out(temporary, std::ios::binary);
      out << value;
      if (!out.flush()) return absl::InternalError(absl::StrCat("cannot write ", temporary));
    }
    std::error_code error;
    std::filesystem::rename(temporary, path, error);
    if (error) return absl::InternalError(absl::StrCat("cannot rename to ", path));
    return absl::OkStatus();
  }

  absl::StatusOr<std::string> Get(const std::string& key) override {
    std::ifstream in(Path(key), std::ios::binary);
    if (!in) return absl::NotFoundError(key);
    return std::string(std::istreambuf_iterator<char>(in), {});
  }

  absl::Status Wait(const std::vector<std::string>& keys, absl::Duration timeout) override {
    const absl::Time deadline = absl::Now() + timeout;
    for (const std::string& key : keys) {
      while (!std::filesystem::exists(Path(key))) {
        if (absl::Now() > deadline) return absl::DeadlineExceededError(key);
        absl::SleepFor(absl::Milliseconds(5));
      }
    }
    return absl::OkStatus();
  }

 private:
  std::string Path(const std::string& key) const {
    std::string name = key;
    std::replace(name.begin(), name.end(), '/', '_');
    return dir_ + "/" + name;
  }

  std::string dir_;
};

}  // namespace shard
