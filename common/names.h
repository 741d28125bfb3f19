// Validation of the names that end up in keys, logs and file paths (job names, worker ids).
#pragma once


#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace shard {

// OK when `value` is 1..128 characters of [A-Za-z0-9._-] and not "." or "..", so it is safe
// as a path component; otherwise InvalidArgument naming `what` and the offending character.
absl::Status ValidateName(absl::string_view what, absl::string_view value);

}  // namespace shard
