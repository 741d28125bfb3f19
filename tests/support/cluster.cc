#include "tests/support/cluster.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"

namespace shard::testing {

absl::Status LocalCluster::StartCoordinator(const std::vector<std::string>& args, int port,
                                            const std::string& log_name,
                                            const std::vector<std::string>& env,
                                            const std::string& host) {
  const std::string port_file = absl::StrCat(dir_, "/", log_name, ".port");
  std::filesystem::remove(port_file);
  std::vector<std::string> argv = {BinaryPath("shard-coordinator"), "--listen",
                                   absl::StrCat(host, ":", port), "--port-file", port_file};
  argv.insert(argv.end(), args.begin(), args.end());
  absl::StatusOr<Process> process = Process::Start(argv, absl::StrCat(dir_, "/", log_name), env);
  if (!process.ok()) return process.status();
  coordinator_.emplace(std::move(*process));
  int bound = 0;
  const bool serving = Eventually(
      [&] {
        std::ifstream in(port_file);
        std::string text;
        return std::getline(in, text) && absl::SimpleAtoi(text, &bound) && bound > 0;
      },
      absl::Seconds(15));
  if (!serving) {
    return absl::DeadlineExceededError(
        absl::StrCat("the coordinator did not start serving:\n", coordinator_->Log()));
  }
  port_ = bound;
  address_ = absl::StrCat("127.0.0.1:", bound);
  return absl::OkStatus();
}

Process LocalCluster::StartWorker(const std::string& id, const std::vector<std::string>& extra,
                                  const std::vector<std::string>& env) {
  std::vector<std::string> argv = {BinaryPath("shard-worker"), "--coordinator", address_, "--id",
                                   id, "--collective-timeout", "10s"};
  argv.insert(argv.end(), extra.begin(), extra.end());
  absl::StatusOr<Process> process = Process::Start(argv, absl::StrCat(dir_, "/", id, ".log"), env);
  EXPECT_TRUE(process.ok()) << process.status();
  if (process.ok()) worker_pids_.push_back(process->pid());
  return std::move(*process);
}

std::vector<std::string> LocalCluster::WorkerSegmentsLeft() const {
  std::vector<std::string> left;
  if (!std::filesystem::exists("/dev/shm")) return left;
  for (const auto& entry : std::filesystem::directory_iterator("/dev/shm")) {
    // shard-<pid namespace>-<pid>-<nonce> (worker/dataplane/shm_communicator.cc)
    const std::vector<std::string> parts = absl::StrSplit(entry.path().filename().string(), '-');
    pid_t pid = 0;
    if (parts.size() == 4 && parts[0] == "shard" && absl::SimpleAtoi(parts[2], &pid) &&
        std::find(worker_pids_.begin(), worker_pids_.end(), pid) != worker_pids_.end()) {
      left.push_back(entry.path().string());
    }
  }
  return left;
}

CommandResult LocalCluster::Shardctl(const std::vector<std::string>& args,
                                     absl::Duration timeout) {
  std::vector<std::string> argv = {BinaryPath("shardctl"), "--coordinator", address_};
  argv.insert(argv.end(), args.begin(), args.end());
  return RunCommand(argv, timeout);
}

nlohmann::json LocalCluster::Status() {
  CommandResult result = Shardctl({"status", "--json"}, absl::Seconds(10));
  if (result.exit_code != 0) return nullptr;
  return nlohmann::json::parse(result.output, nullptr, /*allow_exceptions=*/false);
}

std::vector<nlohmann::json> LocalCluster::Checkpoints() {
  CommandResult result = Shardctl({"checkpoint", "list", "--json"}, absl::Seconds(10));
  if (result.exit_code != 0) return {};
  nlohmann::json listed = nlohmann::json::parse(result.output, nullptr, false);
  if (!listed.is_array()) return {};
  return listed.get<std::vector<nlohmann::json>>();
}

void LocalCluster::FollowEvents() {
  absl::StatusOr<Process> follower = Process::Start(
      {BinaryPath("shardctl"), "--coordinator", address_, "events", "--follow", "--json"},
      absl::StrCat(dir_, "/events-", event_followers_.size(), ".jsonl"));
  EXPECT_TRUE(follower.ok()) << follower.status();
  if (follower.ok()) event_followers_.push_back(std::move(*follower));
}

std::vector<nlohmann::json> LocalCluster::Events() {
  const bool coordinator_gone = !coordinator_.has_value() || coordinator_->Exited();
  std::map<int64_t, nlohmann::json> by_sequence;
  for (Process& follower : event_followers_) {
    // The last follower's coordinator may still run: read what it has printed so far.
    if (coordinator_gone || &follower != &event_followers_.back()) {
      EXPECT_TRUE(follower.Wait(absl::Seconds(30)).has_value()) << follower.Log();
    }
    for (absl::string_view line : absl::StrSplit(follower.Log(), '\n')) {
      // Lines other than events (the follower's farewell on stderr) are not JSON objects.
      nlohmann::json event = nlohmann::json::parse(line, nullptr, false);
      if (event.is_object() && event.contains("sequence")) {
        const int64_t sequence = event["sequence"].get<int64_t>();
        by_sequence[sequence] = std::move(event);
      }
    }
  }
  std::vector<nlohmann::json> events;
  for (auto& [sequence, event] : by_sequence) events.push_back(std::move(event));
  return events;
}

bool LocalCluster::HasEvent(absl::string_view text) {
  for (const nlohmann::json& event : Events()) {
    const std::string line =
        absl::StrCat(event.value("kind", ""), ": ", event.value("detail", ""));
    if (absl::StrContains(line, text)) return true;
  }
  return false;
}

int FreePort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = 0;
  socklen_t length = sizeof(address);
  int port = 0;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) == 0) {
    port = ntohs(address.sin_port);
  }
  ::close(fd);
  return port;
}

std::optional<absl::Time> LineTime(absl::string_view line) {
  absl::Time time;
  std::string error;
  if (line.size() < 23 || !absl::ParseTime("%Y-%m-%dT%H:%M:%E3S", line.substr(0, 23),
                                           absl::LocalTimeZone(), &time, &error)) {
    return std::nullopt;
  }
  return time;
}

std::optional<absl::Time> FirstLineAfter(const std::string& log, absl::Time after,
                                         absl::string_view text) {
  for (absl::string_view line : absl::StrSplit(log, '\n')) {
    std::optional<absl::Time> time = LineTime(line);
    // Log times have millisecond resolution.
    if (time.has_value() && *time >= after - absl::Milliseconds(1) &&
        line.find(text) != absl::string_view::npos) {
      return time;
    }
  }
  return std::nullopt;
}

std::vector<std::string> Restores(const std::string& log) {
  std::vector<std::string> ids;
  constexpr absl::string_view kMarker = "restoring from checkpoint ";
  for (absl::string_view line : absl::StrSplit(log, '\n')) {
    const size_t at = line.find(kMarker);
    if (at == absl::string_view::npos) continue;
    absl::string_view rest = line.substr(at + kMarker.size());
    ids.emplace_back(rest.substr(0, rest.find(' ')));
  }
  return ids;
}

}  // namespace shard::testing
