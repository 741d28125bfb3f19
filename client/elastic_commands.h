// `shardctl resize`, `shardctl drain` and `shardctl events`: changing a running job's world and
// reading its membership history.
#pragma once

#include <string>

#include "CLI/CLI.hpp"
#include "client/admin_client.h"

namespace shard {

struct ElasticCommands {
  CLI::App* resize = nullptr;
  CLI::App* drain = nullptr;
  CLI::App* events = nullptr;

  int world_size = 0;
  std::string worker_id;
  bool no_wait = false;
  std::string wait_timeout = "600s";
  bool follow = false;
  bool json = false;
  int64_t after = 0;
};

void AddElasticCommands(CLI::App& app, ElasticCommands* commands);
bool ElasticCommandParsed(const ElasticCommands& commands);
int RunElasticCommand(const ElasticCommands& commands, AdminClient& admin);

}  // namespace shard
