// Scratch folders for tests. Header-only, so the portable GPU test binary uses it too.
#pragma once

#include <unistd.h>

#include <filesystem>
#include <string>

#include "gtest/gtest.h"

namespace shard {

// An empty folder <gtest temp dir>/<suite>-<pid>/<name>. Per process: ctest runs a binary's
// tests in parallel processes, which must not empty each other's folders.
inline std::string FreshTestDirectory(const std::string& suite, const std::string& name) {
  const std::string dir =
      ::testing::TempDir() + "/" + suite + "-" + std::to_string(getpid()) + "/" + name;
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

}  // namespace shard
