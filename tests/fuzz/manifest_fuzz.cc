// Fuzz target: the parameter manifest parser (common/manifest.h, ParseManifestJson).
// Promise: InvalidArgument or a manifest that ValidateManifest accepts; never a crash, an
// exception or unbounded memory. A parsed manifest survives ManifestToJson and a second parse
// unchanged, with the same hash.
#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "common/manifest.h"
#include "tests/fuzz/fuzz_check.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const absl::string_view json(reinterpret_cast<const char*>(data), size);
  const absl::StatusOr<shard::Manifest> manifest = shard::ParseManifestJson(json);
  if (!manifest.ok()) {
    FUZZ_CHECK(absl::IsInvalidArgument(manifest.status()), "unexpected error code: %s",
               manifest.status().ToString().c_str());
    return 0;
  }
  FUZZ_CHECK(shard::ValidateManifest(*manifest).ok(), "parsed but invalid");
  for (const shard::ParamSpec& param : manifest->params) {
    FUZZ_CHECK(!param.name.empty() && !param.shape.empty(), "empty name or shape");
    const int64_t numel = param.numel();
    FUZZ_CHECK(numel >= 1 && numel <= (int64_t{1} << 40), "numel %lld out of range",
               static_cast<long long>(numel));
  }
  const std::string text = shard::ManifestToJson(*manifest);
  const absl::StatusOr<shard::Manifest> again = shard::ParseManifestJson(text);
  FUZZ_CHECK(again.ok(), "its own JSON does not parse: %s", again.status().ToString().c_str());
  FUZZ_CHECK(*again == *manifest, "round trip changed the manifest");
  FUZZ_CHECK(shard::ManifestHash(*again) == shard::ManifestHash(*manifest), "hash changed");
  FUZZ_CHECK(shard::CompareManifests(*manifest, *again, "the copy").ok(), "compare failed");
  return 0;
}
