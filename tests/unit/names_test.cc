#include "common/names.h"

#include <string>

#include "gtest/gtest.h"

namespace shard {
namespace {

TEST(ValidateNameTest, AcceptsPathSafeNames) {
  for (const char* name : {"w0", "worker-3", "job.v2_final", "A", "..a"}) {
    EXPECT_TRUE(ValidateName("worker id", name).ok()) << name;
  }
  EXPECT_TRUE(ValidateName("worker id", std::string(128, 'a')).ok());
}

TEST(ValidateNameTest, RejectsWhatCouldEscapeADirectoryOrBreakAKey) {
  for (const char* name : {"", ".", "..", "a/b", "../x", "a b", "w\n0", "w%0"}) {
    absl::Status status = ValidateName("worker id", name);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << name;
    EXPECT_NE(status.message().find("worker id"), absl::string_view::npos) << status;
  }
  EXPECT_FALSE(ValidateName("job name", std::string(129, 'a')).ok());
}

TEST(ValidateNameTest, NamesTheOffendingCharacterAndPosition) {
  absl::Status status = ValidateName("job name", "ab/c");
  EXPECT_NE(status.message().find("'/'"), absl::string_view::npos) << status;
  EXPECT_NE(status.message().find("position 2"), absl::string_view::npos) << status;
}

}  // namespace
}  // namespace shard
