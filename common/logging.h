// Process-wide log set-up shared by the binaries: one line per event on stderr.
#pragma once

#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "spdlog/fmt/fmt.h"

namespace shard {

// Sets the level (trace, debug, info, warn, error) and a line format that starts with
// timestamp, level and `context` (e.g. "coordinator" or "worker=w0 rank=1 gen=3").
absl::Status ConfigureLogging(absl::string_view level, absl::string_view context);

// Changes only the context part, e.g. when a worker's rank or generation changes.
void SetLogContext(absl::string_view context);

}  // namespace shard

// Lets spdlog/fmt print absl::string_view (e.g. absl::Status::message()), which this Abseil
// build keeps distinct from std::string_view.
template <>
struct fmt::formatter<absl::string_view> : fmt::formatter<fmt::string_view> {
  template <typename FormatContext>
  auto format(absl::string_view value, FormatContext& context) const {
    return fmt::formatter<fmt::string_view>::format(fmt::string_view(value.data(), value.size()),
                                                    context);
  }
};
