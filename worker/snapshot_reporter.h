// Tells the coordinator which snapshot shards this worker holds, from its own thread, the reports
// of a short window merged into one call. At each snapshot a worker keeps its own shard and, at
// about the same moment, its buddy's replica: one call for both instead of two halves the CPU
// time workers and coordinator spend on these calls (docs/recovery.md). A merged report
// means what the reports in it meant one after another: the coordinator forgets what a report
// drops before it adds what it holds, so a shard held and then dropped in one window is not sent
// as held.
#pragma once

#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/snapshot.h"

namespace shard {

class SnapshotReporter {
 public:
  // Sends one report; the reporter does not retry (the caller's send knows what a failure means
  // for the worker: WorkerAgent tells everything it holds again before its next heartbeat).
  using Send = std::function<void(const std::vector<SnapshotShard>& held,
                                  const std::vector<std::string>& dropped)>;

  explicit SnapshotReporter(Send send, absl::Duration window = absl::Milliseconds(10));
  ~SnapshotReporter();  // sends what is pending at once, then stops

  SnapshotReporter(const SnapshotReporter&) = delete;
  SnapshotReporter& operator=(const SnapshotReporter&) = delete;

  // This worker holds `held` now and no longer holds any shard of the snapshots `dropped`: sent
  // within `window`, with whatever else is reported meanwhile.
  void Report(const std::vector<SnapshotShard>& held, const std::vector<std::string>& dropped);

 private:
  void Loop();

  const Send send_;
  const absl::Duration window_;
  absl::Mutex mu_;
  std::vector<SnapshotShard> held_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> dropped_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace shard
