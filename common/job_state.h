// The job's phase: the coordinator's state machine as one enum and one transition function.
// Every rule that moves the job (server/membership.cc, server/world_manager.cc,
// CoordinatorCore::Reconcile) names the event that happened and NextJobState says where it
// leads; nothing derives the phase from member counts or from message text.
// docs/control-plane.md's table of phases is checked against JobStateTable() by a test.
#pragma once

#include <string>

#include "absl/strings/string_view.h"

namespace shard {

enum class JobState {
  kForming,    // a rank of the world has no live worker
  kRunning,    // every rank has a live worker: they connect, check and train
  kReshaping,  // running, with every rank asked to save and pause for a reshape
  kStopping,   // a stop is decided: workers are told to leave
  kFinished,   // stopped (trained to the end, or an operator's stop) and every worker gone
  kFailed,     // stopped because the job cannot go on, and every worker gone
};

// Why a job stops, persisted with the membership: a restarted coordinator tells a job that
// trained to the end (nothing to run) from one an operator stopped or that failed.
enum class StopKind { kNone, kOperator, kTrained, kFailed };

enum class JobEvent {
  kRanksHeld,         // the last free rank of the world got a live worker
  kRankFreed,         // a rank lost its worker (death, leave, eviction, a resize while forming)
  kPauseRequested,    // a reshape asked the ranks of the running generation to save and pause
  kGenerationEnded,   // the generation changed: a pause asked of the old one is over
  kStopRequested,     // an operator's stop or a signal
  kTrainingFinished,  // every rank of the generation reported the end of training
  kJobFailed,         // the job cannot go on (docs/control-plane.md says when)
  kLastWorkerGone,    // no live worker is left while the job stops
};

constexpr JobState kAllJobStates[] = {JobState::kForming,  JobState::kRunning,
                                      JobState::kReshaping, JobState::kStopping,
                                      JobState::kFinished, JobState::kFailed};
constexpr JobEvent kAllJobEvents[] = {
    JobEvent::kRanksHeld,     JobEvent::kRankFreed,        JobEvent::kPauseRequested,
    JobEvent::kGenerationEnded, JobEvent::kStopRequested, JobEvent::kTrainingFinished,
    JobEvent::kJobFailed,     JobEvent::kLastWorkerGone};

// The phase after `event` in `state`; `state` itself where the event changes nothing there.
// `stop` is why the job stops, once it does (it decides how kLastWorkerGone ends it).
JobState NextJobState(JobState state, JobEvent event, StopKind stop);
// The stop kind an event that stops the job sets (kNone for the others).
StopKind StopKindOf(JobEvent event);

// Whether ranks train in this phase (running or reshaping): workers connect and train, and
// a rank that dies ends the generation.
bool Trains(JobState state);
// Whether the job has ended for good (finished or failed).
bool Ended(JobState state);
// Whether a stop is decided (stopping, or ended).
bool Stops(JobState state);

absl::string_view JobStateName(JobState state);  // "forming", "running", ...
absl::string_view JobEventName(JobEvent event);  // as the docs' table names it

// The transition table as docs/control-plane.md shows it: one Markdown row per event, one
// column per phase, "·" where the event changes nothing.
std::string JobStateTable();

}  // namespace shard
