// The built-in MLP trained by a job's ranks as threads of one process, over loopback Gloo (or
// shared memory) and an in-memory rendezvous store, with the coordinator's part in checkpoints
// played here: once every rank's shard of a checkpoint is on disk, its manifest is committed.
// Rank 0 writes job.output_dir/final.safetensors. Header-only.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "common/checkpoint.h"
#include "common/job_spec.h"
#include "gtest/gtest.h"
#include "tests/support/checkpoint_commit.h"
#include "tests/support/status_assertions.h"
#include "worker/dataplane/gloo_communicator.h"
#include "worker/dataplane/key_value_store.h"
#include "worker/dataplane/plan_provider.h"
#include "worker/dataplane/shm_communicator.h"
#include "worker/dataplane/trainer.h"

namespace shard {

// The small MLP job these tests train: `world` ranks, Adam (lr 0.01), ZeRO-2, buckets small
// enough that the model has several, no checkpoints or snapshots; its output and checkpoints
// under `root`. Tests change what they exercise.
inline JobConfig SmallMlpJob(const std::string& name, const std::string& root,
                             const std::vector<int64_t>& widths, const std::string& data_path,
                             int world, int64_t global_batch, int64_t steps, uint64_t seed) {
  JobConfig job;
  job.name = name;
  job.world_size = world;
  job.min_world_size = 1;
  job.widths = widths;
  job.data_path = data_path;
  job.seed = seed;
  job.optimizer.kind = OptimizerKind::kAdam;
  job.optimizer.lr = 0.01;
  job.global_batch = global_batch;
  job.steps = steps;
  job.zero_stage = 2;
  job.bucket_cap_bytes = 1024;
  job.first_bucket_cap_bytes = 256;
  job.output_dir = root + "/out";
  job.checkpoint_dir = root + "/checkpoints";
  job.checkpoint_every = 0;
  job.snapshot_every = 0;
  return job;
}

struct RankThreadsOptions {
  // From this committed checkpoint (its gradient order plans the buckets).
  std::string restore_dir;
  // The last rank consolidates the state there at the end.
  std::string consolidate_path;
  // Receives what each rank's TrainMlp returned, by rank.
  std::vector<TrainResult>* results = nullptr;
  // The plans' gradient order (a memory snapshot's, say) when there is no restore_dir.
  std::vector<int> gradient_order;
  // Anything else a rank's trainer needs (snapshots, another restore source, an observer), by
  // rank. The checkpoints are committed whatever observer it sets.
  std::function<void(int rank, TrainerOptions*)> configure;
  // The shared-memory transport instead of loopback Gloo.
  bool shared_memory = false;
};

// Rank `rank` of `size` over loopback Gloo or shared memory.
inline absl::StatusOr<std::unique_ptr<Communicator>> ConnectRankThread(KeyValueStore* store,
                                                                       int rank, int size,
                                                                       bool shared_memory) {
  if (shared_memory) {
    ShmOptions shm;
    shm.rank = rank;
    shm.size = size;
    shm.timeout = absl::Seconds(30);
    return CreateShmCommunicator(store, shm);
  }
  GlooOptions gloo;
  gloo.rank = rank;
  gloo.size = size;
  gloo.timeout = absl::Seconds(30);
  absl::StatusOr<std::unique_ptr<GlooCommunicator>> communicator =
      CreateGlooCommunicator(store, gloo);
  if (!communicator.ok()) return communicator.status();
  return std::unique_ptr<Communicator>(std::move(*communicator));
}

// A rank's observer in TrainMlpOnThreads: the one the test gave it (none: every default), with
// the checkpoint shards handed to the run's collector besides.
class CommittingObserver : public TrainingObserver {
 public:
  CommittingObserver(TrainingObserver* test, SavedShardCollector& checkpoints)
      : test_(test != nullptr ? *test : unobserved_), checkpoints_(checkpoints) {}

  void OnStep(const StepRecord& record) override { test_.OnStep(record); }
  absl::StatusOr<std::unique_ptr<CheckpointReader>> OpenRestore() override {
    return test_.OpenRestore();
  }
  absl::Status OnRestored(const absl::Status& outcome, absl::Duration took,
                          const RestoreTimings& timings) override {
    return test_.OnRestored(outcome, took, timings);
  }
  void OnSnapshot(const SnapshotShard& shard, const std::vector<std::string>& dropped) override {
    test_.OnSnapshot(shard, dropped);
  }
  void OnSnapshotPushFailed(const SnapshotShard& shard, const std::string& buddy,
                            const absl::Status& why) override {
    test_.OnSnapshotPushFailed(shard, buddy, why);
  }
  StepOrders Orders() override { return test_.Orders(); }
  void OnCheckpoint(const SavedShard& shard) override {
    test_.OnCheckpoint(shard);
    checkpoints_.OnCheckpoint(shard);
  }

 private:
  TrainingObserver unobserved_;  // declared first: test_ may refer to it
  TrainingObserver& test_;
  SavedShardCollector& checkpoints_;
};

// Every rank must succeed.
inline void TrainMlpOnThreads(const JobConfig& job, const RankThreadsOptions& run) {
  SavedShardCollector checkpoints;
  InProcessKeyValueStore store;
  std::vector<absl::StatusOr<TrainResult>> trained(job.world_size,
                                                   absl::UnknownError("not run"));
  std::vector<std::thread> threads;
  for (int rank = 0; rank < job.world_size; ++rank) {
    threads.emplace_back([&, rank] {
      auto communicator = ConnectRankThread(&store, rank, job.world_size, run.shared_memory);
      if (!communicator.ok()) {
        trained[rank] = communicator.status();
        return;
      }
      PlanOptions plan = PlanOptionsForJob(job);
      plan.gradient_order = run.gradient_order;
      if (!run.restore_dir.empty()) {
        absl::StatusOr<CheckpointManifest> manifest = ReadCheckpointManifest(run.restore_dir);
        if (!manifest.ok()) {
          trained[rank] = manifest.status();
          return;
        }
        plan.gradient_order = manifest->plan.gradient_order;
      }
      LocalPlanProvider plans(plan);
      TrainerOptions options;
      options.restore_dir = run.restore_dir;
      // The gather that a worker with cores to spare runs during a restore's reads, so that the
      // restores of these tests check it.
      options.gather_during_reads = true;
      if (!run.consolidate_path.empty()) {
        options.consolidate_to_rank = job.world_size - 1;
        options.consolidate_path = run.consolidate_path;
      }
      if (run.configure) run.configure(rank, &options);
      CommittingObserver observer(options.observer, checkpoints);
      options.observer = &observer;
      trained[rank] = TrainMlp(job, **communicator, plans, options);
    });
  }
  for (std::thread& t : threads) t.join();
  for (const absl::StatusOr<TrainResult>& rank : trained) SHARD_ASSERT_OK(rank.status());
  if (run.results != nullptr) {
    run.results->clear();
    for (absl::StatusOr<TrainResult>& rank : trained) run.results->push_back(*std::move(rank));
  }
  ASSERT_NO_FATAL_FAILURE(CommitSavedCheckpoints(job, checkpoints.Take()));
}

inline void TrainMlpOnThreads(const JobConfig& job, const std::string& restore_dir,
                              const std::string& consolidate_path = "",
                              std::vector<TrainResult>* results = nullptr) {
  TrainMlpOnThreads(job, RankThreadsOptions{restore_dir, consolidate_path, results, {}, {}});
}

}  // namespace shard
