#include "common/manifest.h"

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "common/xxh3.h"
#include "nlohmann/json.hpp"

namespace shard {
namespace {

constexpr int64_t kMaxParamNumel = int64_t{1} << 40;

std::string Describe(const ParamSpec& param) {
  return absl::StrCat(param.name, " ", DataTypeName(param.dtype), "[",
                      absl::StrJoin(param.shape, ", "), "]",
                      param.requires_grad ? "" : " (no grad)");
}

}  // namespace

int64_t ParamSpec::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

absl::Status ValidateManifest(const Manifest& manifest) {
  if (manifest.params.empty()) {
    return absl::InvalidArgumentError("the manifest has no parameters");
  }
  absl::flat_hash_set<absl::string_view> names;
  for (size_t i = 0; i < manifest.params.size(); ++i) {
    const ParamSpec& param = manifest.params[i];
    const std::string where = absl::StrCat("manifest entry ", i, " ('", param.name, "')");
    if (param.name.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("manifest entry ", i, " has an empty name"));
    }
    if (!names.insert(param.name).second) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, " repeats the name of an earlier parameter"));
    }
    if (param.shape.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, " has an empty shape; give at least one dimension"));
    }
    int64_t numel = 1;
    for (size_t d = 0; d < param.shape.size(); ++d) {
      if (param.shape[d] < 1) {
        return absl::InvalidArgumentError(absl::StrCat(where, " has dimension ", d, " of size ",
                                                       param.shape[d], "; sizes must be >= 1"));
      }
      if (numel > kMaxParamNumel / param.shape[d]) {
        return absl::InvalidArgumentError(
            absl::StrCat(where, " has more than 2^40 elements"));
      }
      numel *= param.shape[d];
    }
    if (param.dtype == DataType::kInt64 || param.dtype == DataType::kFloat64) {
      return absl::InvalidArgumentError(absl::StrCat(where, " has dtype ",
                                                     DataTypeName(param.dtype),
                                                     "; parameters are f32, bf16 or f16"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<Manifest> ParseManifestJson(absl::string_view json) {
  const nlohmann::json doc = nlohmann::json::parse(json, nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded()) return absl::InvalidArgumentError("the manifest is not valid JSON");
  if (!doc.is_object() || !doc.contains("params") || !doc["params"].is_array()) {
    return absl::InvalidArgumentError(
        "the manifest must be an object with a \"params\" array: "
        "{\"params\": [{\"name\": ..., \"shape\": [...], \"dtype\": \"f32\"}]}");
  }
  for (const auto& [key, value] : doc.items()) {
    if (key != "params") {
      return absl::InvalidArgumentError(absl::StrCat("unknown manifest key \"", key, "\""));
    }
  }
  Manifest manifest;
  const nlohmann::json& params = doc["params"];
  for (size_t i = 0; i < params.size(); ++i) {
    const nlohmann::json& entry = params[i];
    const std::string where = absl::StrCat("manifest entry ", i);
    if (!entry.is_object()) return absl::InvalidArgumentError(absl::StrCat(where, " is not an object"));
    ParamSpec param;
    for (const auto& [key, value] : entry.items()) {
      if (key == "name" && value.is_string()) {
        param.name = value.get<std::string>();
      } else if (key == "shape" && value.is_array()) {
        for (const nlohmann::json& dim : value) {
          if (!dim.is_number_integer()) {
            return absl::InvalidArgumentError(
                absl::StrCat(where, " has a shape with a non-integer dimension"));
          }
          param.shape.push_back(dim.get<int64_t>());
        }
      } else if (key == "dtype" && value.is_string()) {
        absl::StatusOr<DataType> dtype = ParseDataType(value.get<std::string>());
        if (!dtype.ok()) {
          return absl::InvalidArgumentError(absl::StrCat(where, ": ", dtype.status().message()));
        }
        param.dtype = *dtype;
      } else if (key == "requires_grad" && value.is_boolean()) {
        param.requires_grad = value.get<bool>();
      } else {
        return absl::InvalidArgumentError(
            absl::StrCat(where, " has an unknown or mistyped key \"", key,
                         "\" (expected name: string, shape: [int], dtype: string, "
                         "requires_grad: bool)"));
      }
    }
    manifest.params.push_back(std::move(param));
  }
  SHARD_RETURN_IF_ERROR(ValidateManifest(manifest));
  return manifest;
}

std::string ManifestToJson(const Manifest& manifest) {
  nlohmann::json params = nlohmann::json::array();
  for (const ParamSpec& param : manifest.params) {
    params.push_back({{"name", param.name},
                      {"shape", param.shape},
                      {"dtype", std::string(DataTypeName(param.dtype))},
                      {"requires_grad", param.requires_grad}});
  }
  return nlohmann::json{{"params", params}}.dump(2);
}

void AppendInt(std::string* out, int64_t value) {
  const uint64_t bits = static_cast<uint64_t>(value);
  for (int i = 0; i < 8; ++i) out->push_back(static_cast<char>((bits >> (8 * i)) & 0xff));
}

void AppendString(std::string* out, absl::string_view value) {
  AppendInt(out, static_cast<int64_t>(value.size()));
  out->append(value.data(), value.size());
}

std::string ContentHash(absl::string_view bytes) {
  return absl::StrFormat("%016x", XXH3_64bits(bytes.data(), bytes.size()));
}

std::string ManifestHash(const Manifest& manifest) {
  std::string canonical;
  AppendInt(&canonical, static_cast<int64_t>(manifest.params.size()));
  for (const ParamSpec& param : manifest.params) {
    AppendString(&canonical, param.name);
    AppendString(&canonical, DataTypeName(param.dtype));
    AppendInt(&canonical, param.requires_grad ? 1 : 0);
    AppendInt(&canonical, static_cast<int64_t>(param.shape.size()));
    for (int64_t d : param.shape) AppendInt(&canonical, d);
  }
  return ContentHash(canonical);
}

absl::Status CompareManifests(const Manifest& ours, const Manifest& theirs,
                              absl::string_view theirs_label) {
  const size_t common = std::min(ours.params.size(), theirs.params.size());
  for (size_t i = 0; i < common; ++i) {
    if (ours.params[i] == theirs.params[i]) continue;
    return absl::FailedPreconditionError(absl::StrCat(
        "parameter ", i, " differs: the job has ", Describe(ours.params[i]), " but ",
        theirs_label, " registered ", Describe(theirs.params[i])));
  }
  if (ours.params.size() != theirs.params.size()) {
    const bool theirs_longer = theirs.params.size() > ours.params.size();
    const ParamSpec& extra = theirs_longer ? theirs.params[common] : ours.params[common];
    return absl::FailedPreconditionError(absl::StrCat(
        "manifests differ in length: the job has ", ours.params.size(), " parameters, ",
        theirs_label, " registered ", theirs.params.size(), "; the first unmatched is ",
        Describe(extra), theirs_longer ? std::string(" (only in ") + std::string(theirs_label) + ")"
                                       : " (missing from " + std::string(theirs_label) + ")"));
  }
  return absl::OkStatus();
}

}  // namespace shard
