// Sharded checkpoints (docs/checkpoints.md).
//
// A checkpoint is a directory <root>/<job>/<id>/ holding one shard file per saving rank and,
// written last, manifest.json. A rank's shard holds, for each range of parameter elements the
// plan makes it own (in the plan's order), the fp32 parameter values followed by each optimizer
// state tensor's values for the same elements. The manifest records the format version, job,
// step, world size, plan, optimizer and its hyper-parameters, every tensor's name, shape and
// dtype, which element range of each tensor lives at which byte offset of which shard, and each
// shard's size with XXH3-64 checksums of the whole file and of every 4 MiB block, so that any
// read (even of a few elements) is verified.
//
// Writing is crash safe: shards are written to temporary names, fsynced and renamed; the
// manifest is written the same way, last, and is the commit point. A directory without a
// manifest is an incomplete checkpoint and is removed.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/files.h"
#include "common/job_spec.h"
#include "common/manifest.h"
#include "common/plan.h"

namespace shard {

constexpr int kCheckpointFormatVersion = 1;
constexpr uint64_t kCheckpointBlockBytes = uint64_t{4} << 20;

// "step-00000015-g7": checkpoints sort by step; the tag (e.g. the world generation) keeps the
// ids of a restored run's steps apart from those of the run it restored from. No tag, no suffix.
std::string CheckpointIdForStep(int64_t step, absl::string_view tag = "");
// Checkpoint ids and job names must be plain names: no path traversal.
absl::Status ValidateCheckpointId(absl::string_view id);
std::string CheckpointDirectory(const std::string& root, const std::string& job,
                                const std::string& id);
std::string ShardFileName(int rank, int world_size);

// Where a rank's bytes go: one piece per owned range, in plan order.
struct ShardPiece {
  int param = 0;
  int64_t param_offset = 0;  // first element of the parameter in this piece
  int64_t numel = 0;
  uint64_t byte_offset = 0;  // of the parameter values; state k follows at + (k+1) x numel x 4
};

struct ShardLayout {
  std::vector<ShardPiece> pieces;
  uint64_t bytes = 0;
};

// Rank r's pieces are its plan ranges; rank 0 also keeps the parameters that take no gradient
// (whole, with zero state).
ShardLayout MakeShardLayout(const Manifest& model, const Plan& plan, int rank, int state_tensors);

// Bytes a rank appends to its shard after its pieces, opaque to Shard: what a training script's
// own optimizer keeps of a parameter besides its per-element state (step counts, factored
// moments; saved by the rank that holds the parameter's first element), or the job's extras
// (the optimizer's param groups, a scheduler's state; saved by rank 0). The script wrote them;
// a restore hands each rank those of the parameters it updates, and the job's.
struct ShardExtra {
  int param = -1;       // the parameter whose state it is; -1: the job's
  uint64_t offset = 0;  // in the shard
  uint64_t bytes = 0;

  bool operator==(const ShardExtra&) const = default;
};

struct ShardRecord {
  std::string file;
  int rank = 0;
  uint64_t bytes = 0;
  // Of the whole file; empty for a snapshot's shard, whose blocks cover every byte.
  std::string xxh3;
  std::vector<std::string> block_xxh3;  // of each kCheckpointBlockBytes block
  std::vector<ShardExtra> extras;       // back to back after the shard layout's bytes

  bool operator==(const ShardRecord&) const = default;
};

// Where one element range of a tensor lives.
struct TensorPiece {
  int64_t begin = 0;  // elements of the parameter
  int64_t end = 0;
  int shard = 0;      // index into CheckpointManifest::shards
  uint64_t offset = 0;  // byte offset of the parameter values in that shard
};

struct CheckpointTensor {
  ParamSpec param;
  std::vector<TensorPiece> pieces;  // sorted by begin, covering [0, numel) exactly
};

// Where the optimizer and the dynamic loss scaler stood at a checkpoint: loss scaling skips
// updates on overflow, so the optimizer's step count (Adam's bias correction) can lag the
// training step, and the scale itself must continue where it was.
struct TrainingCounters {
  int64_t optimizer_step = 0;
  float loss_scale = 0;  // 0: no loss scaling
  int64_t loss_scale_growth_tracker = 0;

  bool operator==(const TrainingCounters&) const = default;
};

// InvalidArgument naming the counter and its value unless 0 <= optimizer_step <= `step`, the
// loss scale is finite and not negative, and the growth tracker is not negative.
absl::Status ValidateTrainingCounters(const TrainingCounters& counters, int64_t step);

// The counters as safetensors metadata (optimizer_step, and loss_scale with
// loss_scale_growth_tracker when scaling), for exports and consolidated files.
std::map<std::string, std::string> TrainingCountersMetadata(const TrainingCounters& counters);
// What a trained model's safetensors file says of itself: format "pt", producer "shard", the
// step, the optimizer and the counters.
std::map<std::string, std::string> TrainedFileMetadata(int64_t step, OptimizerKind optimizer,
                                                       const TrainingCounters& counters);
// Back from `metadata`; a file without them (older, or from elsewhere) gives optimizer_step =
// `step` and no loss scale. InvalidArgument naming the key for a malformed or impossible value.
absl::StatusOr<TrainingCounters> TrainingCountersFromMetadata(
    const std::map<std::string, std::string>& metadata, int64_t step);

// The optimizer state a rank saved: the per-element state tensors each piece holds after its
// parameter values and, for a training script's own optimizer (kTorch), its class. Ranks report
// it with every shard; for a built-in optimizer it follows from the job spec.
struct OptimizerStateKind {
  std::string torch_class;  // empty for a built-in optimizer
  std::vector<std::string> names;

  bool operator==(const OptimizerStateKind&) const = default;
};

OptimizerStateKind StateKindOf(const OptimizerConfig& optimizer);
// The job's optimizer as a rank saved it: kTorch takes the class and state names of `saved`;
// a built-in optimizer must have saved its own (FailedPrecondition naming both otherwise).
absl::StatusOr<OptimizerConfig> SavedOptimizer(const OptimizerConfig& job,
                                               const OptimizerStateKind& saved);

struct CheckpointManifest {
  int format_version = kCheckpointFormatVersion;
  std::string job;
  std::string id;
  int64_t step = 0;  // training steps completed; a restore continues with step + 1
  int world_size = 0;
  int zero_stage = 0;
  PlanOptions plan;  // including the rebuilt gradient order
  std::string plan_hash;
  std::string manifest_hash;
  OptimizerConfig optimizer;
  std::vector<std::string> state_names;  // exp_avg, exp_avg_sq / momentum_buffer
  std::vector<CheckpointTensor> tensors;
  std::vector<ShardRecord> shards;
  int64_t created_unix_ms = 0;
  // Absent in checkpoints written before the counters were: optimizer step = step, no scale.
  std::optional<TrainingCounters> counters;

  Manifest model() const;
  uint64_t total_bytes() const;
};

// The manifest of a checkpoint that `plan` describes, from the ranks' shard records (by rank).
absl::StatusOr<CheckpointManifest> MakeCheckpointManifest(
    const std::string& job, const std::string& id, int64_t step, int zero_stage,
    const Manifest& model, const Plan& plan, const OptimizerConfig& optimizer,
    const std::vector<std::string>& state_names, std::vector<ShardRecord> shards);

std::string CheckpointManifestToJson(const CheckpointManifest& manifest);
// Parses and checks (format version, names, pieces covering every tensor exactly).
absl::StatusOr<CheckpointManifest> CheckpointManifestFromJson(absl::string_view json,
                                                              const std::string& path);

// The commit point: writes <dir>/manifest.json atomically.
absl::Status CommitCheckpoint(const std::string& dir, const CheckpointManifest& manifest);
absl::StatusOr<CheckpointManifest> ReadCheckpointManifest(const std::string& dir);

class ShardHasher;  // common/shard_hasher.h

// Streams one shard file: written to a temporary name and hashed as it goes (a large Append
// hashes on a second thread while it writes); Finish() fsyncs and renames it and returns its
// record. A writer destroyed before Finish() succeeded (a full disk, EIO, `cancel` set) leaves no
// file behind. The test hooks SHARD_SLOW_WRITE_MS and SHARD_WRITE_ERROR (common/fault.h) act here.
class ShardWriter {
 public:
  static absl::StatusOr<std::unique_ptr<ShardWriter>> Create(
      const std::string& dir, int rank, int world_size,
      const std::atomic<bool>* cancel = nullptr);
  ~ShardWriter();
  ShardWriter(const ShardWriter&) = delete;
  ShardWriter& operator=(const ShardWriter&) = delete;

  absl::Status Append(const void* data, size_t bytes);
  absl::StatusOr<ShardRecord> Finish();

 private:
  ShardWriter() = default;
  std::string file_;
  int rank_ = 0;
  std::unique_ptr<AtomicFileWriter> out_;
  std::unique_ptr<ShardHasher> hasher_;
  const std::atomic<bool>* cancel_ = nullptr;
  int injected_error_ = 0;  // SHARD_WRITE_ERROR's errno for this shard, 0: none
};

// Full tensors by element range, from wherever they are stored (a checkpoint, a consolidated
// safetensors file). `array` -1 is the parameter, k >= 0 its k-th optimizer state tensor.
class StateSource {
 public:
  virtual ~StateSource() = default;
  virtual absl::Status ReadElements(int param, int array, int64_t begin, int64_t count,
                                    float* out) = 0;
};

// Where the bytes of a checkpoint's shards are: the files of its directory, or the memory of
// the workers that hold a snapshot (worker/dataplane/snapshot_fetch.h). Reads are raw;
// CheckpointReader checks every block it returns against the manifest's checksums.
class ShardStorage {
 public:
  virtual ~ShardStorage() = default;
  // Copies bytes [offset, offset + bytes) of shard `shard` (an index into the manifest's
  // shards) into `out`.
  virtual absl::Status Read(int shard, uint64_t offset, uint64_t bytes, char* out) = 0;
  // Where shard `shard` is, for errors: "checkpoint shard '/ck/step-8/shard-00001-of-00002.bin'".
  virtual std::string Describe(int shard) const = 0;

  // Whether View can give shard `shard`'s bytes in place, without a copy (a mapped file).
  virtual absl::StatusOr<bool> CanView(int /*shard*/) { return false; }
  // Bytes [offset, offset + bytes) of shard `shard`, in memory until Release of a range that
  // covers them; `offset` is a multiple of kCheckpointBlockBytes. Only where CanView(shard).
  virtual absl::StatusOr<const char*> View(int shard, uint64_t offset, uint64_t bytes);
  virtual void Release(int /*shard*/, uint64_t /*offset*/, uint64_t /*bytes*/) {}

  // What the last Read of shard `shard` gave failed its checksum (`why`): whether there is
  // another source of that shard to read it from instead (the next holder of a memory snapshot's
  // shard), which every later Read of it then uses. A directory's files have no other.
  virtual bool Refuse(int /*shard*/, const absl::Status& /*why*/) { return false; }
};

// The shard files of checkpoint directory `dir`, opened on first use; a file whose size differs
// from the manifest's record is DataLoss.
std::unique_ptr<ShardStorage> DirectoryShards(const std::string& dir,
                                              const CheckpointManifest& manifest);

// Reads a checkpoint; every byte it returns comes from a block whose checksum was verified.
// Errors name the shard and the byte range.
class CheckpointReader : public StateSource {
 public:
  // A committed checkpoint directory.
  static absl::StatusOr<std::unique_ptr<CheckpointReader>> Open(const std::string& dir);
  // A checkpoint whose shards are in `storage` (a memory snapshot).
  static std::unique_ptr<CheckpointReader> Open(CheckpointManifest manifest,
                                                std::unique_ptr<ShardStorage> storage,
                                                std::string location);
  ~CheckpointReader() override;

  const CheckpointManifest& manifest() const { return manifest_; }
  // The directory, or where a snapshot is held ("memory snapshot step-...-g3"), for messages.
  const std::string& location() const { return location_; }

  // Copies elements [begin, begin + count) of parameter `param` (array -1) or of its optimizer
  // state `array` (0-based, as in manifest().state_names) into `out`.
  absl::Status ReadElements(int param, int array, int64_t begin, int64_t count,
                            float* out) override;
  // The extra bytes `extra` of shard `shard` names (one of its record's extras), checked.
  absl::StatusOr<std::string> ReadExtra(int shard, const ShardExtra& extra);

  // Re-reads every shard in full, checking sizes and every checksum; `progress(bytes)` is
  // called as it goes. The error names the shard and what is wrong.
  absl::Status VerifyShard(int shard, const std::function<void(uint64_t)>& progress);

 private:
  CheckpointReader() = default;
  // Verified block `block` of `shard`, through the cache.
  absl::StatusOr<const char*> Block(int shard, uint64_t block);
  // Runs `read` (of shard `shard`), and again while it fails a checksum and the storage has
  // another source of the shard (ShardStorage::Refuse).
  absl::Status FromAnySource(int shard, const std::function<absl::Status()>& read);
  // Reads bytes [offset, offset + bytes) of a shard, verified: whole blocks straight into `out`,
  // the partial ones at the edges through the cache.
  absl::Status ReadBytes(int shard, uint64_t offset, uint64_t bytes, char* out);
  // `bytes` from the start of block `first` (whole blocks; the shard's last may be short),
  // each checked.
  absl::Status ReadWholeBlocks(int shard, uint64_t first, uint64_t bytes, char* out);
  absl::Status CheckBlock(int shard, uint64_t block, const char* data, uint64_t length) const;
  absl::Status CheckBlockHash(int shard, uint64_t block, uint64_t xxh3, uint64_t length) const;
  // Checks block `block` at `data` while copying it to `out`.
  absl::Status CheckAndCopy(int shard, uint64_t block, const char* data, uint64_t length,
                            char* out) const;

  std::string location_;
  CheckpointManifest manifest_;
  std::unique_ptr<ShardStorage> storage_;
  // The most recently used verified blocks. A restore reads a parameter's range, then the same
  // range of each optimizer state: the partial blocks at the edges of those ranges (a few
  // blocks apart in a shard) are read again for the next range. Kept, they are fetched once
  // instead of once per range, which over the network (a restore from peers' memory) made a
  // 20 MB restore move 205 MB.
  static constexpr size_t kCachedBlocks = 8;
  struct CachedBlock {
    int shard = -1;  // -1: empty
    uint64_t block = 0;
    uint64_t used = 0;  // cache_clock_ at the last use
    AlignedBuffer bytes{kCheckpointBlockBytes};
  };
  std::vector<CachedBlock> cache_;
  uint64_t cache_clock_ = 0;
  // Two areas of one storage read each, allocated on first use, for reads whose destination
  // would make the kernel's copy slow (see ReadWholeBlocks): one is read into while the other's
  // blocks are checked and copied out.
  std::vector<AlignedBuffer> staging_;
};

// Writes the checkpoint as one safetensors file with full tensors named as the model's
// parameters (and `<name>.<state>` for each optimizer state tensor when `with_state`), streamed
// through a buffer of `buffer_bytes`: the exporter never holds more than that plus one block.
// `progress(done, total)` counts bytes written.
absl::Status ExportCheckpoint(const std::string& dir, const std::string& out_path,
                              bool with_state, uint64_t buffer_bytes,
                              const std::function<void(uint64_t, uint64_t)>& progress);

}  // namespace shard
