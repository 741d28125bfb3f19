#include "worker/stats_reporter.h"

#include "common/logging.h"
#include "spdlog/spdlog.h"

namespace shard {

StatsReporter::StatsReporter(CoordinatorClient* client, size_t max_queued)
    : client_(client), max_queued_(max_queued), thread_([this] { Loop(); }) {}

StatsReporter::~StatsReporter() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  thread_.join();
}

void StatsReporter::Submit(v1::ReportStepStatsRequest report) {
  absl::MutexLock lock(&mu_);
  if (queue_.size() >= max_queued_) {
    queue_.pop_front();
    ++dropped_;
  }
  queue_.push_back(std::move(report));
}

void StatsReporter::Loop() {
  while (true) {
    v1::ReportStepStatsRequest report;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stopping_ || !queue_.empty();
      };
      mu_.Await(absl::Condition(&ready));
      if (queue_.empty()) {
        if (dropped_ > 0) spdlog::warn("{} step reports were dropped (coordinator slow)", dropped_);
        return;
      }
      report = std::move(queue_.front());
      queue_.pop_front();
    }
    // Statistics are best effort: one warning per outage, not one per step; reports that
    // outlived their generation (a re-formation) are expected to be refused.
    if (absl::Status sent = client_->ReportStepStats(report); absl::IsAborted(sent)) {
      continue;
    } else if (!sent.ok()) {
      if (failed_in_a_row_++ == 0) {
        spdlog::warn("could not report step {}: {} (further failures are not logged until a "
                     "report gets through)",
                     report.stats().step(), sent.message());
      }
    } else if (failed_in_a_row_ > 0) {
      spdlog::info("step reports get through again after {} failed", failed_in_a_row_);
      failed_in_a_row_ = 0;
    }
  }
}

}  // namespace shard
