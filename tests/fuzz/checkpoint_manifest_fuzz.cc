// Fuzz target: the checkpoint manifest parser (common/checkpoint.h, CheckpointManifestFromJson),
// which reads manifest.json of a checkpoint directory that may have been damaged or forged.
// Promise: DataLoss / FailedPrecondition, or a manifest whose names are plain, whose model is
// valid, whose training counters are possible, and whose pieces cover every tensor exactly and lie inside their shards (computed
// here without overflow) so that a reader never seeks outside a shard or its checksum list.
// Writing it again and parsing that gives the same manifest.
#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "common/checkpoint.h"
#include "common/names.h"
#include "tests/fuzz/fuzz_check.h"

namespace {

void CheckInvariants(const shard::CheckpointManifest& m) {
  FUZZ_CHECK(m.format_version >= 1 && m.format_version <= shard::kCheckpointFormatVersion,
             "format_version %d", m.format_version);
  FUZZ_CHECK(shard::ValidateCheckpointId(m.id).ok(), "bad id");
  FUZZ_CHECK(shard::ValidateName("job", m.job).ok(), "bad job name");
  FUZZ_CHECK(shard::ValidateManifest(m.model()).ok(), "invalid model");
  FUZZ_CHECK(!m.counters.has_value() || shard::ValidateTrainingCounters(*m.counters, m.step).ok(),
             "impossible counters accepted");
  const unsigned __int128 arrays = 1 + m.state_names.size();
  for (const shard::ShardRecord& shard : m.shards) {
    FUZZ_CHECK(shard::ValidateName("shard", shard.file).ok(), "bad shard file name");
    const unsigned __int128 blocks =
        (static_cast<unsigned __int128>(shard.bytes) + shard::kCheckpointBlockBytes - 1) /
        shard::kCheckpointBlockBytes;
    FUZZ_CHECK(shard.block_xxh3.size() == blocks, "block checksum count");
  }
  for (const shard::CheckpointTensor& t : m.tensors) {
    int64_t next = 0;
    for (const shard::TensorPiece& piece : t.pieces) {
      FUZZ_CHECK(piece.begin == next && piece.end > piece.begin, "pieces not contiguous");
      FUZZ_CHECK(piece.shard >= 0 && static_cast<size_t>(piece.shard) < m.shards.size(),
                 "piece in shard %d of %zu", piece.shard, m.shards.size());
      const unsigned __int128 end =
          static_cast<unsigned __int128>(piece.offset) +
          static_cast<unsigned __int128>(piece.end - piece.begin) * sizeof(float) * arrays;
      FUZZ_CHECK(end <= m.shards[piece.shard].bytes, "piece of '%s' ends past its shard",
                 t.param.name.c_str());
      next = piece.end;
    }
    FUZZ_CHECK(next == t.param.numel(), "pieces do not cover '%s'", t.param.name.c_str());
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const absl::string_view json(reinterpret_cast<const char*>(data), size);
  const absl::StatusOr<shard::CheckpointManifest> manifest =
      shard::CheckpointManifestFromJson(json, "fuzz/manifest.json");
  if (!manifest.ok()) {
    FUZZ_CHECK(absl::IsDataLoss(manifest.status()) ||
                   absl::IsFailedPrecondition(manifest.status()),
               "unexpected error code: %s", manifest.status().ToString().c_str());
    return 0;
  }
  CheckInvariants(*manifest);
  const std::string text = shard::CheckpointManifestToJson(*manifest);
  const absl::StatusOr<shard::CheckpointManifest> again =
      shard::CheckpointManifestFromJson(text, "fuzz/again.json");
  FUZZ_CHECK(again.ok(), "its own JSON does not parse: %s", again.status().ToString().c_str());
  FUZZ_CHECK(shard::CheckpointManifestToJson(*again) == text, "round trip changed the manifest");
  return 0;
}
