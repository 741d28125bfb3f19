// Fuzz target: a snapshot shard's description as a peer sends it with a pushed replica (common/
// snapshot.h, SnapshotShardFromJson): untrusted input from the network.
// Promise: InvalidArgument or a shard whose id names its step and generation, whose rank is in
// its world and whose block checksums fit its size; never a crash, an exception or unbounded
// memory. A parsed shard survives SnapshotShardToJson and a second parse unchanged.
#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "common/snapshot.h"
#include "tests/fuzz/fuzz_check.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const absl::string_view json(reinterpret_cast<const char*>(data), size);
  const absl::StatusOr<shard::SnapshotShard> shard = shard::SnapshotShardFromJson(json);
  if (!shard.ok()) {
    FUZZ_CHECK(absl::IsInvalidArgument(shard.status()), "unexpected error code: %s",
               shard.status().ToString().c_str());
    return 0;
  }
  FUZZ_CHECK(shard->id == shard::SnapshotId(shard->step, shard->generation), "id %s",
             shard->id.c_str());
  FUZZ_CHECK(shard->rank >= 0 && shard->rank < shard->plan.world_size, "rank %d of %d",
             shard->rank, shard->plan.world_size);
  const uint64_t blocks = shard->record.bytes / shard::kCheckpointBlockBytes +
                          (shard->record.bytes % shard::kCheckpointBlockBytes != 0 ? 1 : 0);
  FUZZ_CHECK(shard->record.block_xxh3.size() == blocks, "%zu checksums for %llu bytes",
             shard->record.block_xxh3.size(),
             static_cast<unsigned long long>(shard->record.bytes));
  const absl::StatusOr<shard::SnapshotShard> again =
      shard::SnapshotShardFromJson(shard::SnapshotShardToJson(*shard));
  FUZZ_CHECK(again.ok(), "its own JSON does not parse: %s", again.status().ToString().c_str());
  FUZZ_CHECK(*again == *shard, "round trip changed the shard");
  return 0;
}
