#include "client/checkpoint_commands.h"

#include <iostream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/progress.h"
#include "client/status_view.h"
#include "common/checkpoint.h"
#include "common/cli.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"
#include "proto/control_convert.h"

namespace shard {
namespace {

int Fail(const absl::Status& status) {
  std::cerr << "shardctl: " << status.message() << "\n";
  return 1;
}

std::string Size(uint64_t bytes) {
  if (bytes >= (uint64_t{1} << 30)) return absl::StrFormat("%.2f GiB", bytes / 1073741824.0);
  if (bytes >= (uint64_t{1} << 20)) return absl::StrFormat("%.1f MiB", bytes / 1048576.0);
  return absl::StrFormat("%.1f KiB", bytes / 1024.0);
}

nlohmann::json InfoToJson(const v1::CheckpointInfo& info) {
  nlohmann::json out = {{"id", info.id()},
                        {"step", info.step()},
                        {"world_size", info.world_size()},
                        {"dir", info.dir()},
                        {"bytes", info.bytes()},
                        {"committed_unix_ms", info.committed_unix_ms()},
                        {"max_pause_ms", info.max_pause_ms()},
                        {"max_write_ms", info.max_write_ms()}};
  if (info.shards_size() > 0) {
    out["tensors"] = info.tensors();
    out["zero_stage"] = info.zero_stage();
    out["optimizer"] = info.optimizer();
    nlohmann::json shards = nlohmann::json::array();
    for (const v1::ShardRecord& shard : info.shards()) {
      shards.push_back({{"file", shard.file()},
                        {"rank", shard.rank()},
                        {"bytes", shard.bytes()},
                        {"xxh3", shard.xxh3()}});
    }
    out["shards"] = shards;
  }
  return out;
}

// The checkpoint's directory: --path, or the coordinator's catalog.
absl::StatusOr<std::string> Directory(const CheckpointCommands& c,
                                      const std::function<AdminClient&()>& admin) {
  if (!c.path.empty()) return c.path;
  SHARD_ASSIGN_OR_RETURN(v1::CheckpointInfo info, admin().GetCheckpoint(c.id));
  return info.dir();
}

int Save(const CheckpointCommands& c, AdminClient& admin) {
  absl::StatusOr<v1::SaveCheckpointResponse> requested = admin.SaveCheckpoint();
  if (!requested.ok()) return Fail(requested.status());
  std::cout << "checkpoint requested (request " << requested->request()
            << "); workers save at their next step boundary\n";
  if (c.no_wait) return 0;
  const absl::Time give_up = absl::Now() + ParsedDuration(c.wait_timeout);
  std::unique_ptr<ProgressBar> bar;
  while (absl::Now() < give_up) {
    absl::StatusOr<v1::GetSaveProgressResponse> progress =
        admin.GetSaveProgress(requested->request());
    if (!progress.ok()) return Fail(progress.status());
    if (!progress->error().empty()) {
      return Fail(absl::DataLossError(absl::StrCat("the save failed: ", progress->error())));
    }
    if (progress->world_size() > 0) {
      if (bar == nullptr) bar = std::make_unique<ProgressBar>("saving", progress->world_size(), "shards");
      bar->Update(progress->shards_done());
    }
    if (!progress->checkpoint_id().empty()) {
      if (bar != nullptr) bar->Finish();
      std::cout << "checkpoint " << progress->checkpoint_id() << " committed ("
                << Size(progress->bytes_done()) << ")\n";
      return 0;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return Fail(absl::DeadlineExceededError(
      absl::StrCat("no checkpoint committed within ", c.wait_timeout,
                   "; is the job training? ('shardctl stats' shows its steps)")));
}

int List(const CheckpointCommands& c, AdminClient& admin) {
  absl::StatusOr<v1::ListCheckpointsResponse> list = admin.ListCheckpoints();
  if (!list.ok()) return Fail(list.status());
  if (c.json) {
    nlohmann::json out = nlohmann::json::array();
    for (const v1::CheckpointInfo& info : list->checkpoints()) out.push_back(InfoToJson(info));
    std::cout << out.dump(2) << "\n";
    return 0;
  }
  if (list->checkpoints().empty()) {
    std::cout << "no committed checkpoints in " << list->root() << "\n";
    return 0;
  }
  std::vector<std::vector<std::string>> rows = {
      {"ID", "STEP", "WORLD", "SIZE", "PAUSE", "WRITE", "DIR"}};
  for (const v1::CheckpointInfo& info : list->checkpoints()) {
    rows.push_back({info.id(), absl::StrCat(info.step()), absl::StrCat(info.world_size()),
                    Size(info.bytes()), absl::StrFormat("%.2f ms", info.max_pause_ms()),
                    absl::StrFormat("%.1f ms", info.max_write_ms()), info.dir()});
  }
  std::cout << RenderTable(rows);
  return 0;
}

int Show(const CheckpointCommands& c, AdminClient& admin) {
  absl::StatusOr<v1::CheckpointInfo> info = admin.GetCheckpoint(c.id);
  if (!info.ok()) return Fail(info.status());
  if (c.json) {
    std::cout << InfoToJson(*info).dump(2) << "\n";
    return 0;
  }
  std::cout << absl::StrFormat(
      "checkpoint %s: step %d, %d ranks, ZeRO stage %d, %s state, %d tensors, %s in %s\n",
      info->id(), info->step(), info->world_size(), info->zero_stage(), info->optimizer(),
      info->tensors(), Size(info->bytes()), info->dir());
  std::vector<std::vector<std::string>> rows = {{"RANK", "FILE", "SIZE", "XXH3"}};
  for (const v1::ShardRecord& shard : info->shards()) {
    rows.push_back({absl::StrCat(shard.rank()), shard.file(), Size(shard.bytes()), shard.xxh3()});
  }
  std::cout << RenderTable(rows);
  return 0;
}

int Verify(const CheckpointCommands& c, const std::function<AdminClient&()>& admin) {
  absl::StatusOr<std::string> dir = Directory(c, admin);
  if (!dir.ok()) return Fail(dir.status());
  absl::StatusOr<std::unique_ptr<CheckpointReader>> reader = CheckpointReader::Open(*dir);
  if (!reader.ok()) return Fail(reader.status());
  const CheckpointManifest& m = (*reader)->manifest();
  ProgressBar bar(absl::StrCat("verifying ", m.id), m.total_bytes());
  uint64_t done = 0;
  nlohmann::json shards = nlohmann::json::array();
  bool all_ok = true;
  for (size_t s = 0; s < m.shards.size(); ++s) {
    const absl::Status verified = (*reader)->VerifyShard(static_cast<int>(s), [&](uint64_t bytes) {
      done += bytes;
      if (!c.json) bar.Update(done);
    });
    all_ok = all_ok && verified.ok();
    shards.push_back({{"file", m.shards[s].file},
                      {"rank", m.shards[s].rank},
                      {"bytes", m.shards[s].bytes},
                      {"ok", verified.ok()},
                      {"error", std::string(verified.message())}});
  }
  if (c.json) {
    std::cout << nlohmann::json{{"id", m.id}, {"dir", *dir}, {"ok", all_ok}, {"shards", shards}}
                     .dump(2)
              << "\n";
  } else {
    if (all_ok) bar.Finish();
    else std::cout << "\n";
    for (const nlohmann::json& shard : shards) {
      std::cout << "  " << shard["file"].get<std::string>() << " (rank " << shard["rank"] << ", "
                << Size(shard["bytes"].get<uint64_t>()) << "): "
                << (shard["ok"].get<bool>() ? "ok" : shard["error"].get<std::string>()) << "\n";
    }
    std::cout << "checkpoint " << m.id << (all_ok ? " verified\n" : " is damaged\n");
  }
  return all_ok ? 0 : 1;
}

int Restore(const CheckpointCommands& c, AdminClient& admin) {
  absl::StatusOr<v1::RestoreCheckpointResponse> restored = admin.RestoreCheckpoint(c.id);
  if (!restored.ok()) return Fail(restored.status());
  const v1::TrainingStart& start = restored->start();
  std::cout << "training restarts from checkpoint " << start.checkpoint_id() << " (step "
            << start.step() << ") at generation " << restored->generation() << "\n";
  if (c.no_wait) return 0;
  const absl::Time give_up = absl::Now() + ParsedDuration(c.wait_timeout);
  std::unique_ptr<ProgressBar> bar;
  while (absl::Now() < give_up) {
    absl::StatusOr<v1::GetStatusResponse> status = admin.GetStatus();
    if (!status.ok()) return Fail(status.status());
    const v1::WorldView& world = status->world();
    if (Stops(FromProto(world.state()))) {
      std::cout << "\nthe job finished\n";
      return 0;
    }
    // The world that trains from the checkpoint: the one running at the restore's generation or
    // later, with as many ranks as it has (fewer than the target while workers are missing).
    if (Trains(FromProto(world.state())) && world.generation() >= restored->generation()) {
      absl::StatusOr<v1::GetStatsResponse> stats = admin.GetStats();
      if (!stats.ok()) return Fail(stats.status());
      if (bar == nullptr)
        bar = std::make_unique<ProgressBar>("restoring", world.ranks(), "workers");
      // A worker has restored once it reports a step after the checkpoint's.
      int restored_ranks = 0;
      for (const v1::RankStats& rank : stats->ranks()) {
        if (rank.has_last() && rank.last().step() > start.step()) ++restored_ranks;
      }
      bar->Update(restored_ranks);
      if (restored_ranks >= world.ranks()) {
        bar->Finish();
        return 0;
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return Fail(absl::DeadlineExceededError(
      absl::StrCat("the workers did not resume within ", c.wait_timeout)));
}

int Export(const CheckpointCommands& c, const std::function<AdminClient&()>& admin) {
  absl::StatusOr<std::string> dir = Directory(c, admin);
  if (!dir.ok()) return Fail(dir.status());
  std::unique_ptr<ProgressBar> bar;
  const absl::Status exported = ExportCheckpoint(
      *dir, c.out, c.with_state, static_cast<uint64_t>(MebibytesToBytes(c.buffer_mb)),
      [&](uint64_t done, uint64_t total) {
        if (bar == nullptr) bar = std::make_unique<ProgressBar>("exporting", total);
        bar->Update(done);
      });
  if (!exported.ok()) return Fail(exported);
  if (bar != nullptr) bar->Finish();
  std::cout << "wrote " << c.out << (c.with_state ? " with optimizer state\n" : "\n");
  return 0;
}

}  // namespace

void AddCheckpointCommands(CLI::App& app, CheckpointCommands* c) {
  CLI::App* checkpoint = app.add_subcommand("checkpoint", "the job's checkpoints");
  checkpoint->require_subcommand(1);
  c->save = checkpoint->add_subcommand(
      "save", "ask every worker to save at its next step boundary and wait for the commit");
  c->save->add_flag("--no-wait", c->no_wait, "return once the request is accepted");
  c->save->add_option("--wait-timeout", c->wait_timeout, "give up waiting after this long")
      ->capture_default_str()
      ->check(DurationValidator());
  c->list = checkpoint->add_subcommand("list", "committed checkpoints, oldest first");
  c->list->add_flag("--json", c->json, "print JSON for scripts");
  c->show = checkpoint->add_subcommand("show", "one checkpoint and its shards");
  c->show->add_option("id", c->id, "checkpoint id or 'latest'")->required();
  c->show->add_flag("--json", c->json, "print JSON for scripts");
  c->verify = checkpoint->add_subcommand(
      "verify", "re-read every shard and check sizes and checksums, per shard");
  c->verify->add_option("id", c->id, "checkpoint id or 'latest'");
  c->verify->add_option("--path", c->path,
                        "the checkpoint's directory, read without asking the coordinator");
  c->verify->add_flag("--json", c->json, "print JSON for scripts");
  c->restore = checkpoint->add_subcommand(
      "restore", "restart the running job's training from a checkpoint and wait for it");
  c->restore->add_option("id", c->id, "checkpoint id or 'latest'")->required();
  c->restore->add_flag("--no-wait", c->no_wait, "return once the restore is accepted");
  c->restore->add_option("--wait-timeout", c->wait_timeout, "give up waiting after this long")
      ->capture_default_str()
      ->check(DurationValidator());
  c->exporter = checkpoint->add_subcommand(
      "export",
      "write one safetensors file of full tensors (and <name>.exp_avg, ... with "
      "--with-optimizer-state), streamed through a bounded buffer");
  c->exporter->add_option("id", c->id, "checkpoint id or 'latest'");
  c->exporter->add_option("--out", c->out, "output .safetensors file")->required();
  c->exporter->add_flag("--with-optimizer-state", c->with_state,
                        "also export exp_avg/exp_avg_sq (Adam) or momentum_buffer (SGD)");
  c->exporter->add_option("--buffer-mb", c->buffer_mb, "export buffer in MiB (bounds memory)")
      ->capture_default_str()
      ->check(shard::MebibytesValidator());
  c->exporter->add_option("--path", c->path,
                          "the checkpoint's directory, read without asking the coordinator");
  c->remove = checkpoint->add_subcommand("delete", "delete a committed checkpoint");
  c->remove->add_option("id", c->id, "checkpoint id")->required();
}

bool CheckpointCommandParsed(const CheckpointCommands& c) {
  for (CLI::App* command : {c.save, c.list, c.show, c.verify, c.restore, c.exporter, c.remove}) {
    if (command != nullptr && command->parsed()) return true;
  }
  return false;
}

int RunCheckpointCommand(const CheckpointCommands& c, const std::function<AdminClient&()>& admin) {
  if ((c.verify->parsed() || c.exporter->parsed()) && c.id.empty() == c.path.empty()) {
    std::cerr << "shardctl: give a checkpoint id or --path DIR\n";
    return 2;
  }
  if (c.save->parsed()) return Save(c, admin());
  if (c.list->parsed()) return List(c, admin());
  if (c.show->parsed()) return Show(c, admin());
  if (c.verify->parsed()) return Verify(c, admin);
  if (c.restore->parsed()) return Restore(c, admin());
  if (c.exporter->parsed()) return Export(c, admin);
  absl::Status deleted = admin().DeleteCheckpoint(c.id);
  if (!deleted.ok()) return Fail(deleted);
  std::cout << "deleted checkpoint " << c.id << "\n";
  return 0;
}

}  // namespace shard
