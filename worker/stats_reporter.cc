#include "worker/stats_reporter.h"

#include <utility>

#include "common/logging.h"
#include "spdlog/spdlog.h"

namespace shard {

StatsReporter::StatsReporter(Send send, absl::Duration min_interval)
    : send_(std::move(send)), min_interval_(min_interval), thread_([this] { Loop(); }) {}

StatsReporter::~StatsReporter() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  thread_.join();
}

void StatsReporter::Submit(v1::ReportStepStatsRequest report) {
  absl::MutexLock lock(&mu_);
  newest_ = std::move(report);
}

void StatsReporter::Loop() {
  while (true) {
    v1::ReportStepStatsRequest report;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stopping_ || newest_.has_value();
      };
      mu_.Await(absl::Condition(&ready));
      if (!newest_.has_value()) return;  // stopping, and everything was sent
      report = *std::move(newest_);
      newest_.reset();
    }
    // Statistics are best effort: one warning per outage, not one per step; reports that
    // outlived their generation (a re-formation) are expected to be refused.
    const absl::Status sent = send_(report);
    if (!sent.ok() && !absl::IsAborted(sent)) {
      if (failed_in_a_row_++ == 0) {
        spdlog::warn("could not report step {}: {} (further failures are not logged until a "
                     "report gets through)",
                     report.stats().step(), sent.message());
      }
    } else if (failed_in_a_row_ > 0) {
      spdlog::info("step reports get through again after {} failed", failed_in_a_row_);
      failed_in_a_row_ = 0;
    }
    // The pace: what is submitted meanwhile replaces what came before it. A stop ends the wait
    // (the newest report is still sent).
    absl::MutexLock lock(&mu_);
    auto stopping = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopping_; };
    mu_.AwaitWithTimeout(absl::Condition(&stopping), min_interval_);
  }
}

}  // namespace shard
