// Tests of the coordinator's checkpoint side play the workers: a rank's shard written as zeros of
// the size its plan gives it, for the manager to commit (or fail) as a real one.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/checkpoint.h"
#include "gtest/gtest.h"

namespace shard {

// Writes rank `rank`'s shard (of `world`) of a checkpoint of `model` laid out by `plan` into
// `dir`, as zeros; its record, or an empty one (with a test failure) if it could not.
inline ShardRecord WriteZeroShard(const Manifest& model, const Plan& plan, const std::string& dir,
                                  int rank, int world) {
  const ShardLayout layout = MakeShardLayout(model, plan, rank, 2);
  absl::StatusOr<std::unique_ptr<ShardWriter>> writer = ShardWriter::Create(dir, rank, world);
  EXPECT_TRUE(writer.ok()) << writer.status();
  if (!writer.ok()) return {};
  const std::vector<char> zeros(layout.bytes, 0);
  EXPECT_TRUE((*writer)->Append(zeros.data(), zeros.size()).ok());
  absl::StatusOr<ShardRecord> record = (*writer)->Finish();
  EXPECT_TRUE(record.ok()) << record.status();
  return record.ok() ? *record : ShardRecord{};
}

}  // namespace shard
