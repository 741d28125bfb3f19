// Sends step statistics to the coordinator from its own thread, so that a training step never
// waits for an RPC. Reports queue up to a bound; past it the oldest are dropped (and counted),
// since statistics must never slow training down.
#pragma once

#include <deque>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "worker/coordinator_client.h"

namespace shard {

class StatsReporter {
 public:
  explicit StatsReporter(CoordinatorClient* client, size_t max_queued = 1024);
  ~StatsReporter();  // sends what is queued, then stops

  void Submit(v1::ReportStepStatsRequest report);

 private:
  void Loop();

  CoordinatorClient* client_;
  const size_t max_queued_;
  absl::Mutex mu_;
  std::deque<v1::ReportStepStatsRequest> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  int64_t dropped_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t failed_in_a_row_ = 0;  // reporting thread only
  std::thread thread_;
};

}  // namespace shard
