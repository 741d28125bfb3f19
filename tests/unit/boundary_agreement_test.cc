// The step boundary's agreement runs one step ahead (worker/dataplane/training_session.h): what
// the ranks know at the end of a step (the coordinator's orders, their saves in flight, their
// loss shares) is all-reduced while the next step computes, and the boundary after acts on it.
// On ranks that train as threads over Gloo, with orders that only one rank knows: every rank
// saves and pauses at the same boundary, the one after the order was first known, and every step
// is reported at its boundary with the global loss of the step before (the step training pauses
// after with its own), bit for bit the loss an undisturbed run reports for that step.
#include <filesystem>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/mlp_data.h"
#include "gtest/gtest.h"
#include "tests/support/train_on_threads.h"

namespace shard {
namespace {

const std::vector<int64_t> kWidths = {12, 40, 24, 6};
constexpr int kWorld = 3;

JobConfig Job(const std::string& name) {
  const std::string root =
      absl::StrCat(::testing::TempDir(), "/shard-boundary-agreement-test-", getpid(), "/", name);
  std::filesystem::remove_all(root);
  return SmallMlpJob("agree", root, kWidths,
                     ::testing::TempDir() + "/shard-boundary-agreement-test-data.safetensors",
                     kWorld, /*global_batch=*/24, /*steps=*/12, /*seed=*/11);
}

struct RankLog {
  int orders_polled = 0;             // boundaries this rank reached
  std::vector<StepRecord> reported;  // OnStep, in call order
  std::vector<std::pair<int64_t, int64_t>> saved;  // (step, request) of each checkpoint shard
};

using KnownOrders = std::function<StepOrders(int rank, int boundary)>;

// A rank's observer: answers its polls for orders with `orders` and logs the rest into `log`
// (its checkpoint shards, which the writer thread reports, under `mu`).
class RankObserver : public TrainingObserver {
 public:
  RankObserver(int rank, const KnownOrders& orders, RankLog& log, absl::Mutex& mu)
      : rank_(rank), orders_(orders), log_(log), mu_(mu) {}

  StepOrders Orders() override { return orders_(rank_, ++log_.orders_polled); }
  void OnStep(const StepRecord& record) override { log_.reported.push_back(record); }
  void OnCheckpoint(const SavedShard& shard) override {
    absl::MutexLock lock(&mu_);
    log_.saved.emplace_back(shard.step, shard.request);
  }

 private:
  const int rank_;
  const KnownOrders& orders_;
  RankLog& log_;
  absl::Mutex& mu_;
};

// The global loss of each step (by step) that `log`'s records carry.
std::map<int64_t, double> LossesByStep(const RankLog& log) {
  std::map<int64_t, double> losses;
  for (const StepRecord& record : log.reported) {
    if (record.loss_step > 0) losses[record.loss_step] = record.loss;
  }
  return losses;
}

// Trains `job` on threads; `orders(rank, boundary)` is what rank `rank` knows at its
// `boundary`-th step boundary (1-based).
std::vector<RankLog> Train(const JobConfig& job, const KnownOrders& orders,
                           std::vector<TrainResult>* results) {
  if (!std::filesystem::exists(job.data_path)) {
    EXPECT_TRUE(GenerateMlpData(kWidths, 96, 4, job.data_path).ok());
  }
  std::vector<RankLog> logs(job.world_size);
  absl::Mutex mu;
  std::vector<RankObserver> observers;
  for (int rank = 0; rank < job.world_size; ++rank) {
    observers.emplace_back(rank, orders, logs[rank], mu);
  }
  RankThreadsOptions run;
  run.results = results;
  run.configure = [&](int rank, TrainerOptions* trainer) { trainer->observer = &observers[rank]; };
  TrainMlpOnThreads(job, run);
  return logs;
}

TEST(BoundaryAgreementTest, OrdersOneRankKnowsAreActedOnByEveryRankAtTheNextBoundary) {
  // The reference: the same job with no orders.
  const JobConfig reference_job = Job("reference");
  std::vector<TrainResult> reference_results;
  const std::vector<RankLog> reference = Train(
      reference_job, [](int, int) { return StepOrders{}; }, &reference_results);
  ASSERT_EQ(reference[0].reported.size(), static_cast<size_t>(reference_job.steps));
  const std::map<int64_t, double> reference_losses = LossesByStep(reference[0]);
  // Every step's loss is reported (at the next boundary), but for the one before the last: the
  // last boundary reports its own step's.
  std::vector<int64_t> reported_steps;
  for (const auto& [step, loss] : reference_losses) reported_steps.push_back(step);
  const std::vector<int64_t> every_step_but_11 = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12};
  ASSERT_EQ(reported_steps, every_step_but_11);

  // Rank 1 knows a save request from its 3rd boundary on, rank 2 a pause (to a disk
  // checkpoint) from its 6th: saves at step 4 and at step 7, where training pauses.
  const JobConfig job = Job("orders");
  std::vector<TrainResult> results;
  const std::vector<RankLog> logs = Train(
      job,
      [](int rank, int boundary) {
        StepOrders known;
        if (rank == 1 && boundary >= 3) known.save_request = 1;
        if (rank == 2 && boundary >= 6) known.save_request = known.pause_request = 2;
        return known;
      },
      &results);
  ASSERT_EQ(results.size(), static_cast<size_t>(kWorld));
  for (int rank = 0; rank < kWorld; ++rank) {
    SCOPED_TRACE(absl::StrCat("rank ", rank));
    EXPECT_EQ(results[rank].paused_at, 7);
    EXPECT_EQ(results[rank].checkpoints_saved, 2);
    const std::vector<std::pair<int64_t, int64_t>> expected_saves = {{4, 1}, {7, 2}};
    EXPECT_EQ(logs[rank].saved, expected_saves);
    const RankLog& log = logs[rank];
    ASSERT_EQ(log.reported.size(), 7u);
    for (size_t i = 0; i < log.reported.size(); ++i) {
      const StepRecord& record = log.reported[i];
      EXPECT_EQ(record.step, static_cast<int64_t>(i + 1));
      // Reported at its boundary with the step before's loss; the step it pauses after waits
      // for its own.
      EXPECT_EQ(record.loss_step, record.step < 7 ? record.step - 1 : 7);
      if (record.loss_step == 0) continue;
      // The global loss, bit for bit the undisturbed run's and the same on every rank.
      EXPECT_EQ(record.loss, reference_losses.at(record.loss_step)) << "step " << record.step;
      EXPECT_EQ(record.loss, logs[0].reported[i].loss) << "step " << record.step;
    }
    EXPECT_EQ(results[rank].first_loss, reference_losses.at(1));
    EXPECT_EQ(results[rank].last_loss, reference_losses.at(7));
  }
  EXPECT_EQ(reference_results[0].first_loss, reference_losses.at(1));
  EXPECT_EQ(reference_results[0].last_loss, reference_losses.at(reference_job.steps));
  EXPECT_TRUE(reference[0].saved.empty());
}

}  // namespace
}  // namespace shard
