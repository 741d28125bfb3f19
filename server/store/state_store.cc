#include "server/store/state_store.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/files.h"
#include "google/protobuf/util/json_util.h"

namespace shard {

absl::StatusOr<bool> InMemoryStateStore::Load(absl::string_view key,
                                              google::protobuf::Message* message) {
  absl::MutexLock lock(&mu_);
  auto it = records_.find(std::string(key));
  if (it == records_.end()) return false;
  if (!message->ParseFromString(it->second)) {
    return absl::DataLossError(absl::StrCat("in-memory record '", key, "' does not parse"));
  }
  return true;
}

absl::Status InMemoryStateStore::Save(absl::string_view key,
                                      const google::protobuf::Message& message) {
  absl::MutexLock lock(&mu_);
  records_[std::string(key)] = message.SerializeAsString();
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<DirectoryStateStore>> DirectoryStateStore::Open(
    const std::string& dir) {
  if (absl::Status made = MakeDirectories(dir); !made.ok()) return made;
  const std::string lock_path = absl::StrCat(dir, "/LOCK");
  const int fd = ::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) {
    return absl::InternalError(
        absl::StrCat("cannot open lock file '", lock_path, "': ", std::strerror(errno)));
  }
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    ::close(fd);
    if (err == EWOULDBLOCK) {
      return absl::FailedPreconditionError(
          absl::StrCat("state directory '", dir,
                       "' is in use by another shard-coordinator (it holds ", lock_path,
                       "); stop that one or pass another --state-dir"));
    }
    return absl::InternalError(
        absl::StrCat("cannot lock '", lock_path, "': ", std::strerror(err)));
  }
  return std::unique_ptr<DirectoryStateStore>(new DirectoryStateStore(dir, fd));
}

DirectoryStateStore::~DirectoryStateStore() {
  if (lock_fd_ >= 0) ::close(lock_fd_);  // releases the flock
}

std::string DirectoryStateStore::PathOf(absl::string_view key) const {
  return absl::StrCat(dir_, "/", key, ".json");
}

absl::StatusOr<bool> DirectoryStateStore::Load(absl::string_view key,
                                               google::protobuf::Message* message) {
  absl::MutexLock lock(&mu_);
  const std::string path = PathOf(key);
  absl::StatusOr<std::string> contents = ReadFile(path);
  if (absl::IsNotFound(contents.status())) return false;
  if (!contents.ok()) return contents.status();
  const auto parsed = google::protobuf::util::JsonStringToMessage(*contents, message);
  if (!parsed.ok()) {
    return absl::DataLossError(absl::StrCat("state file '", path, "' is not a valid ",
                                            message->GetTypeName(), " (",
                                            parsed.message().as_string(),
                                            "); move it away to start that record afresh"));
  }
  return true;
}

absl::Status DirectoryStateStore::Save(absl::string_view key,
                                       const google::protobuf::Message& message) {
  std::string json;
  google::protobuf::util::JsonPrintOptions options;
  options.add_whitespace = true;
  options.preserve_proto_field_names = true;
  const auto printed = google::protobuf::util::MessageToJsonString(message, &json, options);
  if (!printed.ok()) {
    return absl::InternalError(
        absl::StrCat("cannot encode state record '", key, "': ", printed.message().as_string()));
  }
  absl::MutexLock lock(&mu_);
  return WriteFileAtomically(PathOf(key), json);
}

}  // namespace shard
