// A coordinator and workers of our binaries on 127.0.0.1 for integration tests: the coordinator
// on a free (or given) port with its logs in the test's directory, workers pointed at it,
// shardctl calls against it. Processes are killed by pid when their Process goes away.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "nlohmann/json.hpp"
#include "tests/support/process.h"

namespace shard::testing {

class LocalCluster {
 public:
  explicit LocalCluster(std::string dir) : dir_(std::move(dir)) {}

  // Starts shard-coordinator with `args` after --listen `host`:`port` (0: a free one) and
  // --port-file, logging to DIR/`log_name`, and waits until it serves (clients connect through
  // 127.0.0.1). A coordinator started earlier stays where it is (e.g. killed, to be restarted
  // on the same port).
  absl::Status StartCoordinator(const std::vector<std::string>& args, int port = 0,
                                const std::string& log_name = "coordinator.log",
                                const std::vector<std::string>& env = {},
                                const std::string& host = "127.0.0.1");
  Process& coordinator() { return *coordinator_; }
  const std::string& address() const { return address_; }
  int port() const { return port_; }

  // shard-worker --coordinator ADDRESS --id `id` `extra`, logging to DIR/`id`.log, with `env`
  // ("KEY=VALUE") added to its environment.
  Process StartWorker(const std::string& id, const std::vector<std::string>& extra = {},
                      const std::vector<std::string>& env = {});

  // shardctl --coordinator ADDRESS `args`.
  CommandResult Shardctl(const std::vector<std::string>& args,
                         absl::Duration timeout = absl::Seconds(30));
  // `shardctl status --json`, parsed; null on failure.
  nlohmann::json Status();

  // The committed checkpoints, oldest first, from `shardctl checkpoint list --json` (each with
  // "id", "dir", "step"); empty when the coordinator does not answer.
  std::vector<nlohmann::json> Checkpoints();

  // Starts `shardctl events --follow --json` against the current coordinator, writing to
  // DIR/events-N.jsonl; it ends by itself when that coordinator exits. Start one after each
  // (re)start of the coordinator whose history the test reads.
  void FollowEvents();
  // Every event the followers printed, once each (by sequence), oldest first. Followers of a
  // coordinator that has exited are waited for, so their output is complete.
  std::vector<nlohmann::json> Events();
  // Whether some event reads "KIND: DETAIL" with `text` in it, e.g. "dead: no heartbeat".
  bool HasEvent(absl::string_view text);

  const std::string& dir() const { return dir_; }

  // The shared-memory segments in /dev/shm that workers this cluster started still have (their
  // names carry the creating process's pid): none once every worker connected or exited.
  std::vector<std::string> WorkerSegmentsLeft() const;

 private:
  std::string dir_;
  std::vector<pid_t> worker_pids_;
  std::optional<Process> coordinator_;
  std::vector<Process> event_followers_;
  std::string address_;
  int port_ = 0;
};

// A port nothing listens on right now (for a coordinator that must come back on the same one).
int FreePort();

// When a log line of our binaries ("2026-11-22T16:27:14.750 I ...") was written.
std::optional<absl::Time> LineTime(absl::string_view line);

// The time of the first line of `log` written at or after `after` that contains `text`.
std::optional<absl::Time> FirstLineAfter(const std::string& log, absl::Time after,
                                         absl::string_view text);

// Every checkpoint id a worker's log says it restored from, in order.
std::vector<std::string> Restores(const std::string& log);

}  // namespace shard::testing
