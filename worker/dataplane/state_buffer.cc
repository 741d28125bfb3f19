#include "worker/dataplane/state_buffer.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"

namespace shard {

absl::StatusOr<StateBuffer> StateBuffer::Make(uint64_t capacity) {
  StateBuffer buffer;
  if (capacity == 0) return buffer;
  buffer.fd_ = ::memfd_create("shard-state", MFD_CLOEXEC);
  if (buffer.fd_ < 0 || ::ftruncate(buffer.fd_, static_cast<off_t>(capacity)) != 0) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot make a memory file of ", capacity, " bytes for a copy of the state: ",
                     std::strerror(errno), " (is the worker's memory limit too low?)"));
  }
  void* base = ::mmap(nullptr, capacity, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE,
                      buffer.fd_, 0);
  if (base == MAP_FAILED) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "cannot map ", capacity, " bytes for a copy of the state: ", std::strerror(errno)));
  }
  buffer.base_ = static_cast<char*>(base);
  buffer.capacity_ = capacity;
  return buffer;
}

StateBuffer::~StateBuffer() { Release(); }

void StateBuffer::Release() {
  if (base_ != nullptr) ::munmap(base_, capacity_);
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
  base_ = nullptr;
  size_ = capacity_ = 0;
}

StateBuffer::StateBuffer(StateBuffer&& other) noexcept { *this = std::move(other); }

StateBuffer& StateBuffer::operator=(StateBuffer&& other) noexcept {
  if (this == &other) return *this;
  Release();
  fd_ = std::exchange(other.fd_, -1);
  base_ = std::exchange(other.base_, nullptr);
  size_ = std::exchange(other.size_, 0);
  capacity_ = std::exchange(other.capacity_, 0);
  retired_ = other.retired_.exchange(false);
  return *this;
}

absl::Status StateBuffer::Resize(uint64_t bytes) {
  if (bytes > capacity_) {
    absl::StatusOr<StateBuffer> larger = Make(bytes + bytes / 16);
    if (!larger.ok()) return larger.status();
    *this = *std::move(larger);
  }
  size_ = bytes;
  return absl::OkStatus();
}

bool StateBuffer::HeldElsewhere() const {
  if (fd_ < 0) return false;
  // This process never locks its own buffers, so any lock is a buddy's (on a description of its
  // own: a lock on this one would not conflict).
  struct flock lock{};
  lock.l_type = F_WRLCK;
  lock.l_whence = SEEK_SET;
  if (::fcntl(fd_, F_OFD_GETLK, &lock) != 0) return true;
  return lock.l_type != F_UNLCK;
}

}  // namespace shard
