// Real processes of our binaries for integration tests and benchmarks: output to a log file,
// killed by pid, waited for with a deadline, and never outliving the thread that started them.
#pragma once

#include <sys/types.h>

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace shard::testing {

// Path of one of our binaries in build/bin.
std::string BinaryPath(const std::string& name);

class Process {
 public:
  // Starts `argv[0]` (a path) with stdout and stderr appended to `log_path`, and `env`
  // ("KEY=VALUE") added to this process's environment. It gets SIGKILL if the thread that
  // started it ends first (PR_SET_PDEATHSIG), so that a crashed test or a killed benchmark
  // leaves none running: start processes from a thread that outlives them.
  static absl::StatusOr<Process> Start(std::vector<std::string> argv, std::string log_path,
                                       const std::vector<std::string>& env = {});

  Process(Process&& other) noexcept;
  Process& operator=(Process&& other) noexcept;
  Process(const Process&) = delete;
  Process& operator=(const Process&) = delete;
  // Kills (SIGKILL) and reaps a process that is still running, so no test leaks one.
  ~Process();

  pid_t pid() const { return pid_; }
  const std::string& log_path() const { return log_path_; }
  std::string Log() const;

  void Signal(int signal) const;
  // The exit code (128+signal when killed by one), or nullopt if it is still running after
  // `timeout`.
  std::optional<int> Wait(absl::Duration timeout);
  bool running() const { return pid_ > 0 && !exit_code_.has_value(); }
  // Whether it has ended, checked now (reaping it if so).
  bool Exited() { return pid_ <= 0 || Wait(absl::ZeroDuration()).has_value(); }
  // Peak resident memory of the exited process, in KiB (0 while it runs).
  int64_t max_rss_kb() const { return max_rss_kb_; }

 private:
  Process(pid_t pid, std::string log_path) : pid_(pid), log_path_(std::move(log_path)) {}
  pid_t pid_ = -1;
  std::string log_path_;
  std::optional<int> exit_code_;
  int64_t max_rss_kb_ = 0;
};

struct CommandResult {
  int exit_code = -1;
  std::string output;  // stdout and stderr together
  absl::Duration elapsed;
  int64_t max_rss_kb = 0;  // peak resident memory
};

// Runs a command to completion (killed after `timeout`, then exit_code is -1).
CommandResult RunCommand(std::vector<std::string> argv, absl::Duration timeout);

// A fresh empty directory under the test's temporary directory.
std::string MakeTempDir(const std::string& name);

// Polls `condition` every 50ms until it holds or `timeout` passes.
bool Eventually(const std::function<bool()>& condition, absl::Duration timeout);

}  // namespace shard::testing
