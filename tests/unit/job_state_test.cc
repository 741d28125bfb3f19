// The job's phase machine: the transitions the coordinator relies on, the ends that absorb
// every event, and docs/control-plane.md showing the table the function computes.
#include "common/job_state.h"

#include <fstream>
#include <sstream>
#include <string>

#include "gtest/gtest.h"

namespace shard {
namespace {

JobState Walk(JobState state, std::initializer_list<JobEvent> events, StopKind stop) {
  for (JobEvent event : events) state = NextJobState(state, event, stop);
  return state;
}

TEST(JobStateTest, AJobFormsRunsReshapesAndFinishes) {
  const StopKind none = StopKind::kNone;
  EXPECT_EQ(NextJobState(JobState::kForming, JobEvent::kRanksHeld, none), JobState::kRunning);
  EXPECT_EQ(NextJobState(JobState::kRunning, JobEvent::kPauseRequested, none),
            JobState::kReshaping);
  // The reshape applied (or the generation ended under it): the new generation runs.
  EXPECT_EQ(NextJobState(JobState::kReshaping, JobEvent::kGenerationEnded, none),
            JobState::kRunning);
  // A death while reshaping drops the reshape with the generation.
  EXPECT_EQ(NextJobState(JobState::kReshaping, JobEvent::kRankFreed, none), JobState::kForming);
  EXPECT_EQ(NextJobState(JobState::kRunning, JobEvent::kRankFreed, none), JobState::kForming);
  // A pause is asked only of a running world; a generation ending elsewhere changes nothing.
  EXPECT_EQ(NextJobState(JobState::kForming, JobEvent::kPauseRequested, none), JobState::kForming);
  EXPECT_EQ(NextJobState(JobState::kRunning, JobEvent::kGenerationEnded, none), JobState::kRunning);
  EXPECT_EQ(Walk(JobState::kRunning, {JobEvent::kTrainingFinished, JobEvent::kLastWorkerGone},
                 StopKind::kTrained),
            JobState::kFinished);
  EXPECT_EQ(Walk(JobState::kForming, {JobEvent::kStopRequested, JobEvent::kRanksHeld,
                                      JobEvent::kLastWorkerGone},
                 StopKind::kOperator),
            JobState::kFinished);
  EXPECT_EQ(Walk(JobState::kReshaping, {JobEvent::kJobFailed, JobEvent::kLastWorkerGone},
                 StopKind::kFailed),
            JobState::kFailed);
  // Workers leaving a job that does not stop end nothing.
  EXPECT_EQ(NextJobState(JobState::kForming, JobEvent::kLastWorkerGone, none), JobState::kForming);
}

TEST(JobStateTest, TheEndsAbsorbEveryEvent) {
  for (JobState end : {JobState::kFinished, JobState::kFailed}) {
    for (JobEvent event : kAllJobEvents) {
      for (StopKind stop : {StopKind::kOperator, StopKind::kTrained, StopKind::kFailed}) {
        EXPECT_EQ(NextJobState(end, event, stop), end)
            << JobStateName(end) << " on " << JobEventName(event);
      }
    }
  }
}

TEST(JobStateTest, OnlyStoppingEventsSetAStopKind) {
  EXPECT_EQ(StopKindOf(JobEvent::kStopRequested), StopKind::kOperator);
  EXPECT_EQ(StopKindOf(JobEvent::kTrainingFinished), StopKind::kTrained);
  EXPECT_EQ(StopKindOf(JobEvent::kJobFailed), StopKind::kFailed);
  for (JobEvent event : {JobEvent::kRanksHeld, JobEvent::kRankFreed, JobEvent::kPauseRequested,
                         JobEvent::kGenerationEnded, JobEvent::kLastWorkerGone}) {
    EXPECT_EQ(StopKindOf(event), StopKind::kNone) << JobEventName(event);
  }
}

TEST(JobStateTest, TheDocsShowTheTableTheFunctionComputes) {
  std::ifstream file(std::string(SHARD_SOURCE_DIR) + "/docs/control-plane.md");
  ASSERT_TRUE(file.good());
  std::stringstream docs;
  docs << file.rdbuf();
  EXPECT_NE(docs.str().find(JobStateTable()), std::string::npos)
      << "docs/control-plane.md must show this table, as computed by NextJobState:\n"
      << JobStateTable();
}

}  // namespace
}  // namespace shard
