// GenerationHandoff between the agent's thread and a training thread: a generation offered is
// taken, trained and returned with its result; a close ends both sides with its reason, whoever
// waits at the time.
#include "worker/generation_handoff.h"

#include <memory>
#include <thread>

#include "gtest/gtest.h"
#include "tests/support/status_assertions.h"
#include "worker/dataplane/gloo_communicator.h"
#include "worker/dataplane/key_value_store.h"
#include "worker/dataplane/plan_provider.h"

namespace shard {
namespace {

class GenerationHandoffTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<Communicator>> created =
        CreateGlooCommunicator(&store_, GlooOptions{});
    SHARD_ASSERT_OK(created.status());
    communicator_ = *std::move(created);
  }

  // The agent's side, as WorkerOptions::trainer calls it.
  absl::StatusOr<TrainResult> Offer(GenerationHandoff& handoff, int64_t generation) {
    TrainerOptions options;
    options.generation = generation;
    return handoff.Train(job_, *communicator_, plans_, options);
  }

  InProcessKeyValueStore store_;
  std::unique_ptr<Communicator> communicator_;
  LocalPlanProvider plans_{PlanOptions{}};
  JobConfig job_;
};

TEST_F(GenerationHandoffTest, EachGenerationIsTrainedByTheTrainingThreadAndItsResultReturned) {
  GenerationHandoff handoff;
  std::thread training([&] {
    for (int64_t expected = 1; expected <= 3; ++expected) {
      absl::StatusOr<std::optional<GenerationHandoff::Generation>> next = handoff.Next();
      ASSERT_TRUE(next.ok() && next->has_value()) << next.status();
      EXPECT_EQ((*next)->options->generation, expected);
      EXPECT_EQ((*next)->job, &job_);
      EXPECT_EQ((*next)->communicator, communicator_.get());
      if (expected == 2) {
        handoff.Return(absl::AbortedError("generation 2 ended"));
      } else {
        TrainResult result;
        result.steps = 10 * expected;
        handoff.Return(result);
      }
    }
    // The agent ended well: no more generations, and no error.
    absl::StatusOr<std::optional<GenerationHandoff::Generation>> last = handoff.Next();
    ASSERT_TRUE(last.ok()) << last.status();
    EXPECT_FALSE(last->has_value());
  });
  absl::StatusOr<TrainResult> first = Offer(handoff, 1);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->steps, 10);
  EXPECT_TRUE(absl::IsAborted(Offer(handoff, 2).status()));
  absl::StatusOr<TrainResult> third = Offer(handoff, 3);
  ASSERT_TRUE(third.ok()) << third.status();
  EXPECT_EQ(third->steps, 30);
  handoff.Close(absl::OkStatus());
  training.join();
}

// The training thread gives up (the script raised) while the agent waits for its result: the
// agent's wait ends, cancelled with the reason, and so does every later offer.
TEST_F(GenerationHandoffTest, AClosedHandoffEndsTheAgentsWaitWithTheReason) {
  GenerationHandoff handoff;
  std::thread training([&] {
    absl::StatusOr<std::optional<GenerationHandoff::Generation>> next = handoff.Next();
    ASSERT_TRUE(next.ok() && next->has_value()) << next.status();
    handoff.Close(absl::InternalError("the training script raised"));
  });
  const absl::Status waited = Offer(handoff, 1).status();
  training.join();
  EXPECT_TRUE(absl::IsCancelled(waited)) << waited;
  EXPECT_NE(waited.message().find("the training script raised"), absl::string_view::npos)
      << waited;
  EXPECT_TRUE(absl::IsCancelled(Offer(handoff, 2).status()));
}

// The agent ends with an error (the coordinator was lost): the training thread waiting for a
// generation hears it, and a result returned late goes nowhere.
TEST_F(GenerationHandoffTest, TheAgentsErrorReachesTheTrainingThread) {
  GenerationHandoff handoff;
  std::thread agent([&] { handoff.Close(absl::UnavailableError("lost the coordinator")); });
  absl::StatusOr<std::optional<GenerationHandoff::Generation>> next = handoff.Next();
  agent.join();
  EXPECT_TRUE(absl::IsUnavailable(next.status())) << next.status();
  handoff.Return(TrainResult{});  // nothing was taken: ignored
  EXPECT_TRUE(absl::IsUnavailable(handoff.Next().status()));
}

}  // namespace
}  // namespace shard
