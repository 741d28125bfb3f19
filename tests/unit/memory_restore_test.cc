// Restoring from memory (docs/recovery.md) through the real engine: four ranks (threads, each
// with its own snapshot store and server on 127.0.0.1, as four workers would have) train with
// periodic snapshots alone (copied on the engine's communication thread while the next step
// computes), and the same job trains again with disk checkpoints at the same steps; one rank's
// memory is then lost, and the state of step 10 is read back from the survivors' memory, peer to
// peer, by worlds of 3, 2 and 4 ranks. Each must end bitwise where the same world restored from
// the disk checkpoint of step 10 ends, and the lost rank's shard must come from the buddy that
// kept its replica.
#include <filesystem>
#include <map>
#include <memory>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/files.h"
#include "common/mlp_data.h"
#include "common/snapshot.h"
#include "gtest/gtest.h"
#include "tests/support/status_assertions.h"
#include "tests/support/train_on_threads.h"
#include "worker/dataplane/snapshot_fetch.h"
#include "worker/dataplane/snapshot_peer.h"
#include "worker/dataplane/snapshot_store.h"

namespace shard {
namespace {

const std::vector<int64_t> kWidths = {12, 40, 24, 6};

std::string Root(const std::string& name) {
  const std::string dir = ::testing::TempDir() + "/shard-memory-restore-test/" + name;
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

JobConfig Job(const std::string& root, int world) {
  return SmallMlpJob("memory", root, kWidths,
                     ::testing::TempDir() + "/shard-memory-restore-test-data.safetensors", world,
                     /*global_batch=*/48, /*steps=*/20, /*seed=*/5);
}

// A worker's memory: its snapshot store and the server its peers reach it at, and which
// snapshot shards it was told it holds (its own and replicas).
struct WorkerMemory {
  std::string id;
  SnapshotStore store;
  std::unique_ptr<SnapshotServer> server;
  absl::Mutex mu;
  std::vector<SnapshotShard> held;

  explicit WorkerMemory(std::string name) : id(std::move(name)) {
    server = *SnapshotServer::Start("127.0.0.1", 0, &store,
                                    [this](const SnapshotShard& shard,
                                           const std::vector<std::string>&) { Note(shard); });
  }
  void Note(const SnapshotShard& shard) {
    absl::MutexLock lock(&mu);
    held.push_back(shard);
  }
};

// Tells a rank's worker which snapshot shards of its own it holds.
class NotesHeldSnapshots : public TrainingObserver {
 public:
  explicit NotesHeldSnapshots(WorkerMemory& worker) : worker_(worker) {}
  void OnSnapshot(const SnapshotShard& shard, const std::vector<std::string>&) override {
    worker_.Note(shard);
  }

 private:
  WorkerMemory& worker_;
};

// Restores a rank from the memory snapshot `manifest` describes, its shards read from `holders`
// (or `local`, the rank's worker's own store), counted in `stats`.
class RestoresFromMemory : public TrainingObserver {
 public:
  RestoresFromMemory(const CheckpointManifest& manifest,
                     const std::vector<std::vector<SnapshotHolderAddress>>& holders,
                     const SnapshotStore* local, SnapshotReadStats& stats)
      : manifest_(manifest), holders_(holders), local_(local), stats_(stats) {}
  absl::StatusOr<std::unique_ptr<CheckpointReader>> OpenRestore() override {
    return CheckpointReader::Open(
        manifest_,
        SnapshotShards(manifest_.id, holders_, local_, absl::Seconds(30), nullptr, &stats_),
        "memory snapshot " + manifest_.id);
  }

 private:
  const CheckpointManifest& manifest_;
  const std::vector<std::vector<SnapshotHolderAddress>>& holders_;
  const SnapshotStore* const local_;
  SnapshotReadStats& stats_;
};

TEST(MemoryRestoreTest, ASnapshotInThePeersMemoryRestoresOnAnyWorldSizeAsItsDiskCheckpointDoes) {
  const std::string data = ::testing::TempDir() + "/shard-memory-restore-test-data.safetensors";
  if (!std::filesystem::exists(data)) SHARD_ASSERT_OK(GenerateMlpData(kWidths, 300, 4, data));
  // The reference: the same training, with disk checkpoints.
  JobConfig saved = Job(Root("saved"), 4);
  saved.checkpoint_every = 10;
  ASSERT_NO_FATAL_FAILURE(TrainMlpOnThreads(saved, RankThreadsOptions{}));
  JobConfig trained = Job(Root("trained"), 4);
  trained.checkpoint_every = 0;
  trained.snapshot_every = 10;
  trained.snapshot_replicas = 1;
  std::vector<std::unique_ptr<WorkerMemory>> workers;
  std::vector<std::string> hosts;
  for (int rank = 0; rank < 4; ++rank) {
    workers.push_back(std::make_unique<WorkerMemory>(absl::StrCat("w", rank)));
    hosts.push_back("127.0.0.1");
  }
  std::vector<NotesHeldSnapshots> noting;
  for (const auto& worker : workers) noting.emplace_back(*worker);
  std::vector<TrainResult> results;
  RankThreadsOptions run;
  run.results = &results;
  std::vector<std::string> servers;
  for (const auto& worker : workers) servers.push_back(worker->server->address());
  run.configure = [&](int rank, TrainerOptions* options) {
    options->snapshots = &workers[rank]->store;
    options->snapshot_replication =
        ReplicationOf(hosts, servers, rank, trained.snapshot_replicas, /*same_host_buffers=*/true);
    options->observer = &noting[rank];
  };
  ASSERT_NO_FATAL_FAILURE(TrainMlpOnThreads(trained, run));
  for (const TrainResult& result : results) {
    EXPECT_EQ(result.snapshots_taken, 2);
    EXPECT_EQ(result.checkpoints_saved, 0);
  }

  // Each rank's snapshot of step 10 is the bytes its checkpoint shard of step 10 holds: the
  // state of that boundary, though copied while step 11 ran.
  const std::string id = SnapshotId(10, 0);
  const std::string disk =
      CheckpointDirectory(saved.checkpoint_dir, saved.name, CheckpointIdForStep(10));
  std::vector<SnapshotShard> shards(4);
  for (int rank = 0; rank < 4; ++rank) {
    std::optional<SnapshotStore::Held> own = workers[rank]->store.Find(id, rank);
    ASSERT_TRUE(own.has_value()) << "rank " << rank;
    shards[rank] = own->shard;
    SHARD_ASSERT_OK_AND_ASSIGN(std::string file,
                               ReadFile(disk + "/" + ShardFileName(rank, 4)));
    EXPECT_EQ(file, std::string(own->bytes.begin(), own->bytes.end())) << "rank " << rank;
  }

  // Rank 2's worker is lost with its memory; who holds what is as the workers reported it.
  workers[2].reset();
  std::vector<std::vector<SnapshotHolderAddress>> holders(4);
  for (const auto& worker : workers) {
    if (worker == nullptr) continue;
    absl::MutexLock lock(&worker->mu);
    for (const SnapshotShard& shard : worker->held) {
      if (shard.id == id) holders[shard.rank].push_back({worker->id, worker->server->address()});
    }
  }
  ASSERT_EQ(holders[2].size(), 1u) << "rank 2's replica is on its buddy";
  EXPECT_EQ(holders[2][0].worker_id, "w3");
  SHARD_ASSERT_OK_AND_ASSIGN(
      const CheckpointManifest manifest,
      SnapshotManifest(trained.name, trained.zero_stage, MlpManifest(kWidths), trained.optimizer,
                       shards));

  // The survivors, and for 4 a new worker with no memory, restore on 3, 2 and 4 ranks.
  const std::vector<int> survivors = {0, 1, 3};
  WorkerMemory newcomer("w4");
  for (int world : {3, 2, 4}) {
    SCOPED_TRACE(absl::StrCat("restored on ", world, " ranks"));
    SnapshotReadStats stats;
    std::vector<RestoresFromMemory> restoring;
    for (int rank = 0; rank < world; ++rank) {
      const SnapshotStore* local =
          rank < 3 ? &workers[survivors[rank]]->store : &newcomer.store;
      restoring.emplace_back(manifest, holders, local, stats);
    }
    JobConfig from_memory = Job(Root(absl::StrCat("memory-", world)), world);
    RankThreadsOptions memory_run;
    memory_run.gradient_order = shards[0].plan.gradient_order;
    memory_run.configure = [&](int rank, TrainerOptions* options) {
      options->restore_from_observer = true;
      options->observer = &restoring[rank];
    };
    ASSERT_NO_FATAL_FAILURE(TrainMlpOnThreads(from_memory, memory_run));
    EXPECT_GT(stats.bytes_from_peers.load(), 0u) << "rank 2's state came over the network";

    JobConfig from_disk = Job(Root(absl::StrCat("disk-", world)), world);
    ASSERT_NO_FATAL_FAILURE(TrainMlpOnThreads(from_disk, disk));
    SHARD_ASSERT_OK_AND_ASSIGN(std::string memory_final,
                               ReadFile(from_memory.output_dir + "/final.safetensors"));
    SHARD_ASSERT_OK_AND_ASSIGN(std::string disk_final,
                               ReadFile(from_disk.output_dir + "/final.safetensors"));
    EXPECT_EQ(memory_final, disk_final) << "bitwise";
  }
}

}  // namespace
}  // namespace shard
