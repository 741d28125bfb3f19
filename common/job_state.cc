#include "common/job_state.h"

#include "absl/strings/str_cat.h"

namespace shard {

JobState NextJobState(JobState state, JobEvent event, StopKind stop) {
  if (Ended(state)) return state;
  switch (event) {
    case JobEvent::kRanksHeld:
      return state == JobState::kForming ? JobState::kRunning : state;
    case JobEvent::kRankFreed:
      return Trains(state) ? JobState::kForming : state;
    case JobEvent::kPauseRequested:
      return state == JobState::kRunning ? JobState::kReshaping : state;
    case JobEvent::kGenerationEnded:
      return state == JobState::kReshaping ? JobState::kRunning : state;
    case JobEvent::kStopRequested:
    case JobEvent::kTrainingFinished:
    case JobEvent::kJobFailed:
      return JobState::kStopping;
    case JobEvent::kLastWorkerGone:
      if (state != JobState::kStopping) return state;
      return stop == StopKind::kFailed ? JobState::kFailed : JobState::kFinished;
  }
  return state;
}

StopKind StopKindOf(JobEvent event) {
  switch (event) {
    case JobEvent::kStopRequested: return StopKind::kOperator;
    case JobEvent::kTrainingFinished: return StopKind::kTrained;
    case JobEvent::kJobFailed: return StopKind::kFailed;
    default: return StopKind::kNone;
  }
}

bool Trains(JobState state) {
  return state == JobState::kRunning || state == JobState::kReshaping;
}

bool Ended(JobState state) { return state == JobState::kFinished || state == JobState::kFailed; }

bool Stops(JobState state) { return state == JobState::kStopping || Ended(state); }

absl::string_view JobStateName(JobState state) {
  switch (state) {
    case JobState::kForming: return "forming";
    case JobState::kRunning: return "running";
    case JobState::kReshaping: return "reshaping";
    case JobState::kStopping: return "stopping";
    case JobState::kFinished: return "finished";
    case JobState::kFailed: return "failed";
  }
  return "unknown";
}

absl::string_view JobEventName(JobEvent event) {
  switch (event) {
    case JobEvent::kRanksHeld: return "every rank held";
    case JobEvent::kRankFreed: return "a rank freed";
    case JobEvent::kPauseRequested: return "pause requested";
    case JobEvent::kGenerationEnded: return "generation ended";
    case JobEvent::kStopRequested: return "stop requested";
    case JobEvent::kTrainingFinished: return "training finished";
    case JobEvent::kJobFailed: return "job failed";
    case JobEvent::kLastWorkerGone: return "last worker gone";
  }
  return "unknown";
}

std::string JobStateTable() {
  std::string table = "| event |";
  std::string rule = "|---|";
  for (JobState state : kAllJobStates) {
    absl::StrAppend(&table, " ", JobStateName(state), " |");
    absl::StrAppend(&rule, "---|");
  }
  absl::StrAppend(&table, "\n", rule, "\n");
  for (JobEvent event : kAllJobEvents) {
    absl::StrAppend(&table, "| ", JobEventName(event), " |");
    for (JobState state : kAllJobStates) {
      // The stop kind matters only to the last worker's departure, where it names the end.
      const JobState next = NextJobState(state, event, StopKind::kOperator);
      const JobState failed = NextJobState(state, event, StopKind::kFailed);
      std::string cell = next == state ? "·" : std::string(JobStateName(next));
      if (failed != next) absl::StrAppend(&cell, " (", JobStateName(failed), " if it failed)");
      absl::StrAppend(&table, " ", cell, " |");
    }
    absl::StrAppend(&table, "\n");
  }
  return table;
}

}  // namespace shard
