#include "common/files.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <new>
#include <system_error>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace shard {
namespace {

// Write-behind (see AtomicFileWriter): a window is large enough that the calls cost nothing and
// small enough that the device starts early; the lag gives writeback time to finish before it
// is waited for, and keeps a file's pages in the page cache to ~80 MiB, recycled (fresh page
// cache pages made most of the cost of a buffered write on the 2-core VM, docs/checkpoints.md).
constexpr uint64_t kWriteBehindWindow = uint64_t{16} << 20;
constexpr uint64_t kWriteBehindLag = 4 * kWriteBehindWindow;

// Closes the descriptor on scope exit.
class FileDescriptor {
 public:
  explicit FileDescriptor(int fd) : fd_(fd) {}
  FileDescriptor(const FileDescriptor&) = delete;
  FileDescriptor& operator=(const FileDescriptor&) = delete;
  ~FileDescriptor() {
    if (fd_ >= 0) ::close(fd_);
  }
  int get() const { return fd_; }

 private:
  int fd_;
};

absl::Status WriteAll(int fd, absl::string_view data, const std::string& path) {
  while (!data.empty()) {
    const ssize_t n = ::write(fd, data.data(), data.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      return FileError("cannot write", path, errno);
    }
    data.remove_prefix(static_cast<size_t>(n));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status FileError(absl::string_view what, const std::string& path, int err) {
  const std::string message = absl::StrCat(what, " '", path, "': ", std::strerror(err));
  switch (err) {
    case ENOENT:
      return absl::NotFoundError(message);
    case ENOSPC:
    case EDQUOT:
      return absl::ResourceExhaustedError(message);
    case EIO:
      return absl::DataLossError(message);
    default:
      return absl::InternalError(message);
  }
}

absl::StatusOr<std::unique_ptr<AtomicFileWriter>> AtomicFileWriter::Create(
    const std::string& path, const std::atomic<bool>* cancel) {
  const std::string temp = absl::StrCat(path, ".tmp.", ::getpid());
  const int fd = ::open(temp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return FileError("cannot create", temp, errno);
  return std::unique_ptr<AtomicFileWriter>(new AtomicFileWriter(path, temp, fd, cancel));
}

AtomicFileWriter::~AtomicFileWriter() {
  if (fd_ >= 0) ::close(fd_);
  if (!committed_) ::unlink(temp_path_.c_str());
}

absl::Status AtomicFileWriter::Write(absl::string_view data) {
  if (fd_ < 0) return absl::FailedPreconditionError(absl::StrCat(path_, " is already committed"));
  // A window at a time, so that each goes to the device as soon as it is complete.
  while (!data.empty()) {
    if (cancel_ != nullptr && cancel_->load()) {
      return absl::CancelledError(absl::StrCat("writing ", path_, " was cancelled"));
    }
    const size_t take = static_cast<size_t>(
        std::min<uint64_t>(data.size(), kWriteBehindWindow - written_ % kWriteBehindWindow));
    SHARD_RETURN_IF_ERROR(WriteAll(fd_, data.substr(0, take), temp_path_));
    data.remove_prefix(take);
    written_ += take;
    SHARD_RETURN_IF_ERROR(WriteBehind());
  }
  return absl::OkStatus();
}

absl::Status AtomicFileWriter::WriteBehind() {
  for (; started_ + kWriteBehindWindow <= written_; started_ += kWriteBehindWindow) {
    if (::sync_file_range(fd_, static_cast<off_t>(started_), kWriteBehindWindow,
                          SYNC_FILE_RANGE_WRITE) != 0) {
      return FileError("cannot write back", temp_path_, errno);
    }
  }
  for (; released_ + kWriteBehindLag < started_; released_ += kWriteBehindWindow) {
    // A write error must surface here: waiting consumes it, and the fsync would not see it again.
    if (::sync_file_range(fd_, static_cast<off_t>(released_), kWriteBehindWindow,
                          SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE |
                              SYNC_FILE_RANGE_WAIT_AFTER) != 0) {
      return FileError("cannot write back", temp_path_, errno);
    }
    // Clean pages now; dropping them is only a hint (tmpfs, for one, keeps them).
    ::posix_fadvise(fd_, static_cast<off_t>(released_), kWriteBehindWindow, POSIX_FADV_DONTNEED);
  }
  return absl::OkStatus();
}

absl::Status AtomicFileWriter::Commit() {
  if (fd_ < 0) return absl::FailedPreconditionError(absl::StrCat(path_, " is already committed"));
  if (::fsync(fd_) != 0) return FileError("cannot fsync", temp_path_, errno);
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) return FileError("cannot close", temp_path_, errno);
  if (::rename(temp_path_.c_str(), path_.c_str()) != 0) {
    return FileError("cannot rename temporary file onto", path_, errno);
  }
  committed_ = true;
  const std::filesystem::path target(path_);
  const std::string dir = target.has_parent_path() ? target.parent_path().string() : ".";
  FileDescriptor dir_fd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (dir_fd.get() < 0) return FileError("cannot open directory", dir, errno);
  if (::fsync(dir_fd.get()) != 0) return FileError("cannot fsync directory", dir, errno);
  return absl::OkStatus();
}

absl::Status WriteFileAtomically(const std::string& path, absl::string_view contents) {
  SHARD_ASSIGN_OR_RETURN(std::unique_ptr<AtomicFileWriter> writer, AtomicFileWriter::Create(path));
  SHARD_RETURN_IF_ERROR(writer->Write(contents));
  return writer->Commit();
}

absl::Status ReadAt(int fd, uint64_t offset, void* out, size_t bytes, const std::string& path) {
  char* dst = static_cast<char*>(out);
  while (bytes > 0) {
    const ssize_t n = ::pread(fd, dst, bytes, static_cast<off_t>(offset));
    if (n < 0) {
      if (errno == EINTR) continue;
      return FileError("cannot read", path, errno);
    }
    if (n == 0) {
      return absl::DataLossError(absl::StrCat("'", path, "' ends at byte ", offset, ", ", bytes,
                                              " bytes short of what its header promises"));
    }
    dst += n;
    bytes -= static_cast<size_t>(n);
    offset += static_cast<uint64_t>(n);
  }
  return absl::OkStatus();
}

void* AllocatePageAligned(size_t bytes) {
  return std::aligned_alloc(kPageAlignment,
                            (bytes + kPageAlignment - 1) / kPageAlignment * kPageAlignment);
}

AlignedBuffer::AlignedBuffer(size_t bytes)
    : bytes_(static_cast<char*>(AllocatePageAligned(bytes))), size_(bytes) {
  if (bytes_ == nullptr && bytes > 0) throw std::bad_alloc();
}

void AlignedBuffer::Free::operator()(char* bytes) const { std::free(bytes); }

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  FileDescriptor fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) return FileError("cannot open", path, errno);
  std::string contents;
  char buffer[1 << 16];
  while (true) {
    const ssize_t n = ::read(fd.get(), buffer, sizeof(buffer));
    if (n < 0) {
      if (errno == EINTR) continue;
      return FileError("cannot read", path, errno);
    }
    if (n == 0) break;
    contents.append(buffer, static_cast<size_t>(n));
  }
  return contents;
}

absl::Status MakeDirectories(const std::string& path) {
  std::error_code error;
  std::filesystem::create_directories(path, error);
  if (error) {
    return error.category() == std::generic_category() ||
                   error.category() == std::system_category()
               ? FileError("cannot create directory", path, error.value())
               : absl::InternalError(
                     absl::StrCat("cannot create directory '", path, "': ", error.message()));
  }
  return absl::OkStatus();
}

}  // namespace shard
