// The worker's step reports (worker/stats_reporter.h): coalesced to the newest, never queued
// behind a slow coordinator, and the newest always sent before the reporter stops.
#include "worker/stats_reporter.h"

#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"

namespace shard {
namespace {

v1::ReportStepStatsRequest Report(int64_t step) {
  v1::ReportStepStatsRequest report;
  report.mutable_stats()->set_step(step);
  return report;
}

// Steps 1..1000 are submitted while the coordinator answers the first report: once it answers,
// only the newest of the rest is sent, and a stop sends nothing more.
TEST(StatsReporterTest, ReportsSubmittedWhileOneIsSentCoalesceToTheNewest) {
  absl::Mutex mu;
  std::vector<int64_t> sent;
  absl::Notification first_arrived;
  absl::Notification answer;
  {
    StatsReporter reporter(
        [&](const v1::ReportStepStatsRequest& report) {
          {
            absl::MutexLock lock(&mu);
            sent.push_back(report.stats().step());
          }
          if (!first_arrived.HasBeenNotified()) {
            first_arrived.Notify();
            answer.WaitForNotification();
          }
          return absl::OkStatus();
        },
        absl::ZeroDuration());
    reporter.Submit(Report(1));
    first_arrived.WaitForNotification();
    for (int64_t step = 2; step <= 1000; ++step) reporter.Submit(Report(step));
    answer.Notify();
  }
  EXPECT_EQ(sent, (std::vector<int64_t>{1, 1000}));
}

// A stop does not wait out the pace: the newest report is sent at once, and the reporter
// returns. (An hour's pace would hang the test otherwise.)
TEST(StatsReporterTest, AStopSendsTheNewestReportWithoutWaitingOutThePace) {
  absl::Mutex mu;
  std::vector<int64_t> sent;
  {
    StatsReporter reporter(
        [&](const v1::ReportStepStatsRequest& report) {
          absl::MutexLock lock(&mu);
          sent.push_back(report.stats().step());
          return report.stats().step() == 1 ? absl::UnavailableError("coordinator away")
                                            : absl::OkStatus();
        },
        absl::Hours(1));
    reporter.Submit(Report(1));
    // Once the first was sent (and failed), the reporter waits out its pace; these replace one
    // another meanwhile.
    auto first_sent = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return !sent.empty(); };
    {
      absl::MutexLock lock(&mu);
      mu.Await(absl::Condition(&first_sent));
    }
    reporter.Submit(Report(2));
    reporter.Submit(Report(3));
  }
  EXPECT_EQ(sent, (std::vector<int64_t>{1, 3}));
}

}  // namespace
}  // namespace shard
