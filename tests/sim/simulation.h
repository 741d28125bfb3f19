// A deterministic simulation of the control plane, in the style of FoundationDB's and
// TigerBeetle's: the real coordinator (CoordinatorCore and its managers: world, elastic, plan,
// checkpoints, rendezvous, journal) and the real worker protocol (one WorkerCore per worker
// process: join, heartbeat, the lease, what a generation's end means, leave) driven by a
// simulated clock and network, a simulated data path (rendezvous, self-check, plan, train in
// lockstep, checkpoint, pause), and faults: workers killed, stopped and resumed,
// restarted or replaced at once or late, the coordinator crashed (losing what it had not
// fsynced) and restarted on its state, and operators resizing, draining, saving, restoring and
// stopping. One seed decides everything; a failing seed replays exactly.
//
// Links fail too: a partition cuts the link between two workers (or one worker and all its
// peers) for a while; a connect across it fails at rendezvous and reports the peer (as
// worker/agent.cc's connect probe does), a collective across it times out.
//
// After every event the invariants are checked (generations only grow, one live worker per
// rank, no committed checkpoint lost or changed, the restore point is committed, what is on
// disk equals what is in memory, no two generations train at once, a world that trains has
// no cut link between its members); once faults stop, the job must finish (or stop, if an
// operator said so) within a bounded time, with the parameters an undisturbed run computes.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace shard::sim {

// Which scenarios a seed draws. Some bugs need a rare chain of events (a world resized while it
// forms, then taken back by a restarted coordinator); a profile weights the draws toward one
// family so that such a chain comes within thousands of seeds, not hundreds of thousands. A seed
// means the same scenario only under the same profile; kMixed is every seed's default.
enum class Profile {
  kMixed,
  // Operators resize and the coordinator restarts often (half the resizes and drains are followed
  // by a crash), while worlds form slowly and standbys wait; once faults stop, lost workers stay
  // lost where the world can re-form without them: the world's membership rules under reshapes
  // and restarts.
  kReshapeAndRestart,
  // Workers are SIGSTOPped for longer, mostly as a generation starts, while checkpoints are
  // frequent, few are kept, and operators restore often: a worker that outlives its generation
  // and its restore point.
  kStoppedWorker,
};

// "mixed", "reshape-and-restart", "stopped-worker".
std::string ProfileName(Profile profile);
std::optional<Profile> ParseProfile(absl::string_view name);
// The names above, comma-separated, for --help and errors.
std::string ProfileNames();

struct SimulationOptions {
  uint64_t seed = 1;
  Profile profile = Profile::kMixed;
  bool verbose = false;  // log every event and the coordinator's own log
};

struct SimulationResult {
  bool passed = false;
  std::string failure;  // the broken invariant or liveness property, with context
  int64_t events = 0;
  absl::Duration simulated;
  // What happened, for the summary.
  int worker_kills = 0;
  int worker_stops = 0;
  int training_stalls = 0;  // a worker's training thread hung while it went on heartbeating
  int partitions = 0;       // links between workers cut (and healed later)
  int coordinator_crashes = 0;
  int admin_calls = 0;
  int generations = 0;
  int checkpoints = 0;
  int memory_restores = 0;         // generations that restored a snapshot from workers' memory
  int disk_restores = 0;           // ... a checkpoint from disk
  int memory_restore_failures = 0;  // a holder did not serve: the generation ended
  int worker_failures = 0;  // a worker's training failed with an error: it left failed
  bool finished = false;             // trained to the end
  bool stopped_by_operator = false;  // an operator's stop came first
  bool job_failed = false;  // more workers failed than --max-worker-failures allows
};

SimulationResult RunSimulation(const SimulationOptions& options);

}  // namespace shard::sim
