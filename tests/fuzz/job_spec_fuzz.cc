// Fuzz target: the job spec (proto/job_convert.h ParseJobSpecJson + JobConfigFromProto, and
// common/job_spec.h ValidateJobConfig), the JSON document the coordinator reads with --job.
// Promise: InvalidArgument, or a JobConfig that ValidateJobConfig accepts and whose model is a
// valid manifest; never a crash or undefined behaviour (UBSan watches the number conversions).
// The explicit message of a job (ToProto, what workers receive) gives the same job again,
// also through its JSON text.
#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "common/job_spec.h"
#include "common/manifest.h"
#include "google/protobuf/util/json_util.h"
#include "proto/job_convert.h"
#include "tests/fuzz/fuzz_check.h"

namespace {

std::string Canonical(const shard::v1::JobSpec& spec) {
  std::string bytes;
  FUZZ_CHECK(spec.SerializeToString(&bytes), "cannot serialise");
  return bytes;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const absl::string_view json(reinterpret_cast<const char*>(data), size);
  const absl::StatusOr<shard::v1::JobSpec> spec = shard::ParseJobSpecJson(json);
  if (!spec.ok()) {
    FUZZ_CHECK(absl::IsInvalidArgument(spec.status()), "unexpected error code: %s",
               spec.status().ToString().c_str());
    return 0;
  }
  const absl::StatusOr<shard::JobConfig> job = shard::JobConfigFromProto(*spec, "/jobs/fuzz");
  if (!job.ok()) {
    FUZZ_CHECK(absl::IsInvalidArgument(job.status()), "unexpected error code: %s",
               job.status().ToString().c_str());
    return 0;
  }
  FUZZ_CHECK(shard::ValidateJobConfig(*job).ok(), "converted but invalid");
  const absl::Status model = shard::ValidateManifest(shard::MlpManifest(job->widths));
  FUZZ_CHECK(model.ok(), "valid job, invalid model: %s", model.ToString().c_str());

  // What the workers receive, converted again (paths are absolute now, so the base directory
  // no longer matters), gives the same explicit message.
  const shard::v1::JobSpec explicit_spec = shard::ToProto(*job);
  const absl::StatusOr<shard::JobConfig> again =
      shard::JobConfigFromProto(explicit_spec, "/elsewhere");
  FUZZ_CHECK(again.ok(), "explicit spec rejected: %s", again.status().ToString().c_str());
  FUZZ_CHECK(Canonical(shard::ToProto(*again)) == Canonical(explicit_spec),
             "explicit spec changed the job");

  // And through JSON, as a job file written from it would be read.
  std::string text;
  FUZZ_CHECK(google::protobuf::util::MessageToJsonString(explicit_spec, &text).ok(),
             "cannot print JSON");
  const absl::StatusOr<shard::v1::JobSpec> reparsed = shard::ParseJobSpecJson(text);
  FUZZ_CHECK(reparsed.ok(), "own JSON rejected: %s", reparsed.status().ToString().c_str());
  FUZZ_CHECK(Canonical(*reparsed) == Canonical(explicit_spec), "JSON round trip changed it");
  return 0;
}
