// Crash points for tests of crash safety: when the environment variable SHARD_FAULT names a
// point, the process kills itself (SIGKILL) on reaching it, exactly as a power cut or the OOM
// killer would; with SHARD_FAULT_SKIP=N it passes the point N times first. Points:
// "shard-before-sync" (a worker wrote its checkpoint shard but has not synced or renamed it),
// "manifest-before-write" (every shard is on disk, no manifest yet), "manifest-before-rename"
// (the manifest is written under its temporary name), "snapshot-push-midway" (a worker sent half
// of its snapshot shard to a buddy).
//
// Stall points, for tests of hung processes: when SHARD_STALL names a point, the process stops
// itself (SIGSTOP) the first time it reaches it, as a hung pod would, heartbeats included; the
// test resumes it with SIGCONT. Points: "before-restore" (a worker of a generation is about to
// read the checkpoint it restores).
//
// A stuck training thread, for tests of the progress lease: with SHARD_STALL_TRAINING=N the
// built-in trainer's thread stops for good when it is about to run step N (1-based), outside any
// collective, while the process goes on heartbeating, as a hung kernel or a deadlocked data
// loader would leave it.
#pragma once

#include <cstdint>

#include "absl/strings/string_view.h"

namespace shard {

void FaultPoint(absl::string_view name);
void StallPoint(absl::string_view name);
void StallTrainingAt(int64_t step);

}  // namespace shard
