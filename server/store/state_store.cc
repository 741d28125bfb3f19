#include "server/store/state_store.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/files.h"
#include "common/journal.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "google/protobuf/util/json_util.h"
#include "spdlog/spdlog.h"

namespace shard {
namespace {

absl::Status Errno(absl::string_view what, const std::string& path) {
  return absl::InternalError(absl::StrCat(what, " '", path, "': ", std::strerror(errno)));
}

}  // namespace

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

absl::StatusOr<std::optional<Journal>> InMemoryStateStore::LoadJournal(absl::string_view key) {
  absl::MutexLock lock(&mu_);
  auto it = journals_.find(std::string(key));
  if (it == journals_.end()) return std::nullopt;
  return it->second;
}

uint64_t InMemoryStateStore::Append(absl::string_view key, std::string delta) {
  absl::MutexLock lock(&mu_);
  journals_[std::string(key)].deltas.push_back(std::move(delta));
  return ++sequence_;
}

uint64_t InMemoryStateStore::Compact(absl::string_view key, std::string snapshot) {
  absl::MutexLock lock(&mu_);
  journals_[std::string(key)] = Journal{std::move(snapshot), {}};
  return ++sequence_;
}

void InMemoryStateStore::WhenDurable(uint64_t /*sequence*/, std::function<void()> done) { done(); }

uint64_t InMemoryStateStore::last_sequence() const {
  absl::MutexLock lock(&mu_);
  return sequence_;
}

absl::StatusOr<std::unique_ptr<DirectoryStateStore>> DirectoryStateStore::Open(
    const std::string& dir) {
  SHARD_RETURN_IF_ERROR(MakeDirectories(dir));
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


std::string DirectoryStateStore::JournalPathOf(absl::string_view key) const {
  return absl::StrCat(dir_, "/", key, ".log");
}

DirectoryStateStore::DirectoryStateStore(std::string dir, int lock_fd)
    : dir_(std::move(dir)), lock_fd_(lock_fd) {
  writer_ = std::thread([this] { Writer(); });
}

DirectoryStateStore::~DirectoryStateStore() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  writer_.join();
  for (const auto& [key, fd] : journal_fds_) ::close(fd);
  if (lock_fd_ >= 0) ::close(lock_fd_);  // releases the flock
}

absl::StatusOr<std::optional<Journal>> DirectoryStateStore::LoadJournal(absl::string_view key) {
  const std::string path = JournalPathOf(key);
  absl::StatusOr<std::string> file = ReadFile(path);
  if (absl::IsNotFound(file.status())) return std::nullopt;
  if (!file.ok()) return file.status();
  JournalContents contents = DecodeJournal(*file);
  if (contents.frames.empty() || contents.frames.front().kind != JournalFrameKind::kSnapshot) {
    return absl::DataLossError(absl::StrCat(
        "state journal '", path, "' does not begin with an intact snapshot; move it away to "
        "start that record afresh"));
  }
  if (contents.intact_bytes < file->size()) {
    // A crash cut the last append short before it was acknowledged: drop it, so that later
    // appends follow the intact frames.
    spdlog::warn("state journal {}: dropping {} bytes of an append a crash cut short", path,
                 file->size() - contents.intact_bytes);
    if (::truncate(path.c_str(), static_cast<off_t>(contents.intact_bytes)) != 0) {
      return Errno("cannot truncate the torn tail of", path);
    }
  }
  Journal journal;
  journal.snapshot = std::move(contents.frames.front().payload);
  for (size_t i = 1; i < contents.frames.size(); ++i) {
    if (contents.frames[i].kind != JournalFrameKind::kDelta) {
      return absl::DataLossError(
          absl::StrCat("state journal '", path, "' holds a second snapshot at frame ", i));
    }
    journal.deltas.push_back(std::move(contents.frames[i].payload));
  }
  return journal;
}

uint64_t DirectoryStateStore::Append(absl::string_view key, std::string delta) {
  absl::MutexLock lock(&mu_);
  pending_.push_back(Write{++sequence_, std::string(key), false, std::move(delta)});
  return sequence_;
}

uint64_t DirectoryStateStore::Compact(absl::string_view key, std::string snapshot) {
  absl::MutexLock lock(&mu_);
  pending_.push_back(Write{++sequence_, std::string(key), true, std::move(snapshot)});
  return sequence_;
}

void DirectoryStateStore::WhenDurable(uint64_t sequence, std::function<void()> done) {
  {
    absl::MutexLock lock(&mu_);
    if (sequence > durable_) {
      waiting_.emplace(sequence, std::move(done));
      return;
    }
  }
  done();
}

uint64_t DirectoryStateStore::last_sequence() const {
  absl::MutexLock lock(&mu_);
  return sequence_;
}

absl::Status DirectoryStateStore::WriteGroup(const std::vector<Write>& group) {
  // Per key: the last snapshot of the group replaces the file with itself and the deltas after
  // it; without one, the deltas are appended.
  std::map<std::string, std::pair<const Write*, std::string>> files;  // key -> snapshot, frames
  for (const Write& write : group) {
    auto& [snapshot, frames] = files[write.key];
    if (write.snapshot) {
      snapshot = &write;
      frames = EncodeJournalFrame(JournalFrameKind::kSnapshot, write.payload);
    } else {
      frames += EncodeJournalFrame(JournalFrameKind::kDelta, write.payload);
    }
  }
  for (const auto& [key, file] : files) {
    const std::string path = JournalPathOf(key);
    const auto& [snapshot, frames] = file;
    if (snapshot != nullptr) {
      if (auto open = journal_fds_.find(key); open != journal_fds_.end()) {
        ::close(open->second);
        journal_fds_.erase(open);
      }
      SHARD_RETURN_IF_ERROR(WriteFileAtomically(path, frames));
      continue;
    }
    auto open = journal_fds_.find(key);
    if (open == journal_fds_.end()) {
      const int fd = ::open(path.c_str(), O_WRONLY | O_APPEND | O_CLOEXEC);
      if (fd < 0) return Errno("cannot open state journal", path);
      open = journal_fds_.emplace(key, fd).first;
    }
    const int fd = open->second;
    const off_t before = ::lseek(fd, 0, SEEK_END);
    absl::string_view rest = frames;
    while (!rest.empty()) {
      const ssize_t n = ::write(fd, rest.data(), rest.size());
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        const absl::Status failed = Errno("cannot append to state journal", path);
        // A partial frame must not stay in front of the retry.
        if (before >= 0 && ::ftruncate(fd, before) != 0) spdlog::error("{}", Errno("cannot truncate", path).message());
        return failed;
      }
      rest.remove_prefix(static_cast<size_t>(n));
    }
    if (::fdatasync(fd) != 0) return Errno("cannot fsync state journal", path);
  }
  return absl::OkStatus();
}

void DirectoryStateStore::Writer() {
  absl::Duration backoff = absl::Milliseconds(50);
  while (true) {
    std::vector<Write> group;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stopping_ || !pending_.empty();
      };
      mu_.Await(absl::Condition(&ready));
      if (pending_.empty()) return;  // stopping, and nothing left to write
      group.assign(std::make_move_iterator(pending_.begin()),
                   std::make_move_iterator(pending_.end()));
      pending_.clear();
    }
    while (true) {
      const absl::Status written = WriteGroup(group);
      if (written.ok()) break;
      {
        absl::MutexLock lock(&mu_);
        if (stopping_) {
          // Shutting down on a disk that refuses writes: these were never acknowledged.
          spdlog::error("the coordinator stops with {} state changes it could not write ({})",
                        group.size() + pending_.size(), written.message());
          return;
        }
      }
      spdlog::error("the coordinator cannot write its state directory ({}); acknowledgements wait "
                    "until it can, retrying in {}",
                    written.message(), absl::FormatDuration(backoff));
      absl::SleepFor(backoff);
      backoff = std::min(2 * backoff, absl::Seconds(2));
    }
    backoff = absl::Milliseconds(50);
    std::vector<std::function<void()>> done;
    {
      absl::MutexLock lock(&mu_);
      durable_ = group.back().sequence;
      while (!waiting_.empty() && waiting_.begin()->first <= durable_) {
        done.push_back(std::move(waiting_.begin()->second));
        waiting_.erase(waiting_.begin());
      }
    }
    for (std::function<void()>& callback : done) callback();
  }
}

}  // namespace shard
