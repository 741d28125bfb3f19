// gtest assertions on absl::Status and absl::StatusOr, for every test tier.
#pragma once

#include <utility>

#include "absl/status/status.h"
#include "common/status_macros.h"
#include "gtest/gtest.h"

#define SHARD_ASSERT_OK(expr)                            \
  do {                                                   \
    const ::absl::Status shard_status_ = (expr);         \
    ASSERT_TRUE(shard_status_.ok()) << shard_status_;    \
  } while (false)

#define SHARD_EXPECT_OK(expr)                            \
  do {                                                   \
    const ::absl::Status shard_status_ = (expr);         \
    EXPECT_TRUE(shard_status_.ok()) << shard_status_;    \
  } while (false)

#define SHARD_ASSERT_OK_AND_ASSIGN(lhs, expr) \
  SHARD_ASSERT_OK_AND_ASSIGN_IMPL_(SHARD_CONCAT_(shard_statusor_, __LINE__), lhs, expr)
#define SHARD_ASSERT_OK_AND_ASSIGN_IMPL_(statusor, lhs, expr)  \
  auto statusor = (expr);                                      \
  ASSERT_TRUE(statusor.ok()) << statusor.status();             \
  lhs = std::move(statusor).value()
