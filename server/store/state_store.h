// Where the coordinator keeps what must survive its own restart: named records (protobuf
// messages), one per manager ("membership", "checkpoints"), each replaced atomically.
// Implementations are thread-safe.
#pragma once

#include <map>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "google/protobuf/message.h"

namespace shard {

class StateStore {
 public:
  virtual ~StateStore() = default;
  // Reads record `key` into `message`: true if found, false if it was never saved.
  virtual absl::StatusOr<bool> Load(absl::string_view key, google::protobuf::Message* message) = 0;
  // Durably replaces record `key`: after OK, a crash loses nothing.
  virtual absl::Status Save(absl::string_view key, const google::protobuf::Message& message) = 0;
};

// For tests and for a coordinator run without a state directory.
class InMemoryStateStore : public StateStore {
 public:
  absl::StatusOr<bool> Load(absl::string_view key, google::protobuf::Message* message) override;
  absl::Status Save(absl::string_view key, const google::protobuf::Message& message) override;

 private:
  absl::Mutex mu_;
  std::map<std::string, std::string> records_ ABSL_GUARDED_BY(mu_);
};

// One JSON file per record, `<dir>/<key>.json`, replaced atomically (temporary file, fsync,
// rename, fsync of the directory). The directory is locked (flock on `LOCK`) for the life of
// the store, so two coordinators never share one.
class DirectoryStateStore : public StateStore {
 public:
  static absl::StatusOr<std::unique_ptr<DirectoryStateStore>> Open(const std::string& dir);
  ~DirectoryStateStore() override;
  DirectoryStateStore(const DirectoryStateStore&) = delete;
  DirectoryStateStore& operator=(const DirectoryStateStore&) = delete;

  absl::StatusOr<bool> Load(absl::string_view key, google::protobuf::Message* message) override;
  absl::Status Save(absl::string_view key, const google::protobuf::Message& message) override;

  std::string PathOf(absl::string_view key) const;

 private:
  DirectoryStateStore(std::string dir, int lock_fd) : dir_(std::move(dir)), lock_fd_(lock_fd) {}

  std::string dir_;
  int lock_fd_;
  absl::Mutex mu_;
};

}  // namespace shard
