// The worker's reports of the snapshot shards it holds (worker/snapshot_reporter.h): what is
// reported within a window goes out in one call that means what the reports meant one after
// another (the coordinator drops before it adds), what is pending is sent when the reporter
// stops, and nothing reported is lost.
#include "worker/snapshot_reporter.h"

#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/snapshot.h"
#include "gtest/gtest.h"

namespace shard {
namespace {

SnapshotShard Shard(int64_t step, int rank) {
  SnapshotShard shard;
  shard.id = SnapshotId(step, 1);
  shard.step = step;
  shard.rank = rank;
  return shard;
}

struct Call {
  std::vector<std::string> held;  // "id/rank"
  std::vector<std::string> dropped;
};

class Calls {
 public:
  SnapshotReporter::Send Sender() {
    return [this](const std::vector<SnapshotShard>& held, const std::vector<std::string>& dropped) {
      Call call{{}, dropped};
      for (const SnapshotShard& shard : held) {
        call.held.push_back(absl::StrCat(shard.id, "/", shard.rank));
      }
      absl::MutexLock lock(&mu_);
      calls_.push_back(std::move(call));
    };
  }
  std::vector<Call> Take() {
    absl::MutexLock lock(&mu_);
    return std::exchange(calls_, {});
  }
  // Waits until the calls so far hold `held` shards in all.
  void AwaitHeld(size_t held) {
    absl::MutexLock lock(&mu_);
    auto enough = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      size_t n = 0;
      for (const Call& call : calls_) n += call.held.size();
      return n >= held;
    };
    mu_.Await(absl::Condition(&enough));
  }

 private:
  absl::Mutex mu_;
  std::vector<Call> calls_ ABSL_GUARDED_BY(mu_);
};

// An hour's window: everything reported goes in the one call the stop sends, merged. Rank 0's
// shard of step 10 was held and then dropped, so it is not sent as held; the drop is sent (the
// coordinator may have heard of it before).
TEST(SnapshotReporterTest, ReportsWithinAWindowAreMergedAsTheyWouldApplyInTurn) {
  Calls calls;
  {
    SnapshotReporter reporter(calls.Sender(), absl::Hours(1));
    reporter.Report({Shard(10, 0)}, {});
    reporter.Report({Shard(10, 3)}, {});  // a buddy's replica
    reporter.Report({Shard(20, 0)}, {SnapshotId(10, 1)});
    reporter.Report({Shard(20, 3)}, {});
  }
  const std::vector<Call> sent = calls.Take();
  ASSERT_EQ(sent.size(), 1u);
  const std::string step20 = SnapshotId(20, 1);
  EXPECT_EQ(sent[0].held, (std::vector<std::string>{step20 + "/0", step20 + "/3"}));
  EXPECT_EQ(sent[0].dropped, (std::vector<std::string>{SnapshotId(10, 1)}));
}

// Without a window, reports go out as they come, merged or not: every shard held is sent once,
// without a stop, in the order reported.
TEST(SnapshotReporterTest, EveryReportIsSentWithoutAStop) {
  Calls calls;
  SnapshotReporter reporter(calls.Sender(), absl::ZeroDuration());
  std::vector<std::string> reported;
  for (int64_t step = 1; step <= 50; ++step) {
    reporter.Report({Shard(step, 1)}, {});
    reported.push_back(absl::StrCat(SnapshotId(step, 1), "/1"));
  }
  calls.AwaitHeld(reported.size());
  std::vector<std::string> sent;
  for (const Call& call : calls.Take()) {
    EXPECT_TRUE(call.dropped.empty());
    sent.insert(sent.end(), call.held.begin(), call.held.end());
  }
  EXPECT_EQ(sent, reported);
}

// A stop with nothing pending sends nothing.
TEST(SnapshotReporterTest, AStopWithNothingPendingSendsNothing) {
  Calls calls;
  { SnapshotReporter reporter(calls.Sender(), absl::Hours(1)); }
  EXPECT_TRUE(calls.Take().empty());
}

}  // namespace
}  // namespace shard
