// The job spec file: protobuf's JSON mapping of shard.v1.JobSpec, converted to the checked
// JobConfig of common/job_spec.h (defaults applied) and back to a fully explicit message for
// the workers.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "common/job_spec.h"
#include "shard/v1/job.pb.h"

namespace shard {

// Parses JSON; unknown fields and wrong types are InvalidArgument.
absl::StatusOr<v1::JobSpec> ParseJobSpecJson(absl::string_view json);

// Applies defaults, checks required fields and every rule of ValidateJobConfig. Relative data,
// init and output paths are taken relative to `base_dir` (the job file's directory).
absl::StatusOr<JobConfig> JobConfigFromProto(const v1::JobSpec& spec, const std::string& base_dir);

// Every field explicit, so workers apply no defaults of their own.
v1::JobSpec ToProto(const JobConfig& job);

// Reads, parses, converts and checks a job file, including its data file.
absl::StatusOr<JobConfig> LoadJobFile(const std::string& path);

}  // namespace shard
