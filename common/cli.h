// Command-line helpers shared by the binaries (CLI11).
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "CLI/CLI.hpp"
#include "absl/time/time.h"

namespace shard {

// Accepts positive durations in absl's syntax: "10s", "500ms", "1m30s".
inline CLI::Validator DurationValidator() {
  return CLI::Validator(
      [](std::string& value) -> std::string {
        absl::Duration parsed;
        if (!absl::ParseDuration(value, &parsed) || parsed <= absl::ZeroDuration()) {
          return "expected a positive duration such as 10s or 500ms, got '" + value + "'";
        }
        return "";
      },
      "DURATION");
}

// A value DurationValidator accepted.
inline absl::Duration ParsedDuration(const std::string& value) {
  absl::Duration parsed;
  absl::ParseDuration(value, &parsed);
  return parsed;
}

// A size flag given in MiB (fractions allowed), in bytes.
inline int64_t MebibytesToBytes(double mebibytes) {
  return static_cast<int64_t>(mebibytes * (1 << 20) + 0.5);
}

// Parses argv; returns the process exit code when the program must stop here (--help: 0,
// a usage error: 2, after CLI11 printed why), nullopt to go on.
inline std::optional<int> ParseCommandLine(CLI::App& app, int argc, char** argv) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }
  return std::nullopt;
}

}  // namespace shard
