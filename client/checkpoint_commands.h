// `shardctl checkpoint save|list|show|verify|restore|export|delete`.
#pragma once

#include <string>

#include "CLI/CLI.hpp"
#include "client/admin_client.h"

namespace shard {

struct CheckpointCommands {
  CLI::App* save = nullptr;
  CLI::App* list = nullptr;
  CLI::App* show = nullptr;
  CLI::App* verify = nullptr;
  CLI::App* restore = nullptr;
  CLI::App* exporter = nullptr;
  CLI::App* remove = nullptr;

  std::string id;
  bool json = false;
  bool no_wait = false;
  std::string wait_timeout = "600s";
  std::string path;  // a checkpoint directory, read without asking the coordinator
  std::string out;
  bool with_state = false;
  double buffer_mb = 64;
};

// Adds `checkpoint` and its subcommands to `app`.
void AddCheckpointCommands(CLI::App& app, CheckpointCommands* commands);
// True if one of them was parsed.
bool CheckpointCommandParsed(const CheckpointCommands& commands);
// Runs the parsed one; `admin` is made on demand (verify and export with --path need none).
int RunCheckpointCommand(const CheckpointCommands& commands,
                         const std::function<AdminClient&()>& admin);

}  // namespace shard
