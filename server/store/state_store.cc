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

absl::StatusOr<std::optional<v1::CoordinatorState>> InMemoryStateStore::Load() { return state_; }

absl::Status InMemoryStateStore::Save(const v1::CoordinatorState& state) {
  state_ = state;
  ++saves_;
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
  return std::unique_ptr<DirectoryStateStore>(
      new DirectoryStateStore(absl::StrCat(dir, "/coordinator-state.json"), fd));
}

DirectoryStateStore::~DirectoryStateStore() {
  if (lock_fd_ >= 0) ::close(lock_fd_);  // releases the flock
}

absl::StatusOr<std::optional<v1::CoordinatorState>> DirectoryStateStore::Load() {
  absl::StatusOr<std::string> contents = ReadFile(state_file_);
  if (absl::IsNotFound(contents.status())) return std::nullopt;
  if (!contents.ok()) return contents.status();
  v1::CoordinatorState state;
  const auto parsed = google::protobuf::util::JsonStringToMessage(*contents, &state);
  if (!parsed.ok()) {
    return absl::DataLossError(absl::StrCat("state file '", state_file_,
                                            "' is not a valid coordinator state (",
                                            parsed.message().as_string(),
                                            "); move it away to start the job's state afresh"));
  }
  if (state.format_version() != 1) {
    return absl::FailedPreconditionError(absl::StrCat(
        "state file '", state_file_, "' has format version ", state.format_version(),
        "; this shard-coordinator reads version 1"));
  }
  return state;
}

absl::Status DirectoryStateStore::Save(const v1::CoordinatorState& state) {
  std::string json;
  google::protobuf::util::JsonPrintOptions options;
  options.add_whitespace = true;
  options.preserve_proto_field_names = true;
  const auto printed = google::protobuf::util::MessageToJsonString(state, &json, options);
  if (!printed.ok()) {
    return absl::InternalError(
        absl::StrCat("cannot encode coordinator state: ", printed.message().as_string()));
  }
  return WriteFileAtomically(state_file_, json);
}

}  // namespace shard
