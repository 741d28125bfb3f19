// Early-return helpers for absl::Status / absl::StatusOr, as used throughout Shard.
#pragma once

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define SHARD_CONCAT_INNER_(a, b) a##b
#define SHARD_CONCAT_(a, b) SHARD_CONCAT_INNER_(a, b)

// Returns the status from the enclosing function if `expr` is not OK.
#define SHARD_RETURN_IF_ERROR(expr)                  \
  do {                                               \
    ::absl::Status shard_status_ = (expr);           \
    if (!shard_status_.ok()) return shard_status_;   \
  } while (false)

// `lhs = value of expr`, or returns its status from the enclosing function.
#define SHARD_ASSIGN_OR_RETURN(lhs, expr) \
  SHARD_ASSIGN_OR_RETURN_IMPL_(SHARD_CONCAT_(shard_statusor_, __LINE__), lhs, expr)
#define SHARD_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, expr) \
  auto statusor = (expr);                                 \
  if (!statusor.ok()) return std::move(statusor).status(); \
  lhs = std::move(statusor).value()
