#include "common/logging.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "spdlog/sinks/stdout_sinks.h"
#include "spdlog/spdlog.h"

namespace shard {

absl::Status ConfigureLogging(absl::string_view level, absl::string_view context) {
  const spdlog::level::level_enum parsed = spdlog::level::from_str(std::string(level));
  // from_str maps anything it does not know to "off"; only accept that when asked for.
  if (parsed == spdlog::level::off && level != "off") {
    return absl::InvalidArgumentError(absl::StrCat(
        "unknown log level '", level, "'; expected trace, debug, info, warn, error or off"));
  }
  spdlog::set_default_logger(spdlog::stderr_logger_mt("shard"));
  spdlog::set_level(parsed);
  spdlog::flush_on(spdlog::level::info);
  SetLogContext(context);
  return absl::OkStatus();
}

void SetLogContext(absl::string_view context) {
  // '%' is spdlog's pattern escape; a context must never be read as a pattern flag.
  const std::string escaped = absl::StrReplaceAll(context, {{"%", "%%"}});
  spdlog::set_pattern(absl::StrCat("%Y-%m-%dT%H:%M:%S.%e %L ", escaped, " %v"));
}

}  // namespace shard
