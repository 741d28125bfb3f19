#include "common/checkpoint.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <map>
#include <stdexcept>
#include <thread>
#include <type_traits>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/fault.h"
#include "common/names.h"
#include "common/safetensors.h"
#include "common/shard_hasher.h"
#include "common/status_macros.h"
#include "common/stream_copy.h"
#include "common/xxh3.h"
#include "nlohmann/json.hpp"

namespace shard {
namespace {

constexpr char kManifestFile[] = "manifest.json";

std::string Hex(uint64_t value) { return absl::StrFormat("%016x", value); }

absl::Status Corrupt(const std::string& path, absl::string_view what) {
  return absl::DataLossError(absl::StrCat("checkpoint file '", path, "': ", what));
}

uint64_t ArrayBytes(int64_t numel) { return static_cast<uint64_t>(numel) * sizeof(float); }

// Blocks a restore asks the storage for at once, checked one by one as they arrive.
constexpr uint64_t kBlocksPerRead = 4;

// AMD EPYC's `rep movsb`, which the kernel's copy from the page cache into a read's destination
// uses, ran at 0.4x its speed here when the destination was 1 to 31 bytes past the source modulo
// a page. malloc's large blocks start 16 bytes into a page and the page cache's pages on one, so
// every `pread` of whole blocks into the engine's buffers paid it. Such reads land in staging
// placed to avoid it (kStagingShift); the reader's own copies out (StreamCopy) use vector stores,
// which do not pay it.
constexpr uintptr_t kStagingShift = kPageAlignment / 2;

bool SlowCopy(uintptr_t to, uintptr_t from) {
  const uintptr_t gap = (to - from) % kPageAlignment;
  return gap > 0 && gap < 32;
}

// Smaller appends hash on the writing thread: a second thread would cost more than it saves.
constexpr size_t kParallelHashBytes = size_t{8} << 20;

// A manifest field that is present but out of range or not an integer; caught with nlohmann's
// own errors. (nlohmann's get<int>() of 1e300 or of 2^40 does not fail: it converts, and a
// float out of the integer's range is undefined behaviour.)
class FieldError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// `value` as T if it is a JSON integer within T's range.
template <typename T>
T AsInteger(const nlohmann::json& value, absl::string_view what) {
  if (value.is_number_unsigned()) {
    const uint64_t u = value.get<uint64_t>();
    if (u <= static_cast<uint64_t>(std::numeric_limits<T>::max())) return static_cast<T>(u);
  } else if (value.is_number_integer()) {
    const int64_t i = value.get<int64_t>();
    if (std::is_signed_v<T> ? i >= static_cast<int64_t>(std::numeric_limits<T>::min()) &&
                                  i <= static_cast<int64_t>(std::numeric_limits<T>::max())
                            : i >= 0) {
      return static_cast<T>(i);
    }
  }
  throw FieldError(absl::StrCat("\"", what, "\" must be an integer in [",
                                std::numeric_limits<T>::min(), ", ",
                                std::numeric_limits<T>::max(), "], got ",
                                value.is_number() ? "a number out of range" : value.type_name()));
}

// object[key] if it is an array: iterating another value would yield its members or itself.
const nlohmann::json& Array(const nlohmann::json& object, const char* key) {
  const nlohmann::json& value = object.at(key);
  if (!value.is_array()) {
    throw FieldError(absl::StrCat("\"", key, "\" must be an array, got ", value.type_name()));
  }
  return value;
}

template <typename T>
T Integer(const nlohmann::json& object, const char* key) {
  return AsInteger<T>(object.at(key), key);
}

// metadata[key] parsed into *out; *out is left alone when the key is absent.
template <typename T>
absl::Status MetadataNumber(const std::map<std::string, std::string>& metadata, const char* key,
                            T* out) {
  auto it = metadata.find(key);
  if (it == metadata.end()) return absl::OkStatus();
  bool parsed = false;
  if constexpr (std::is_integral_v<T>) {
    parsed = absl::SimpleAtoi(it->second, out);
  } else {
    parsed = absl::SimpleAtof(it->second, out);
  }
  if (!parsed) {
    return absl::InvalidArgumentError(
        absl::StrCat("metadata \"", key, "\" is not a number: '", it->second, "'"));
  }
  return absl::OkStatus();
}

}  // namespace

std::string CheckpointIdForStep(int64_t step, absl::string_view tag) {
  return tag.empty() ? absl::StrFormat("step-%08d", step)
                     : absl::StrFormat("step-%08d-%s", step, tag);
}

absl::Status ValidateCheckpointId(absl::string_view id) {
  return ValidateName("checkpoint id", id);
}

std::string CheckpointDirectory(const std::string& root, const std::string& job,
                                const std::string& id) {
  return (std::filesystem::path(root) / job / id).string();
}

std::string ShardFileName(int rank, int world_size) {
  return absl::StrFormat("shard-%05d-of-%05d.bin", rank, world_size);
}

ShardLayout MakeShardLayout(const Manifest& model, const Plan& plan, int rank,
                            int state_tensors) {
  ShardLayout layout;
  auto add = [&](int param, int64_t offset, int64_t numel) {
    layout.pieces.push_back(ShardPiece{param, offset, numel, layout.bytes});
    layout.bytes += ArrayBytes(numel) * (1 + state_tensors);
  };
  for (const OwnedRange& range : plan.ranks[rank].ranges) {
    add(range.param, range.param_offset, range.numel);
  }
  if (rank == 0) {
    for (size_t p = 0; p < model.params.size(); ++p) {
      if (!model.params[p].requires_grad) add(static_cast<int>(p), 0, model.params[p].numel());
    }
  }
  return layout;
}

Manifest CheckpointManifest::model() const {
  Manifest model;
  for (const CheckpointTensor& tensor : tensors) model.params.push_back(tensor.param);
  return model;
}

uint64_t CheckpointManifest::total_bytes() const {
  uint64_t total = 0;
  for (const ShardRecord& shard : shards) total += shard.bytes;
  return total;
}

OptimizerStateKind StateKindOf(const OptimizerConfig& optimizer) {
  return OptimizerStateKind{optimizer.kind == OptimizerKind::kTorch ? optimizer.torch_class : "",
                            OptimizerStateNames(optimizer)};
}

absl::StatusOr<OptimizerConfig> SavedOptimizer(const OptimizerConfig& job,
                                               const OptimizerStateKind& saved) {
  OptimizerConfig optimizer = job;
  if (job.kind == OptimizerKind::kTorch) {
    optimizer.torch_class = saved.torch_class;
    optimizer.torch_state = saved.names;
    return optimizer;
  }
  if (saved != StateKindOf(job)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "a rank saved optimizer state [", absl::StrJoin(saved.names, ", "), "]",
        saved.torch_class.empty() ? "" : absl::StrCat(" of ", saved.torch_class),
        " but the job's ", OptimizerKindName(job.kind), " keeps [",
        absl::StrJoin(OptimizerStateNames(job), ", "), "]"));
  }
  return optimizer;
}

absl::StatusOr<CheckpointManifest> MakeCheckpointManifest(
    const std::string& job, const std::string& id, int64_t step, int zero_stage,
    const Manifest& model, const Plan& plan, const OptimizerConfig& optimizer,
    const std::vector<std::string>& state_names, std::vector<ShardRecord> shards) {
  const int world = plan.options.world_size;
  if (static_cast<int>(shards.size()) != world) {
    return absl::FailedPreconditionError(absl::StrCat(
        "checkpoint ", id, " has ", shards.size(), " shards for a world of ", world));
  }
  CheckpointManifest manifest;
  manifest.job = job;
  manifest.id = id;
  manifest.step = step;
  manifest.world_size = world;
  manifest.zero_stage = zero_stage;
  manifest.plan = plan.options;
  manifest.plan_hash = plan.hash;
  manifest.manifest_hash = ManifestHash(model);
  manifest.optimizer = optimizer;
  manifest.state_names = state_names;
  manifest.created_unix_ms = absl::ToUnixMillis(absl::Now());
  for (const ParamSpec& param : model.params) manifest.tensors.push_back(CheckpointTensor{param, {}});
  for (int rank = 0; rank < world; ++rank) {
    const ShardLayout layout =
        MakeShardLayout(model, plan, rank, static_cast<int>(state_names.size()));
    uint64_t end = layout.bytes;  // of the extras, back to back after the pieces
    for (const ShardExtra& extra : shards[rank].extras) {
      if (extra.offset != end || extra.param < -1 ||
          extra.param >= static_cast<int>(model.params.size())) {
        return absl::FailedPreconditionError(absl::StrCat(
            "rank ", rank, " reported extra bytes of parameter ", extra.param, " at offset ",
            extra.offset, " where ", end, " was due"));
      }
      end += extra.bytes;
    }
    if (shards[rank].rank != rank || shards[rank].bytes != end) {
      return absl::FailedPreconditionError(absl::StrCat(
          "rank ", rank, " reported a shard of ", shards[rank].bytes, " bytes but the plan puts ",
          layout.bytes, " bytes there (and its extras ", end - layout.bytes, ")"));
    }
    for (const ShardPiece& piece : layout.pieces) {
      manifest.tensors[piece.param].pieces.push_back(
          TensorPiece{piece.param_offset, piece.param_offset + piece.numel, rank,
                      piece.byte_offset});
    }
  }
  for (CheckpointTensor& tensor : manifest.tensors) {
    std::sort(tensor.pieces.begin(), tensor.pieces.end(),
              [](const TensorPiece& a, const TensorPiece& b) { return a.begin < b.begin; });
  }
  manifest.shards = std::move(shards);
  return manifest;
}

std::string CheckpointManifestToJson(const CheckpointManifest& m) {
  nlohmann::ordered_json tensors = nlohmann::ordered_json::array();
  for (const CheckpointTensor& t : m.tensors) {
    nlohmann::ordered_json pieces = nlohmann::ordered_json::array();
    for (const TensorPiece& p : t.pieces) {
      pieces.push_back({{"begin", p.begin}, {"end", p.end}, {"shard", p.shard}, {"offset", p.offset}});
    }
    tensors.push_back({{"name", t.param.name},
                       {"shape", t.param.shape},
                       {"dtype", std::string(DataTypeName(t.param.dtype))},
                       {"requires_grad", t.param.requires_grad},
                       {"pieces", pieces}});
  }
  nlohmann::ordered_json shards = nlohmann::ordered_json::array();
  for (const ShardRecord& s : m.shards) {
    nlohmann::ordered_json shard = {{"file", s.file},
                                    {"rank", s.rank},
                                    {"bytes", s.bytes},
                                    {"xxh3", s.xxh3},
                                    {"block_bytes", kCheckpointBlockBytes},
                                    {"block_xxh3", s.block_xxh3}};
    for (const ShardExtra& e : s.extras) {
      shard["extras"].push_back({{"param", e.param}, {"offset", e.offset}, {"bytes", e.bytes}});
    }
    shards.push_back(std::move(shard));
  }
  const OptimizerConfig& o = m.optimizer;
  nlohmann::ordered_json doc = {
      {"format_version", m.format_version},
      {"job", m.job},
      {"id", m.id},
      {"step", m.step},
      {"world_size", m.world_size},
      {"zero_stage", m.zero_stage},
      {"created_unix_ms", m.created_unix_ms},
      {"plan",
       {{"mode", std::string(ShardModeName(m.plan.mode))},
        {"world_size", m.plan.world_size},
        {"bucket_cap_bytes", m.plan.bucket_cap_bytes},
        {"first_bucket_cap_bytes", m.plan.first_bucket_cap_bytes},
        {"min_buckets", m.plan.min_buckets},
        {"alignment_bytes", m.plan.alignment_bytes},
        {"gradient_order", m.plan.gradient_order},
        {"hash", m.plan_hash}}},
      {"manifest_hash", m.manifest_hash},
      {"optimizer",
       o.kind == OptimizerKind::kTorch
           // The script's class holds its settings: only what the state is.
           ? nlohmann::ordered_json{{"name", "torch"},
                                    {"class", o.torch_class},
                                    {"state", m.state_names}}
           : nlohmann::ordered_json{{"name", std::string(OptimizerKindName(o.kind))},
                                    {"lr", o.lr},
                                    {"betas", {o.beta1, o.beta2}},
                                    {"eps", o.eps},
                                    {"weight_decay", o.weight_decay},
                                    {"momentum", o.momentum},
                                    {"nesterov", o.nesterov},
                                    {"state", m.state_names}}},
      {"tensors", tensors},
      {"shards", shards}};
  if (m.counters.has_value()) {
    doc["counters"] = {{"optimizer_step", m.counters->optimizer_step},
                       {"loss_scale", m.counters->loss_scale},
                       {"loss_scale_growth_tracker", m.counters->loss_scale_growth_tracker}};
  }
  return doc.dump(1);
}

std::map<std::string, std::string> TrainingCountersMetadata(const TrainingCounters& counters) {
  std::map<std::string, std::string> metadata = {
      {"optimizer_step", absl::StrCat(counters.optimizer_step)}};
  if (counters.loss_scale > 0) {
    // Nine significant digits: the float round-trips exactly.
    metadata["loss_scale"] = absl::StrFormat("%.9g", counters.loss_scale);
    metadata["loss_scale_growth_tracker"] = absl::StrCat(counters.loss_scale_growth_tracker);
  }
  return metadata;
}

absl::Status ValidateTrainingCounters(const TrainingCounters& counters, int64_t step) {
  if (counters.optimizer_step < 0 || counters.optimizer_step > step) {
    return absl::InvalidArgumentError(absl::StrCat("\"optimizer_step\" is ",
                                                   counters.optimizer_step,
                                                   ", outside [0, step = ", step, "]"));
  }
  if (!(counters.loss_scale >= 0) || !std::isfinite(counters.loss_scale)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "\"loss_scale\" is ", counters.loss_scale, ", not a finite number >= 0"));
  }
  if (counters.loss_scale_growth_tracker < 0) {
    return absl::InvalidArgumentError(absl::StrCat("\"loss_scale_growth_tracker\" is ",
                                                   counters.loss_scale_growth_tracker,
                                                   ", negative"));
  }
  return absl::OkStatus();
}

std::map<std::string, std::string> TrainedFileMetadata(int64_t step, OptimizerKind optimizer,
                                                       const TrainingCounters& counters) {
  std::map<std::string, std::string> metadata = TrainingCountersMetadata(counters);
  metadata.insert({{"format", "pt"},
                   {"producer", "shard"},
                   {"step", absl::StrCat(step)},
                   {"optimizer", std::string(OptimizerKindName(optimizer))}});
  return metadata;
}

absl::StatusOr<TrainingCounters> TrainingCountersFromMetadata(
    const std::map<std::string, std::string>& metadata, int64_t step) {
  TrainingCounters counters{.optimizer_step = step};
  SHARD_RETURN_IF_ERROR(MetadataNumber(metadata, "optimizer_step", &counters.optimizer_step));
  SHARD_RETURN_IF_ERROR(MetadataNumber(metadata, "loss_scale", &counters.loss_scale));
  SHARD_RETURN_IF_ERROR(MetadataNumber(metadata, "loss_scale_growth_tracker",
                                       &counters.loss_scale_growth_tracker));
  if (absl::Status valid = ValidateTrainingCounters(counters, step); !valid.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("metadata ", valid.message()));
  }
  return counters;
}

absl::StatusOr<CheckpointManifest> CheckpointManifestFromJson(absl::string_view json,
                                                              const std::string& path) {
  const nlohmann::json doc = nlohmann::json::parse(json, nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded() || !doc.is_object()) return Corrupt(path, "the manifest is not JSON");
  CheckpointManifest m;
  try {
    m.format_version = Integer<int>(doc, "format_version");
    if (m.format_version > kCheckpointFormatVersion) {
      return absl::FailedPreconditionError(absl::StrCat(
          "checkpoint '", path, "' has format version ", m.format_version,
          ", newer than this Shard reads (", kCheckpointFormatVersion, "); upgrade Shard"));
    }
    if (m.format_version < 1) return Corrupt(path, "format_version must be at least 1");
    m.job = doc.at("job").get<std::string>();
    m.id = doc.at("id").get<std::string>();
    m.step = Integer<int64_t>(doc, "step");
    m.world_size = Integer<int>(doc, "world_size");
    m.zero_stage = Integer<int>(doc, "zero_stage");
    m.created_unix_ms = Integer<int64_t>(doc, "created_unix_ms");
    if (doc.contains("counters")) {
      const nlohmann::json& c = doc.at("counters");
      TrainingCounters counters;
      counters.optimizer_step = Integer<int64_t>(c, "optimizer_step");
      counters.loss_scale = c.at("loss_scale").get<float>();
      counters.loss_scale_growth_tracker = Integer<int64_t>(c, "loss_scale_growth_tracker");
      if (absl::Status valid = ValidateTrainingCounters(counters, m.step); !valid.ok()) {
        return Corrupt(path, absl::StrCat("counters: ", valid.message()));
      }
      m.counters = counters;
    }
    const nlohmann::json& plan = doc.at("plan");
    absl::StatusOr<ShardMode> mode = ParseShardMode(plan.at("mode").get<std::string>());
    if (!mode.ok()) return Corrupt(path, mode.status().message());
    m.plan.mode = *mode;
    m.plan.world_size = Integer<int>(plan, "world_size");
    m.plan.bucket_cap_bytes = Integer<int64_t>(plan, "bucket_cap_bytes");
    m.plan.first_bucket_cap_bytes = Integer<int64_t>(plan, "first_bucket_cap_bytes");
    // Checkpoints from before min_buckets were planned by the caps alone.
    m.plan.min_buckets = plan.contains("min_buckets") ? Integer<int>(plan, "min_buckets") : 1;
    m.plan.alignment_bytes = Integer<int64_t>(plan, "alignment_bytes");
    for (const nlohmann::json& p : Array(plan, "gradient_order")) {
      m.plan.gradient_order.push_back(AsInteger<int>(p, "gradient_order"));
    }
    m.plan_hash = plan.at("hash").get<std::string>();
    m.manifest_hash = doc.at("manifest_hash").get<std::string>();
    const nlohmann::json& o = doc.at("optimizer");
    const std::string name = o.at("name").get<std::string>();
    if (name == "adam") {
      m.optimizer.kind = OptimizerKind::kAdam;
    } else if (name == "adamw") {
      m.optimizer.kind = OptimizerKind::kAdamW;
    } else if (name == "sgd") {
      m.optimizer.kind = OptimizerKind::kSgd;
    } else if (name == "torch") {
      m.optimizer.kind = OptimizerKind::kTorch;
      m.optimizer.torch_class = o.at("class").get<std::string>();
    } else {
      return Corrupt(path, absl::StrCat("optimizer '", name, "' is unknown"));
    }
    if (m.optimizer.kind != OptimizerKind::kTorch) {
      m.optimizer.lr = o.at("lr").get<double>();
      m.optimizer.beta1 = o.at("betas").at(0).get<double>();
      m.optimizer.beta2 = o.at("betas").at(1).get<double>();
      m.optimizer.eps = o.at("eps").get<double>();
      m.optimizer.weight_decay = o.at("weight_decay").get<double>();
      m.optimizer.momentum = o.at("momentum").get<double>();
      m.optimizer.nesterov = o.at("nesterov").get<bool>();
    }
    m.state_names = o.at("state").get<std::vector<std::string>>();
    if (m.optimizer.kind == OptimizerKind::kTorch) m.optimizer.torch_state = m.state_names;
    for (const nlohmann::json& s : Array(doc, "shards")) {
      ShardRecord record;
      record.file = s.at("file").get<std::string>();
      record.rank = Integer<int>(s, "rank");
      record.bytes = Integer<uint64_t>(s, "bytes");
      record.xxh3 = s.at("xxh3").get<std::string>();
      record.block_xxh3 = s.at("block_xxh3").get<std::vector<std::string>>();
      if (s.contains("extras")) {
        for (const nlohmann::json& e : Array(s, "extras")) {
          record.extras.push_back(ShardExtra{Integer<int>(e, "param"), Integer<uint64_t>(e, "offset"),
                                             Integer<uint64_t>(e, "bytes")});
        }
      }
      if (Integer<uint64_t>(s, "block_bytes") != kCheckpointBlockBytes) {
        return Corrupt(path, "shards use a block size this Shard does not read");
      }
      if (absl::Status name = ValidateName("shard file name", record.file); !name.ok()) {
        return Corrupt(path, name.message());
      }
      // (Rounded up without overflowing: bytes near 2^64 must not wrap to zero blocks.)
      if (record.block_xxh3.size() != record.bytes / kCheckpointBlockBytes +
                                          (record.bytes % kCheckpointBlockBytes != 0 ? 1 : 0)) {
        return Corrupt(path, absl::StrCat("shard '", record.file, "' lists ",
                                          record.block_xxh3.size(), " block checksums for ",
                                          record.bytes, " bytes"));
      }
      m.shards.push_back(std::move(record));
    }
    for (const nlohmann::json& t : Array(doc, "tensors")) {
      CheckpointTensor tensor;
      tensor.param.name = t.at("name").get<std::string>();
      for (const nlohmann::json& d : Array(t, "shape")) {
        tensor.param.shape.push_back(AsInteger<int64_t>(d, "shape"));
      }
      absl::StatusOr<DataType> dtype = ParseDataType(t.at("dtype").get<std::string>());
      if (!dtype.ok()) return Corrupt(path, dtype.status().message());
      tensor.param.dtype = *dtype;
      tensor.param.requires_grad = t.at("requires_grad").get<bool>();
      for (const nlohmann::json& p : Array(t, "pieces")) {
        tensor.pieces.push_back(TensorPiece{Integer<int64_t>(p, "begin"),
                                            Integer<int64_t>(p, "end"), Integer<int>(p, "shard"),
                                            Integer<uint64_t>(p, "offset")});
      }
      m.tensors.push_back(std::move(tensor));
    }
  } catch (const nlohmann::json::exception& e) {
    return Corrupt(path, absl::StrCat("the manifest is missing or mistypes a field: ", e.what()));
  } catch (const FieldError& e) {
    return Corrupt(path, e.what());
  }
  if (absl::Status id = ValidateCheckpointId(m.id); !id.ok()) return Corrupt(path, id.message());
  if (absl::Status job = ValidateName("job name", m.job); !job.ok()) return Corrupt(path, job.message());
  if (absl::Status model = ValidateManifest(m.model()); !model.ok()) {
    return Corrupt(path, model.message());
  }
  for (const ShardRecord& shard : m.shards) {
    for (const ShardExtra& extra : shard.extras) {
      if (extra.param < -1 || extra.param >= static_cast<int>(m.tensors.size()) ||
          extra.offset > shard.bytes || extra.bytes > shard.bytes - extra.offset) {
        return Corrupt(path, absl::StrCat("shard '", shard.file, "' lists extra bytes of "
                                          "parameter ", extra.param, " outside it or of no tensor"));
      }
    }
  }
  // Every tensor is covered exactly, by pieces inside their shards. (Compared so that nothing
  // overflows: a forged offset near 2^64 must not wrap around to "inside".)
  const uint64_t arrays = 1 + m.state_names.size();
  for (const CheckpointTensor& t : m.tensors) {
    int64_t next = 0;
    for (const TensorPiece& piece : t.pieces) {
      if (piece.begin != next || piece.end <= piece.begin || piece.end > t.param.numel() ||
          piece.shard < 0 || piece.shard >= static_cast<int>(m.shards.size()) ||
          piece.offset > m.shards[piece.shard].bytes ||
          ArrayBytes(piece.end - piece.begin) >
              (m.shards[piece.shard].bytes - piece.offset) / arrays) {
        return Corrupt(path, absl::StrCat("the pieces of tensor '", t.param.name,
                                          "' do not cover it exactly inside their shards"));
      }
      next = piece.end;
    }
    if (next != t.param.numel()) {
      return Corrupt(path, absl::StrCat("the pieces of tensor '", t.param.name, "' cover ", next,
                                        " of its ", t.param.numel(), " elements"));
    }
  }
  return m;
}

absl::Status CommitCheckpoint(const std::string& dir, const CheckpointManifest& manifest) {
  SHARD_ASSIGN_OR_RETURN(
      std::unique_ptr<AtomicFileWriter> writer,
      AtomicFileWriter::Create((std::filesystem::path(dir) / kManifestFile).string()));
  SHARD_RETURN_IF_ERROR(writer->Write(CheckpointManifestToJson(manifest)));
  FaultPoint("manifest-before-rename");
  return writer->Commit();
}

absl::StatusOr<CheckpointManifest> ReadCheckpointManifest(const std::string& dir) {
  const std::string path = (std::filesystem::path(dir) / kManifestFile).string();
  absl::StatusOr<std::string> text = ReadFile(path);
  if (absl::IsNotFound(text.status())) {
    return absl::NotFoundError(absl::StrCat(
        "checkpoint directory '", dir, "' has no manifest.json: it was never committed"));
  }
  if (!text.ok()) return text.status();
  return CheckpointManifestFromJson(*text, path);
}

// ---------------------------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<ShardWriter>> ShardWriter::Create(
    const std::string& dir, int rank, int world_size, const std::atomic<bool>* cancel) {
  // A committed checkpoint is never written into again.
  if (std::filesystem::exists(std::filesystem::path(dir) / kManifestFile)) {
    return absl::AlreadyExistsError(absl::StrCat(
        "checkpoint '", dir, "' is already committed; it is never overwritten (a new run into "
        "an earlier run's checkpoint directory meets its ids: give each run its own outputDir "
        "or checkpoint.dir, or continue the earlier run on its --state-dir)"));
  }
  SHARD_RETURN_IF_ERROR(MakeDirectories(dir));
  std::unique_ptr<ShardWriter> writer(new ShardWriter());
  writer->file_ = ShardFileName(rank, world_size);
  writer->rank_ = rank;
  SHARD_ASSIGN_OR_RETURN(
      std::unique_ptr<AtomicFileWriter> out,
      AtomicFileWriter::Create((std::filesystem::path(dir) / writer->file_).string(), cancel));
  writer->out_ = std::move(out);
  writer->hasher_ = std::make_unique<ShardHasher>();
  writer->cancel_ = cancel;
  writer->injected_error_ = InjectedWriteError();
  return writer;
}

ShardWriter::~ShardWriter() = default;

absl::Status ShardWriter::Append(const void* data, size_t bytes) {
  const char* const in = static_cast<const char*>(data);
  if (injected_error_ != 0) {
    // Half of it reaches the file, then the device fails the write (SHARD_WRITE_ERROR).
    SHARD_RETURN_IF_ERROR(out_->Write(absl::string_view(in, bytes / 2)));
    return FileError("cannot write", out_->temp_path(), injected_error_);
  }
  if (const int64_t slow = SlowWriteMillisPerMiB(); slow > 0) {
    // A disk slowed to a crawl (SHARD_SLOW_WRITE_MS): a MiB at a time, each that much later
    // (and cancellable between them).
    constexpr size_t kMiB = size_t{1} << 20;
    for (size_t done = 0; done < bytes;) {
      const size_t take = std::min(kMiB, bytes - done);
      for (const absl::Time until = absl::Now() + absl::Milliseconds(slow); absl::Now() < until;) {
        if (cancel_ != nullptr && cancel_->load()) break;  // Write says so below
        absl::SleepFor(std::min(absl::Milliseconds(20), until - absl::Now()));
      }
      SHARD_RETURN_IF_ERROR(out_->Write(absl::string_view(in + done, take)));
      hasher_->Append(in + done, take);
      done += take;
    }
    return absl::OkStatus();
  }
  if (bytes < kParallelHashBytes) {
    SHARD_RETURN_IF_ERROR(out_->Write(absl::string_view(static_cast<const char*>(data), bytes)));
    hasher_->Append(data, bytes);
    return absl::OkStatus();
  }
  // Hashing every byte twice (the file's and its block's checksum) takes about as long as
  // copying it into the page cache: on a second thread, it is off the save's critical path.
  std::thread hasher([this, data, bytes] { hasher_->Append(data, bytes); });
  absl::Status written =
      out_->Write(absl::string_view(static_cast<const char*>(data), bytes));
  hasher.join();
  return written;
}

absl::StatusOr<ShardRecord> ShardWriter::Finish() {
  SHARD_RETURN_IF_ERROR(out_->Commit());
  return hasher_->Finish(file_, rank_);
}

// ---------------------------------------------------------------------------------------------

namespace {

// Whether this kernel populates a mapping on request and reports the errors a fault would raise
// as SIGBUS (MADV_POPULATE_READ, Linux 5.14).
bool KernelPopulatesMappings() {
  static const bool populates = [] {
    const size_t page = kPageAlignment;
    void* probe = ::mmap(nullptr, page, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (probe == MAP_FAILED) return false;
    const bool ok = ::madvise(probe, page, MADV_POPULATE_READ) == 0;
    ::munmap(probe, page);
    return ok;
  }();
  return populates;
}

// A restore reads the shard files through a read-only mapping: one thread has the kernel bring
// each group of blocks into the page cache and map it (MADV_POPULATE_READ, which reports a read
// error or a file cut short as an error where touching the page would raise SIGBUS), and the
// checking thread hashes the mapped bytes and copies them into the engine in one pass, with
// streaming stores. A `pread` makes the reading thread copy every byte into the engine itself,
// into memory as large as the engine's arrays rather than a buffer that stays in the processor's
// caches, while the disk waits. Mapped, a 1 GiB read went from 0.87x to 1.17x the raw read on
// the 2-core VM, and the 1-rank restore from a median of 0.86x to 0.98x (docs/checkpoints.md,
// "Mapped reads"). Where the kernel or the file system cannot map a shard, it is read with
// `pread`: the same bytes and checks. Shard never changes a committed shard file; one cut short
// by someone else between a group's population and its copy would raise SIGBUS in the reader.
class DirectoryShardStorage : public ShardStorage {
 public:
  DirectoryShardStorage(std::string dir, std::vector<ShardRecord> shards)
      : dir_(std::move(dir)), shards_(std::move(shards)), files_(shards_.size()) {}
  ~DirectoryShardStorage() override {
    for (size_t shard = 0; shard < files_.size(); ++shard) {
      if (files_[shard].map != nullptr) ::munmap(files_[shard].map, shards_[shard].bytes);
      if (files_[shard].fd >= 0) ::close(files_[shard].fd);
    }
  }

  absl::Status Read(int shard, uint64_t offset, uint64_t bytes, char* out) override {
    SHARD_ASSIGN_OR_RETURN(const OpenFile* file, Open(shard));
    SHARD_RETURN_IF_ERROR(ReadAt(file->fd, offset, out, bytes, Path(shard)));
    DropFromPageCache(*file, offset, bytes);
    return absl::OkStatus();
  }

  std::string Describe(int shard) const override {
    return absl::StrCat("checkpoint shard '", Path(shard), "'");
  }

  absl::StatusOr<bool> CanView(int shard) override {
    SHARD_ASSIGN_OR_RETURN(const OpenFile* file, Open(shard));
    return file->map != nullptr;
  }

  absl::StatusOr<const char*> View(int shard, uint64_t offset, uint64_t bytes) override {
    SHARD_ASSIGN_OR_RETURN(const OpenFile* file, Open(shard));
    char* at = file->map + offset;
    while (::madvise(at, bytes, MADV_POPULATE_READ) != 0) {
      if (errno == EINTR) continue;
      return absl::DataLossError(absl::StrCat(
          Describe(shard), ": bytes [", offset, ", ", offset + bytes, ") cannot be read: ",
          errno == EFAULT ? "an I/O error, or the file is shorter than its manifest says"
                          : std::strerror(errno)));
    }
    return at;
  }

  void Release(int shard, uint64_t offset, uint64_t bytes) override {
    const OpenFile& file = files_[shard];
    ::madvise(file.map + offset, bytes, MADV_DONTNEED);
    DropFromPageCache(file, offset, bytes);
  }

 private:
  struct OpenFile {
    int fd = -1;
    char* map = nullptr;  // the whole file, read-only; nullptr where it is read with pread
  };

  absl::StatusOr<const OpenFile*> Open(int shard) {
    OpenFile& file = files_[shard];
    if (file.fd >= 0) return &file;
    const std::string path = Path(shard);
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      return absl::DataLossError(absl::StrCat("checkpoint shard '", path,
                                              "' cannot be opened: ", std::strerror(errno)));
    }
    const off_t size = ::lseek(fd, 0, SEEK_END);
    if (size != static_cast<off_t>(shards_[shard].bytes)) {
      ::close(fd);
      return absl::DataLossError(absl::StrCat("checkpoint shard '", path, "' is ", size,
                                              " bytes but the manifest records ",
                                              shards_[shard].bytes, " (truncated or replaced)"));
    }
    file.fd = fd;
    if (size > 0 && KernelPopulatesMappings()) {
      void* map = ::mmap(nullptr, static_cast<size_t>(size), PROT_READ, MAP_SHARED, fd, 0);
      if (map != MAP_FAILED) {
        file.map = static_cast<char*>(map);
        // The reader goes front to back: a miss reads ahead twice the disk's readahead instead
        // of reading around the page it missed. On a 16-core machine, interleaved, the 1-rank
        // restore went from 0.79-0.86x to 0.90-0.95x the raw read (docs/checkpoints.md).
        ::madvise(map, static_cast<size_t>(size), MADV_SEQUENTIAL);
        ::posix_fadvise(fd, 0, 0, POSIX_FADV_SEQUENTIAL);
      }
    }
    return &file;
  }

  // A restore reads each byte once: what was read leaves the page cache at once, so reading a
  // checkpoint recycles a few pages instead of filling (and evicting) gigabytes of it.
  static void DropFromPageCache(const OpenFile& file, uint64_t offset, uint64_t bytes) {
    ::posix_fadvise(file.fd, static_cast<off_t>(offset), static_cast<off_t>(bytes),
                    POSIX_FADV_DONTNEED);
  }

  std::string Path(int shard) const {
    return (std::filesystem::path(dir_) / shards_[shard].file).string();
  }

  std::string dir_;
  std::vector<ShardRecord> shards_;
  std::vector<OpenFile> files_;  // opened on first use
};

}  // namespace

absl::StatusOr<const char*> ShardStorage::View(int shard, uint64_t, uint64_t) {
  return absl::InternalError(absl::StrCat(Describe(shard), " cannot be viewed in place"));
}

std::unique_ptr<ShardStorage> DirectoryShards(const std::string& dir,
                                              const CheckpointManifest& manifest) {
  return std::make_unique<DirectoryShardStorage>(dir, manifest.shards);
}

absl::StatusOr<std::unique_ptr<CheckpointReader>> CheckpointReader::Open(const std::string& dir) {
  SHARD_ASSIGN_OR_RETURN(CheckpointManifest manifest, ReadCheckpointManifest(dir));
  std::unique_ptr<ShardStorage> storage = DirectoryShards(dir, manifest);
  return Open(std::move(manifest), std::move(storage), dir);
}

std::unique_ptr<CheckpointReader> CheckpointReader::Open(CheckpointManifest manifest,
                                                         std::unique_ptr<ShardStorage> storage,
                                                         std::string location) {
  std::unique_ptr<CheckpointReader> reader(new CheckpointReader());
  reader->location_ = std::move(location);
  reader->manifest_ = std::move(manifest);
  reader->storage_ = std::move(storage);
  return reader;
}

CheckpointReader::~CheckpointReader() = default;

absl::Status CheckpointReader::CheckBlock(int shard, uint64_t block, const char* data,
                                          uint64_t length) const {
  return CheckBlockHash(shard, block, XXH3_64bits(data, length), length);
}

absl::Status CheckpointReader::CheckBlockHash(int shard, uint64_t block, uint64_t xxh3,
                                              uint64_t length) const {
  if (Hex(xxh3) == manifest_.shards[shard].block_xxh3[block]) {
    return absl::OkStatus();
  }
  const uint64_t begin = block * kCheckpointBlockBytes;
  return absl::DataLossError(absl::StrCat(storage_->Describe(shard), " is corrupt: bytes [",
                                          begin, ", ", begin + length,
                                          ") do not match their checksum"));
}

absl::StatusOr<const char*> CheckpointReader::Block(int shard, uint64_t block) {
  ++cache_clock_;
  CachedBlock* slot = nullptr;
  for (CachedBlock& cached : cache_) {
    if (cached.shard == shard && cached.block == block) {
      cached.used = cache_clock_;
      return cached.bytes.data();
    }
    if (slot == nullptr || cached.used < slot->used) slot = &cached;
  }
  if (cache_.size() < kCachedBlocks) slot = &cache_.emplace_back();
  const ShardRecord& record = manifest_.shards[shard];
  const uint64_t begin = block * kCheckpointBlockBytes;
  const uint64_t length = std::min(kCheckpointBlockBytes, record.bytes - begin);
  slot->shard = -1;
  SHARD_RETURN_IF_ERROR(storage_->Read(shard, begin, length, slot->bytes.data()));
  SHARD_RETURN_IF_ERROR(CheckBlock(shard, block, slot->bytes.data(), length));
  slot->shard = shard;
  slot->block = block;
  slot->used = cache_clock_;
  return slot->bytes.data();
}

absl::Status CheckpointReader::FromAnySource(int shard, const std::function<absl::Status()>& read) {
  while (true) {
    absl::Status status = read();
    // Bytes that failed their checksum (DataLoss) are refused, and read again from the next
    // source of the shard while the storage has one (a memory snapshot's next holder).
    if (!absl::IsDataLoss(status) || !storage_->Refuse(shard, status)) return status;
  }
}

absl::Status CheckpointReader::ReadBytes(int shard, uint64_t offset, uint64_t bytes, char* out) {
  const ShardRecord& record = manifest_.shards[shard];
  if (offset + bytes > record.bytes) {
    return absl::DataLossError(absl::StrCat(storage_->Describe(shard), " holds ", record.bytes,
                                            " bytes; bytes [", offset, ", ", offset + bytes,
                                            ") are past its end"));
  }
  while (bytes > 0) {
    const uint64_t block = offset / kCheckpointBlockBytes;
    const uint64_t within = offset - block * kCheckpointBlockBytes;
    // Whole blocks go straight into `out` and are checked there.
    uint64_t whole = 0;
    if (within == 0) {
      whole = bytes / kCheckpointBlockBytes * kCheckpointBlockBytes;
      if (offset + bytes == record.bytes) whole = bytes;  // the last block may be short
    }
    if (whole > 0) {
      SHARD_RETURN_IF_ERROR(
          FromAnySource(shard, [&] { return ReadWholeBlocks(shard, block, whole, out); }));
      out += whole;
      offset += whole;
      bytes -= whole;
      continue;
    }
    const char* data = nullptr;
    SHARD_RETURN_IF_ERROR(FromAnySource(shard, [&]() -> absl::Status {
      SHARD_ASSIGN_OR_RETURN(data, Block(shard, block));
      return absl::OkStatus();
    }));
    const uint64_t take = std::min(bytes, kCheckpointBlockBytes - within);
    StreamCopy(out, data + within, take);
    out += take;
    offset += take;
    bytes -= take;
  }
  return absl::OkStatus();
}

absl::Status CheckpointReader::ReadWholeBlocks(int shard, uint64_t first, uint64_t bytes,
                                               char* out) {
  const uint64_t begin = first * kCheckpointBlockBytes;
  const uint64_t blocks = (bytes + kCheckpointBlockBytes - 1) / kCheckpointBlockBytes;
  auto length = [&](uint64_t i) {
    return std::min(kCheckpointBlockBytes, bytes - i * kCheckpointBlockBytes);
  };
  SHARD_ASSIGN_OR_RETURN(const bool mapped, storage_->CanView(shard));
  // A read is copied from page cache pages, which hold the file's bytes at their own offsets
  // (see SlowCopy).
  const bool staged = !mapped && SlowCopy(reinterpret_cast<uintptr_t>(out), begin);
  if (blocks == 1 && !mapped && !staged) {
    SHARD_RETURN_IF_ERROR(storage_->Read(shard, begin, bytes, out));
    return CheckBlock(shard, first, out, bytes);
  }
  if (staged && staging_.empty()) {
    for (int i = 0; i < 2; ++i) {
      staging_.emplace_back(kStagingShift + kBlocksPerRead * kCheckpointBlockBytes);
    }
  }
  // Where each block landed: in `out`, in a staging area (reads of kBlocksPerRead blocks,
  // alternately into each), or in the storage's view of it. Mapped or staged, the checker copies
  // each block out.
  std::vector<const char*> landed_at(blocks);
  // How many blocks may land ahead of the checker: a staging area is read into again once the
  // blocks read into it before are out; mapped blocks hold page cache until released.
  const uint64_t lead = staged ? kBlocksPerRead : mapped ? 2 * kBlocksPerRead : blocks;
  // Blocks are checked (and copied out) on a second thread while the next ones are read: a
  // read, then its checksums, one after the other, left the device idle while XXH3 ran (about
  // 11 GB/s a core here, against 1.5-3.5 GB/s of disk). Each block is checked soon after it
  // arrives, while it is still in the processor's caches.
  absl::Mutex mu;
  uint64_t read = 0;     // blocks landed so far
  uint64_t done = 0;     // blocks checked (and copied out) so far
  bool failed = false;   // a read or a check failed: nobody goes on
  absl::Status checked;  // the checker's verdict
  std::thread checker([&] {
    for (uint64_t i = 0; i < blocks; ++i) {
      {
        absl::MutexLock lock(&mu);
        auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return read > i || failed; };
        mu.Await(absl::Condition(&ready));
        if (read <= i) return;  // the read failed
      }
      absl::Status status =
          mapped || staged ? CheckAndCopy(shard, first + i, landed_at[i], length(i),
                                          out + i * kCheckpointBlockBytes)
                           : CheckBlock(shard, first + i, landed_at[i], length(i));
      absl::MutexLock lock(&mu);
      if (!status.ok()) {
        checked = std::move(status);
        failed = true;
        return;
      }
      done = i + 1;
    }
  });
  // Mapped blocks [0, released) are given back to the storage.
  uint64_t released = 0;
  auto release = [&](uint64_t upto) {
    if (!mapped || upto == released) return;
    storage_->Release(shard, begin + released * kCheckpointBlockBytes,
                      (upto - 1 - released) * kCheckpointBlockBytes + length(upto - 1));
    released = upto;
  };
  absl::Status status;
  for (uint64_t i = 0, count = 0; i < blocks && status.ok(); i += count) {
    // The last group a block at a time: what is left to check once the last read is in (while
    // the disk idles) is then one block, not a group. Whole groups to the end left the disk
    // idle for 5% of a 1 GiB restore on one rank; this halved it.
    count = blocks - i > kBlocksPerRead ? kBlocksPerRead : 1;
    uint64_t checked_blocks;
    {
      absl::MutexLock lock(&mu);
      auto free = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return failed || done + lead >= i; };
      mu.Await(absl::Condition(&free));
      if (failed) break;
      checked_blocks = done;
    }
    release(checked_blocks);
    const uint64_t offset = begin + i * kCheckpointBlockBytes;
    const uint64_t group_bytes = (count - 1) * kCheckpointBlockBytes + length(i + count - 1);
    const char* group = nullptr;
    if (mapped) {
      absl::StatusOr<const char*> view = storage_->View(shard, offset, group_bytes);
      status = view.status();
      if (view.ok()) group = *view;
    } else {
      char* into = staged ? staging_[i / kBlocksPerRead % 2].data() + kStagingShift +
                                i % kBlocksPerRead * kCheckpointBlockBytes
                          : out + i * kCheckpointBlockBytes;
      status = storage_->Read(shard, offset, group_bytes, into);
      group = into;
    }
    absl::MutexLock lock(&mu);
    if (status.ok()) {
      for (uint64_t k = 0; k < count; ++k) landed_at[i + k] = group + k * kCheckpointBlockBytes;
      read += count;
    } else {
      failed = true;
    }
  }
  checker.join();
  release(read);
  return status.ok() ? checked : status;
}

absl::Status CheckpointReader::CheckAndCopy(int shard, uint64_t block, const char* data,
                                            uint64_t length, char* out) const {
  // A piece at a time, so that the copy reads what the checksum just brought into the cache.
  constexpr uint64_t kPiece = 256 << 10;
  const std::unique_ptr<XXH3_state_t, decltype(&XXH3_freeState)> state(XXH3_createState(),
                                                                       &XXH3_freeState);
  XXH3_64bits_reset(state.get());
  for (uint64_t done = 0; done < length; done += kPiece) {
    const uint64_t piece = std::min(kPiece, length - done);
    XXH3_64bits_update(state.get(), data + done, piece);
    StreamCopy(out + done, data + done, piece);
  }
  return CheckBlockHash(shard, block, XXH3_64bits_digest(state.get()), length);
}

absl::Status CheckpointReader::ReadElements(int param, int array, int64_t begin, int64_t count,
                                            float* out) {
  const CheckpointTensor& tensor = manifest_.tensors[param];
  if (begin < 0 || count < 0 || begin + count > tensor.param.numel() ||
      array >= static_cast<int>(manifest_.state_names.size())) {
    return absl::OutOfRangeError(absl::StrCat("elements [", begin, ", ", begin + count, ") of '",
                                              tensor.param.name, "' array ", array,
                                              " are not in the checkpoint"));
  }
  const int64_t end = begin + count;
  auto piece = std::upper_bound(tensor.pieces.begin(), tensor.pieces.end(), begin,
                                [](int64_t value, const TensorPiece& p) { return value < p.begin; });
  --piece;  // the piece holding `begin`
  for (int64_t next = begin; next < end; ++piece) {
    const int64_t stop = std::min(end, piece->end);
    const int64_t numel = piece->end - piece->begin;
    const uint64_t offset = piece->offset + ArrayBytes(numel) * (array + 1) +
                            ArrayBytes(next - piece->begin);
    SHARD_RETURN_IF_ERROR(ReadBytes(piece->shard, offset, ArrayBytes(stop - next),
                                    reinterpret_cast<char*>(out + (next - begin))));
    next = stop;
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> CheckpointReader::ReadExtra(int shard, const ShardExtra& extra) {
  std::string bytes(extra.bytes, '\0');
  SHARD_RETURN_IF_ERROR(ReadBytes(shard, extra.offset, extra.bytes, bytes.data()));
  return bytes;
}

absl::Status CheckpointReader::VerifyShard(int shard, const std::function<void(uint64_t)>& progress) {
  const ShardRecord& record = manifest_.shards[shard];
  XXH3_state_t* whole = XXH3_createState();
  XXH3_64bits_reset(whole);
  absl::Status result;
  for (uint64_t block = 0; block < record.block_xxh3.size() && result.ok(); ++block) {
    absl::StatusOr<const char*> data = absl::UnknownError("not read");
    (void)FromAnySource(shard, [&] {
      data = Block(shard, block);
      return data.status();
    });
    if (!data.ok()) {
      result = data.status();
      break;
    }
    const uint64_t length = std::min(kCheckpointBlockBytes, record.bytes - block * kCheckpointBlockBytes);
    XXH3_64bits_update(whole, *data, length);
    if (progress) progress(length);
  }
  if (result.ok() && Hex(XXH3_64bits_digest(whole)) != record.xxh3) {
    result = absl::DataLossError(
        absl::StrCat(storage_->Describe(shard), " does not match its whole-file checksum"));
  }
  XXH3_freeState(whole);
  return result;
}

absl::Status ExportCheckpoint(const std::string& dir, const std::string& out_path,
                              bool with_state, uint64_t buffer_bytes,
                              const std::function<void(uint64_t, uint64_t)>& progress) {
  SHARD_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointReader> reader, CheckpointReader::Open(dir));
  const CheckpointManifest& m = reader->manifest();
  struct Item {
    int param;
    int array;  // -1: the parameter itself
  };
  std::vector<TensorDecl> decls;
  std::vector<Item> items;
  uint64_t total = 0;
  for (size_t p = 0; p < m.tensors.size(); ++p) {
    const ParamSpec& param = m.tensors[p].param;
    decls.push_back(TensorDecl{param.name, DataType::kFloat32, param.shape});
    items.push_back(Item{static_cast<int>(p), -1});
    total += ArrayBytes(param.numel());
    if (!with_state || !param.requires_grad) continue;
    for (size_t k = 0; k < m.state_names.size(); ++k) {
      decls.push_back(TensorDecl{param.name + "." + m.state_names[k], DataType::kFloat32,
                                 param.shape});
      items.push_back(Item{static_cast<int>(p), static_cast<int>(k)});
      total += ArrayBytes(param.numel());
    }
  }
  std::map<std::string, std::string> metadata = TrainedFileMetadata(
      m.step, m.optimizer.kind, m.counters.value_or(TrainingCounters{.optimizer_step = m.step}));
  metadata["checkpoint"] = m.id;
  SHARD_ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsWriter> writer,
                         SafetensorsWriter::Create(out_path, decls, metadata));
  const int64_t chunk = std::max<int64_t>(1, static_cast<int64_t>(buffer_bytes / sizeof(float)));
  std::vector<float> buffer(chunk);
  uint64_t done = 0;
  for (const Item& item : items) {
    const int64_t numel = m.tensors[item.param].param.numel();
    for (int64_t begin = 0; begin < numel; begin += chunk) {
      const int64_t count = std::min(chunk, numel - begin);
      SHARD_RETURN_IF_ERROR(
          reader->ReadElements(item.param, item.array, begin, count, buffer.data()));
      SHARD_RETURN_IF_ERROR(writer->Append(buffer.data(), ArrayBytes(count)));
      done += ArrayBytes(count);
      if (progress) progress(done, total);
    }
  }
  return writer->Finish();
}

}  // namespace shard
