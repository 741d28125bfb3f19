// The engine's collectives in one order: a FIFO of operations (a bucket's reduction, a unit's
// parameter gather) run one after the other on a communication thread, so that compute goes on
// while they run. Every rank submits the same operations in the same order (the order of its
// program: the same model makes the same calls), which is what keeps the collectives matched.
//
//   CommunicationQueue queue(/*threaded=*/true, bind);
//   Ticket t = queue.Submit([&] { return communicator.AllGather(...); });
//   ... compute ...
//   SHARD_RETURN_IF_ERROR(queue.Wait(t));   // the gather is done (issued, on a GPU)
//
// Without a thread, Submit runs the operation at once on the caller's thread. The first error
// ends the queue: every later Wait returns it, and later operations are dropped (the
// communicator is aborted or broken by then; a generation that failed is re-formed).
//
// Thread-safe: one thread submits and waits; the queue's own thread runs the operations.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"

namespace shard {

class CommunicationQueue {
 public:
  using Ticket = int64_t;  // 0: nothing to wait for
  using Operation = std::function<absl::Status()>;

  // `bind` runs first on the thread (a GPU binds its device there).
  CommunicationQueue(bool threaded, std::function<absl::Status()> bind);
  ~CommunicationQueue();
  CommunicationQueue(const CommunicationQueue&) = delete;
  CommunicationQueue& operator=(const CommunicationQueue&) = delete;

  bool threaded() const { return thread_.joinable(); }
  Ticket Submit(Operation operation);
  // Waits until operation `ticket` (and so every earlier one) ran; the queue's error if any did
  // not succeed.
  absl::Status Wait(Ticket ticket);
  // Waits for every operation submitted so far.
  absl::Status Drain();
  bool Done(Ticket ticket);

 private:
  void Loop(const std::function<absl::Status()>& bind);

  absl::Mutex mu_;
  std::deque<Operation> pending_ ABSL_GUARDED_BY(mu_);
  Ticket submitted_ ABSL_GUARDED_BY(mu_) = 0;
  Ticket completed_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status error_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace shard
