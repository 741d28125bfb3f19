// Whole-file reads and crash-safe writes.
#pragma once

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace shard {

// Replaces `path` with `contents` so that a crash at any moment leaves either the old or the
// new file, never a torn one: write to a temporary name in the same directory, fsync, rename
// over `path`, fsync the directory.
absl::Status WriteFileAtomically(const std::string& path, absl::string_view contents);

// Reads all of `path`; NotFound if it does not exist.
absl::StatusOr<std::string> ReadFile(const std::string& path);

// Creates `path` and its parents if missing (mode 0755).
absl::Status MakeDirectories(const std::string& path);

}  // namespace shard
