#include "common/files.h"

#include <filesystem>

#include "gtest/gtest.h"

namespace shard {
namespace {

std::string FreshDir(const std::string& name) {
  const std::string dir = ::testing::TempDir() + "/shard-files-test-" + name;
  std::filesystem::remove_all(dir);
  EXPECT_TRUE(MakeDirectories(dir).ok());
  return dir;
}

TEST(FilesTest, AtomicWriteReplacesContentsAndLeavesNoTemporaryFiles) {
  const std::string dir = FreshDir("replace");
  const std::string path = dir + "/state.json";
  ASSERT_TRUE(WriteFileAtomically(path, "first").ok());
  ASSERT_TRUE(WriteFileAtomically(path, std::string(100000, 'x')).ok());
  absl::StatusOr<std::string> read = ReadFile(path);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(*read, std::string(100000, 'x'));
  int files = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    ++files;
    EXPECT_EQ(entry.path().filename(), "state.json");
  }
  EXPECT_EQ(files, 1);
}

TEST(FilesTest, ReadingAMissingFileIsNotFoundAndNamesIt) {
  absl::StatusOr<std::string> read = ReadFile("/nonexistent/shard/file");
  EXPECT_EQ(read.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(read.status().message().find("/nonexistent/shard/file"), absl::string_view::npos);
}

TEST(FilesTest, WriteIntoAMissingDirectoryFailsWithoutCreatingAnything) {
  absl::Status written = WriteFileAtomically("/nonexistent/shard/file", "x");
  EXPECT_FALSE(written.ok());
  EXPECT_FALSE(std::filesystem::exists("/nonexistent/shard"));
}

}  // namespace
}  // namespace shard
