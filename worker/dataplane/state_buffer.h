// A copy of a rank's state (its snapshot or checkpoint shard), in a memory file of its own
// mapped shared: a buddy on this host keeps the very same pages as its replica instead of a copy
// of them (snapshot_peer.h). A buddy that keeps them holds a read lock on the file, an
// open-file-description lock that the kernel drops when the buddy closes it or dies, and the
// rank writes such a buffer again only once no other process holds one (HeldElsewhere).
//
// Movable, not copyable; one thread writes it, and once handed over it is only read.
#pragma once

#include <atomic>
#include <cstdint>

#include "absl/status/statusor.h"

namespace shard {

class StateBuffer {
 public:
  StateBuffer() = default;  // no memory: size 0, capacity 0
  // A buffer with room for `capacity` bytes, every page mapped (a copy at a step boundary then
  // faults none in), of size 0.
  static absl::StatusOr<StateBuffer> Make(uint64_t capacity);
  ~StateBuffer();
  StateBuffer(StateBuffer&& other) noexcept;
  StateBuffer& operator=(StateBuffer&& other) noexcept;
  StateBuffer(const StateBuffer&) = delete;
  StateBuffer& operator=(const StateBuffer&) = delete;

  char* data() { return base_; }
  const char* data() const { return base_; }
  uint64_t size() const { return size_; }
  uint64_t capacity() const { return capacity_; }
  // The memory file, for a buddy on this host to map; -1 for a buffer of no memory.
  int fd() const { return fd_; }

  // Makes the size `bytes`. Without room for them the buffer is replaced by a new one with room
  // for `bytes` plus 1/16 (a plan rebuilt after the first step moves the ranges a little), and
  // what it held is gone; within its capacity the bytes stay as they were.
  absl::Status Resize(uint64_t bytes);

  // Whether another process keeps these pages (it holds a lock on the file): the buffer must not
  // be written then. A lock that cannot be looked at counts as held.
  bool HeldElsewhere() const;
  // A buddy was handed these pages and may keep them without having said so (a push with no
  // answer): the buffer is never written again, only dropped.
  void Retire() { retired_ = true; }
  bool retired() const { return retired_; }

 private:
  void Release();

  int fd_ = -1;
  char* base_ = nullptr;
  uint64_t size_ = 0;
  uint64_t capacity_ = 0;
  std::atomic<bool> retired_{false};  // set by the pushing thread, read where it is reused
};

}  // namespace shard
