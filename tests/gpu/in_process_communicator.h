// A host Communicator for ranks that are threads of one process, for multi-rank tests of the
// staged communicator on a machine without Gloo (the GPU machines have none of our Debian
// packages). Each collective publishes every rank's input, waits for all ranks, lets each rank
// compute its own output from all inputs (ranks in order, so results are deterministic and
// equal to a serial reference), and waits again before anyone reuses a buffer.
// f32, f64 and i64; Abort() wakes every waiting rank with Aborted.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "worker/dataplane/communicator.h"

namespace shard {

class InProcessWorld {
 public:
  explicit InProcessWorld(int size);

  // The communicator of `rank`; call once per rank, use it from that rank's thread.
  std::unique_ptr<Communicator> Join(int rank);

 private:
  friend class InProcessCommunicator;

  // Returns when every rank has arrived; Aborted once the world was aborted.
  absl::Status Arrive();
  void Abort(absl::string_view reason);
  bool aborted() const;
  absl::Status AbortedStatus() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const int size_;
  mutable absl::Mutex mu_;
  int arrived_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
  bool aborted_ ABSL_GUARDED_BY(mu_) = false;
  std::string reason_ ABSL_GUARDED_BY(mu_);
  // The current collective's input of each rank; written before the first Arrive, read between
  // the two.
  std::vector<const void*> inputs_;
};

}  // namespace shard
