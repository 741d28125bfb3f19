// The parameter manifest: what a model registers with the data path, in registration order.
// Every worker of a job must register the same manifest; its hash is compared across workers.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/dtype.h"

namespace shard {

struct ParamSpec {
  std::string name;
  std::vector<int64_t> shape;
  DataType dtype = DataType::kFloat32;
  bool requires_grad = true;

  int64_t numel() const;
  bool operator==(const ParamSpec& other) const = default;
};

struct Manifest {
  std::vector<ParamSpec> params;
  bool operator==(const Manifest& other) const = default;
};

// OK, or InvalidArgument naming the entry (index and name): empty names, duplicate names,
// shapes that are empty or have a dimension below 1, dtypes other than f32, bf16 and f16,
// or more than 2^40 elements in one parameter.
absl::Status ValidateManifest(const Manifest& manifest);

// {"params": [{"name": "layers.0.weight", "shape": [1024, 512], "dtype": "f32",
//              "requires_grad": true}, ...]}; dtype defaults to f32, requires_grad to true.
// Parses and validates; unknown keys are errors.
absl::StatusOr<Manifest> ParseManifestJson(absl::string_view json);
std::string ManifestToJson(const Manifest& manifest);

// 16 hex digits of XXH3-64 over a canonical encoding: equal manifests give equal hashes on
// every machine.
std::string ManifestHash(const Manifest& manifest);

// OK if equal; otherwise FailedPrecondition naming the first differing parameter and how it
// differs. `theirs_label` names the other side in the message (e.g. "worker w1").
absl::Status CompareManifests(const Manifest& ours, const Manifest& theirs,
                              absl::string_view theirs_label);

// Hex XXH3-64 of `bytes`, the hash behind every content hash of Shard.
std::string ContentHash(absl::string_view bytes);

// Appends fixed-width little-endian encodings, for canonical byte strings to hash.
void AppendInt(std::string* out, int64_t value);
void AppendString(std::string* out, absl::string_view value);

}  // namespace shard
