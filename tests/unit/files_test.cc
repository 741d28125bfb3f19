#include "common/files.h"

#include <filesystem>
#include <iterator>
#include <memory>
#include <string>

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

TEST(FilesTest, ALargeFileWrittenInOddPiecesReadsBackByteForByte) {
  // Past several write-behind windows (each handed to writeback when full, and dropped from the
  // page cache 64 MiB behind), in pieces that straddle them, ending inside a page.
  const std::string dir = FreshDir("large");
  const std::string path = dir + "/large.bin";
  std::string data((uint64_t{100} << 20) + 12345, '\0');
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<char>((i * 2654435761u) >> 13);
  absl::StatusOr<std::unique_ptr<AtomicFileWriter>> writer = AtomicFileWriter::Create(path);
  ASSERT_TRUE(writer.ok()) << writer.status();
  const size_t piece = (size_t{7} << 20) + 3;
  for (size_t at = 0; at < data.size(); at += piece) {
    ASSERT_TRUE((*writer)->Write(absl::string_view(data).substr(at, piece)).ok());
  }
  ASSERT_TRUE((*writer)->Commit().ok());
  absl::StatusOr<std::string> read = ReadFile(path);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_TRUE(*read == data);
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(dir),
                          std::filesystem::directory_iterator()),
            1);
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
