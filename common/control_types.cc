#include "common/control_types.h"

namespace shard {

absl::string_view WorkerStateName(WorkerState state) {
  switch (state) {
    case WorkerState::kJoining: return "joining";
    case WorkerState::kReady: return "ready";
    case WorkerState::kFailed: return "failed";
    case WorkerState::kLeft: return "left";
    case WorkerState::kDead: return "dead";
    case WorkerState::kStandby: return "standby";
    case WorkerState::kLeaving: return "leaving";
  }
  return "unknown";
}

absl::string_view SelfCheckStateName(SelfCheckState state) {
  switch (state) {
    case SelfCheckState::kPending: return "pending";
    case SelfCheckState::kPassed: return "passed";
    case SelfCheckState::kFailed: return "failed";
  }
  return "unknown";
}

absl::string_view LinkFailureName(LinkFailure how) {
  switch (how) {
    case LinkFailure::kConnect: return "connect";
    case LinkFailure::kSend: return "send";
    case LinkFailure::kReceive: return "receive";
  }
  return "unknown";
}

absl::string_view OverlapStatusName(OverlapStatus status) {
  switch (status) {
    case OverlapStatus::kUninitialized: return "UNINITIALIZED";
    case OverlapStatus::kRebuilt: return "DDP_HAS_REBUILT_BUCKETS";
    case OverlapStatus::kInitialized: return "INITIALIZED";
  }
  return "UNKNOWN";
}

}  // namespace shard
