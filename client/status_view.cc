#include "client/status_view.h"

#include <algorithm>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace shard {
namespace {

std::string JobState(const v1::WorldView& world) {
  return EnumWord(v1::JobState_Name(world.state()), "JOB_STATE_");
}

std::string WorkerState(const v1::WorkerStatus& worker) {
  return EnumWord(v1::WorkerState_Name(worker.state()), "WORKER_STATE_");
}

std::string SelfCheck(const v1::WorkerStatus& worker) {
  return EnumWord(v1::SelfCheckState_Name(worker.self_check().state()), "SELF_CHECK_STATE_");
}

std::string Ago(int64_t ms) {
  if (ms < 10000) return absl::StrCat(ms, "ms ago");
  return absl::StrFormat("%.1fs ago", ms / 1000.0);
}

// "42s", "3m05s", "2h07m": as precise as a person reading a status needs.
std::string Span(int64_t ms) {
  const int64_t s = (ms + 500) / 1000;
  if (s < 60) return absl::StrCat(s, "s");
  if (s < 3600) return absl::StrFormat("%dm%02ds", s / 60, s % 60);
  return absl::StrFormat("%dh%02dm", s / 3600, (s % 3600) / 60);
}

template <typename T>
nlohmann::json OrNull(bool has, T value) {
  return has ? nlohmann::json(value) : nlohmann::json(nullptr);
}

nlohmann::json ProgressToJson(const v1::TrainingProgress& progress) {
  return {
      {"step", progress.step()},
      {"steps", progress.steps()},
      {"loss", OrNull(progress.has_loss(), progress.loss())},
      {"steps_per_second", progress.steps_per_second()},
      {"eta_ms", OrNull(progress.has_eta_ms(), progress.eta_ms())},
      {"last_checkpoint", OrNull(!progress.last_checkpoint().empty(), progress.last_checkpoint())},
      {"last_checkpoint_step", progress.last_checkpoint_step()},
      {"last_checkpoint_age_ms",
       OrNull(progress.has_last_checkpoint_age_ms(), progress.last_checkpoint_age_ms())},
      {"overlap_fraction", progress.overlap_fraction()},
      {"last_snapshot", OrNull(!progress.last_snapshot().empty(), progress.last_snapshot())},
      {"last_snapshot_step", progress.last_snapshot_step()},
      {"last_snapshot_age_ms",
       OrNull(progress.has_last_snapshot_age_ms(), progress.last_snapshot_age_ms())},
      {"last_snapshot_copies", progress.last_snapshot_copies()},
      {"replica_lag_steps", progress.replica_lag_steps()},
      {"replica_lag_ms", OrNull(progress.has_replica_lag_ms(), progress.replica_lag_ms())},
      {"checkpoint_failures", progress.checkpoint_failures()},
      {"last_checkpoint_failure", OrNull(!progress.last_checkpoint_failure().empty(),
                                         progress.last_checkpoint_failure())},
      {"last_checkpoint_failure_age_ms",
       OrNull(progress.has_last_checkpoint_failure_age_ms(),
              progress.last_checkpoint_failure_age_ms())},
      {"checkpoints_skipped", progress.checkpoints_skipped()},
      {"last_checkpoint_skip",
       OrNull(!progress.last_checkpoint_skip().empty(), progress.last_checkpoint_skip())},
  };
}

}  // namespace

std::string RenderTable(const std::vector<std::vector<std::string>>& rows) {
  std::vector<size_t> widths;
  for (const auto& row : rows) {
    widths.resize(std::max(widths.size(), row.size()));
    for (size_t i = 0; i < row.size(); ++i) widths[i] = std::max(widths[i], row[i].size());
  }
  std::string out;
  for (const auto& row : rows) {
    std::string line;
    for (size_t i = 0; i < row.size(); ++i) {
      absl::StrAppend(&line, row[i]);
      if (i + 1 < row.size()) line.append(widths[i] - row[i].size() + 2, ' ');
    }
    absl::StrAppend(&out, line, "\n");
  }
  return out;
}

std::string EnumWord(const std::string& enum_name, const std::string& prefix) {
  std::string word = absl::StartsWith(enum_name, prefix) ? enum_name.substr(prefix.size())
                                                         : enum_name;
  return absl::AsciiStrToLower(word);
}

nlohmann::json StatusToJson(const v1::GetStatusResponse& status) {
  nlohmann::json workers = nlohmann::json::array();
  for (const v1::WorkerStatus& worker : status.workers()) {
    workers.push_back({
        {"id", worker.id()},
        {"rank", worker.rank()},
        {"host", worker.host()},
        {"device", worker.device()},
        {"capabilities", std::vector<std::string>(worker.capabilities().begin(),
                                                  worker.capabilities().end())},
        {"state", WorkerState(worker)},
        {"last_heartbeat_ms_ago", worker.last_heartbeat_ms_ago()},
        {"self_check", SelfCheck(worker)},
        {"self_check_detail", worker.self_check().detail()},
        {"joined_generation", worker.joined_generation()},
        {"unreachable", worker.unreachable()},
    });
  }
  return {
      {"job", status.job()},
      {"generation", status.world().generation()},
      {"world_size", status.world().world_size()},
      {"expected_world_size", status.world().expected_world_size()},
      {"ranks", status.world().ranks()},
      {"min_world_size", status.world().min_world_size()},
      {"standby", status.world().standby()},
      {"transition", status.world().transition()},
      {"state", JobState(status.world())},
      {"lease_ms", status.lease_ms()},
      {"uptime_ms", status.uptime_ms()},
      {"progress", ProgressToJson(status.progress())},
      {"workers", workers},
  };
}

std::string WorkersTable(const v1::GetStatusResponse& status) {
  std::vector<std::vector<std::string>> rows = {
      {"RANK", "WORKER", "HOST", "DEVICE", "STATE", "HEARTBEAT", "SELF-CHECK"}};
  for (const v1::WorkerStatus& worker : status.workers()) {
    std::string check = SelfCheck(worker);
    if (!worker.self_check().detail().empty()) {
      absl::StrAppend(&check, ": ", worker.self_check().detail());
    }
    if (!worker.unreachable().empty()) {
      check = absl::StrCat("isolated (", worker.unreachable(), ")");
    }
    rows.push_back({worker.rank() >= 0 ? absl::StrCat(worker.rank()) : "-", worker.id(),
                    worker.host(), worker.device(), WorkerState(worker),
                    Ago(worker.last_heartbeat_ms_ago()), check});
  }
  if (status.workers().empty()) return "no workers have joined yet\n";
  return RenderTable(rows);
}

std::string WorldLine(const v1::GetStatusResponse& status) {
  const v1::WorldView& world = status.world();
  std::string line = absl::StrFormat(
      "job %s: %s, generation %d, %d/%d ranks held (target %d, min %d)", status.job(),
      JobState(world), world.generation(), world.world_size(), world.ranks(),
      world.expected_world_size(), world.min_world_size());
  if (world.standby() > 0) {
    absl::StrAppend(&line, ", ", world.standby(), world.standby() == 1 ? " standby" : " standbys");
  }
  if (!world.transition().empty()) absl::StrAppend(&line, ": ", world.transition());
  return line;
}

std::string ProgressLines(const v1::GetStatusResponse& status) {
  const v1::TrainingProgress& progress = status.progress();
  if (progress.steps() == 0) return "";  // a world without a job
  std::string training = absl::StrFormat("training: step %d/%d", progress.step(), progress.steps());
  if (progress.has_loss()) {
    absl::StrAppend(&training, absl::StrFormat(", loss %.6g", progress.loss()));
  }
  if (progress.steps_per_second() > 0) {
    absl::StrAppend(&training, absl::StrFormat(", %.3g steps/s", progress.steps_per_second()));
  }
  if (progress.has_eta_ms()) absl::StrAppend(&training, ", ETA ", Span(progress.eta_ms()));
  if (progress.overlap_fraction() > 0) {
    absl::StrAppend(&training, absl::StrFormat(", %.0f%% of communication hidden",
                                               100 * progress.overlap_fraction()));
  }
  std::string saved = "last checkpoint: none yet";
  if (!progress.last_checkpoint().empty()) {
    saved = absl::StrCat("last checkpoint: ", progress.last_checkpoint(), " (step ",
                         progress.last_checkpoint_step(), ")");
    if (progress.has_last_checkpoint_age_ms()) {
      absl::StrAppend(&saved, ", ", Span(progress.last_checkpoint_age_ms()), " ago");
    }
  }
  // Saves since then that did not commit: the disk is full or failing, or behind.
  if (progress.checkpoint_failures() > 0) {
    absl::StrAppend(&saved, "; ", progress.checkpoint_failures(),
                    progress.checkpoint_failures() == 1 ? " save" : " saves",
                    " failed since, the last ");
    if (progress.has_last_checkpoint_failure_age_ms()) {
      absl::StrAppend(&saved, Span(progress.last_checkpoint_failure_age_ms()), " ago");
    }
    absl::StrAppend(&saved, ": ", progress.last_checkpoint_failure());
  }
  if (progress.checkpoints_skipped() > 0) {
    absl::StrAppend(&saved, "; ", progress.checkpoints_skipped(),
                    progress.checkpoints_skipped() == 1 ? " periodic save" : " periodic saves",
                    " skipped since: ", progress.last_checkpoint_skip());
  }
  std::string memory;
  if (!progress.last_snapshot().empty()) {
    memory = absl::StrCat("last snapshot in memory: ", progress.last_snapshot(), " (step ",
                          progress.last_snapshot_step(), ")");
    if (progress.has_last_snapshot_age_ms()) {
      absl::StrAppend(&memory, ", ", Span(progress.last_snapshot_age_ms()), " ago");
    }
    absl::StrAppend(&memory, ", ", progress.last_snapshot_copies(),
                    progress.last_snapshot_copies() == 1 ? " copy" : " copies",
                    " of its least-kept shard");
    if (progress.replica_lag_steps() > 0) {
      absl::StrAppend(&memory, "; the newest is ", progress.replica_lag_steps(),
                      " steps ahead of its replicas");
      if (progress.has_replica_lag_ms()) {
        absl::StrAppend(&memory, " (", Span(progress.replica_lag_ms()), ")");
      }
    }
    absl::StrAppend(&memory, "\n");
  }
  return absl::StrCat(training, "\n", saved, "\n", memory);
}

std::string StatusTable(const v1::GetStatusResponse& status) {
  return absl::StrCat(
      WorldLine(status), "\n", ProgressLines(status),
      absl::StrFormat("lease %dms, up %.1fs\n", status.lease_ms(), status.uptime_ms() / 1000.0),
      WorkersTable(status));
}

}  // namespace shard
