// Command-line helpers shared by the binaries (CLI11).
#pragma once

#include <cctype>
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

// Sizes given in MiB (fractions allowed) are more than 0 and at most 1 TiB: bounded, their
// byte count is defined (a double beyond int64's range has no conversion).
inline bool ValidMebibytes(double mebibytes) { return mebibytes > 0 && mebibytes <= (1 << 20); }

inline CLI::Validator MebibytesValidator() {
  return CLI::Validator(
      [](std::string& value) -> std::string {
        double parsed = 0;
        if (!CLI::detail::lexical_cast(value, parsed) || !ValidMebibytes(parsed)) {
          return "expected MiB, more than 0 and at most 1048576 (1 TiB), got '" + value + "'";
        }
        return "";
      },
      "MIB");
}

// A size ValidMebibytes accepts, in bytes.
inline int64_t MebibytesToBytes(double mebibytes) {
  return static_cast<int64_t>(mebibytes * (1 << 20) + 0.5);
}

// A client's transport security files (proto/channel_security.h reads them). Empty fields are
// not used; no CA means plaintext.
struct ClientSecurityFiles {
  std::string ca;
  std::string cert;
  std::string key;
  std::string server_name;  // the name to check in the coordinator's certificate
  std::string token;        // file holding the token
};

// --tls-ca, --tls-cert, --tls-key, --tls-server-name and the token file flag of a client of the
// coordinator (shard-worker: --job-token-file; shardctl: --admin-token-file).
inline void AddClientSecurityFlags(CLI::App& app, ClientSecurityFiles* files,
                                   const std::string& token_flag, const std::string& token_help) {
  app.add_option("--tls-ca", files->ca,
                 "PEM CA that signed the coordinator's certificate: connect with TLS")
      ->check(CLI::ExistingFile);
  app.add_option("--tls-cert", files->cert,
                 "PEM client certificate, for a coordinator that requires mutual TLS")
      ->check(CLI::ExistingFile);
  app.add_option("--tls-key", files->key, "PEM private key of --tls-cert")
      ->check(CLI::ExistingFile);
  app.add_option("--tls-server-name", files->server_name,
                 "name to verify in the coordinator's certificate (default: the host of "
                 "--coordinator)");
  app.add_option(token_flag, files->token, token_help)->check(CLI::ExistingFile);
}

// Lets every top-level flag of `app` also come from the environment, as containers configure
// programs: --state-dir from SHARD_STATE_DIR. The command line wins. Subcommand flags are left
// alone so that one variable cannot change every subcommand (shardctl's --json).
inline void BindEnvironment(CLI::App& app) {
  for (CLI::Option* option : app.get_options()) {
    const std::string& name = option->get_single_name();
    if (option->get_lnames().empty() || name == "help" || !option->get_envname().empty()) continue;
    std::string variable = "SHARD_";
    for (char c : name) variable += c == '-' ? '_' : static_cast<char>(std::toupper(c));
    option->envname(variable);
  }
}

// Where flags come from. The three programs a deployment configures also read SHARD_*
// variables; tools (benchmarks) do not, so a developer's shell cannot change their runs.
enum class FlagSources { kCommandLine, kCommandLineAndEnvironment };

// Parses argv; returns the process exit code when the program must stop here (--help: 0,
// a usage error: 2, after CLI11 printed why), nullopt to go on.
inline std::optional<int> ParseCommandLine(CLI::App& app, int argc, char** argv,
                                           FlagSources sources = FlagSources::kCommandLine) {
  if (sources == FlagSources::kCommandLineAndEnvironment) BindEnvironment(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }
  return std::nullopt;
}

}  // namespace shard
