// Crash points for tests of crash safety: when the environment variable SHARD_FAULT names a
// point, the process kills itself (SIGKILL) on reaching it, exactly as a power cut or the OOM
// killer would; with SHARD_FAULT_SKIP=N it passes the point N times first. Points:
// "shard-before-sync" (a worker wrote its checkpoint shard but has not synced or renamed it),
// "manifest-before-write" (every shard is on disk, no manifest yet), "manifest-before-rename"
// (the manifest is written under its temporary name), "snapshot-push-midway" (a worker sent half
// of its snapshot shard to a buddy over TCP, or, on the same host, its description but not yet
// its pages).
//
// Stall points, for tests of hung processes: when SHARD_STALL names a point, the process stops
// itself (SIGSTOP) the first time it reaches it, as a hung pod would, heartbeats included; the
// test resumes it with SIGCONT. Points: "before-restore" (a worker of a generation is about to
// read the checkpoint it restores).
//
// A stuck training thread, for tests of the progress lease: with SHARD_STALL_TRAINING=N the
// built-in trainer's thread stops for good when it is about to run step N (1-based), outside any
// collective, while the process goes on heartbeating, as a hung kernel or a deadlocked data
// loader would leave it. A slow one, for tests that act while a tiny model trains: with
// SHARD_SLOW_STEP_MS=N each of its steps takes N ms more, as on a slower machine.
//
// Disk and memory faults, for tests of what a save or a restore does when the hardware fails
// (docs/checkpoints.md, "When the disk fails"; docs/recovery.md). This kernel offers no slow or
// failing block device (no dm-delay, dm-flakey or FUSE), so these stand in for one; a full disk
// needs no hook (a small tmpfs as the checkpoint directory gives real ENOSPC).
// - SHARD_SLOW_WRITE_MS=N: each MiB (or part of one) of a checkpoint shard this process writes
//   takes N ms more, as on a disk slowed to a crawl.
// - SHARD_WRITE_ERROR=EIO (or ENOSPC): a checkpoint shard write fails half-way with that error,
//   as a failing device's would; with SHARD_WRITE_ERROR_TIMES=N only the first N shards fail.
// - SHARD_CORRUPT_REPLICAS=1: every replica this worker keeps for a buddy has one bit flipped in
//   memory once it was received and verified, as a memory error would leave it.
#pragma once

#include <cstdint>

#include "absl/strings/string_view.h"

namespace shard {

void FaultPoint(absl::string_view name);
void StallPoint(absl::string_view name);
void BeforeTrainingStep(int64_t step);

// SHARD_SLOW_WRITE_MS, or 0.
int64_t SlowWriteMillisPerMiB();
// The errno the shard write starting now must fail with (SHARD_WRITE_ERROR), or 0; counts the
// write against SHARD_WRITE_ERROR_TIMES.
int InjectedWriteError();
// Whether SHARD_CORRUPT_REPLICAS is set.
bool ReplicasCorrupted();
// With SHARD_CORRUPT_REPLICAS set, flips one bit of `bytes` (a replica just verified and about
// to be kept, `what` in the message) and says so on stderr.
void CorruptReplicaIfAsked(char* bytes, uint64_t size, absl::string_view what);

}  // namespace shard
