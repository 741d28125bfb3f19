#include "client/elastic_commands.h"

#include <iostream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/time.h"
#include "client/status_view.h"
#include "common/cli.h"
#include "nlohmann/json.hpp"
#include "proto/control_convert.h"

namespace shard {
namespace {

int Fail(const absl::Status& status) {
  std::cerr << "shardctl: " << status.message() << "\n";
  return 1;
}

bool CoordinatorGone(const absl::Status& status) {
  return absl::IsUnavailable(status) || absl::IsCancelled(status);
}

// Polls the status, printing each new transition, until `done` holds.
int WaitForWorld(AdminClient& admin, const std::string& wait_timeout,
                 const std::function<bool(const v1::GetStatusResponse&)>& done) {
  const absl::Duration timeout = ParsedDuration(wait_timeout);
  const absl::Time give_up = absl::Now() + timeout;
  std::string last;
  while (true) {
    absl::StatusOr<v1::GetStatusResponse> status = admin.GetStatus();
    if (!status.ok()) return Fail(status.status());
    const std::string line = WorldLine(*status);
    if (line != last) std::cout << line << "\n" << std::flush;
    last = line;
    if (done(*status)) return 0;
    const v1::JobState state = status->world().state();
    if (Stops(FromProto(state))) {
      return Fail(absl::FailedPreconditionError("the job is stopping"));
    }
    if (absl::Now() >= give_up) {
      return Fail(absl::DeadlineExceededError(absl::StrCat(
          "not done within ", wait_timeout, " (", line,
          "); the change goes on: 'shardctl status' and 'shardctl events' show it")));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
}

bool Settled(const v1::GetStatusResponse& status) {
  const v1::WorldView& world = status.world();
  return world.state() == v1::JOB_STATE_RUNNING && world.transition().empty() &&
         world.ranks() == world.expected_world_size();
}

int Resize(const ElasticCommands& c, AdminClient& admin) {
  absl::StatusOr<v1::ResizeResponse> resized = admin.Resize(c.world_size);
  if (!resized.ok()) return Fail(resized.status());
  std::cout << "resize to " << c.world_size << " workers accepted (the world has "
            << resized->world().ranks() << ")\n";
  if (c.no_wait) return 0;
  return WaitForWorld(admin, c.wait_timeout, [&](const v1::GetStatusResponse& status) {
    return Settled(status) && status.world().ranks() == c.world_size;
  });
}

int Drain(const ElasticCommands& c, AdminClient& admin) {
  absl::StatusOr<v1::DrainResponse> drained = admin.Drain(c.worker_id);
  if (!drained.ok()) return Fail(drained.status());
  std::cout << "drain of " << c.worker_id << " accepted\n";
  if (c.no_wait) return 0;
  return WaitForWorld(admin, c.wait_timeout, [&](const v1::GetStatusResponse& status) {
    for (const v1::WorkerStatus& worker : status.workers()) {
      if (worker.id() == c.worker_id && (worker.rank() >= 0 ||
                                         worker.state() == v1::WORKER_STATE_LEAVING)) {
        return false;
      }
    }
    return status.world().state() == v1::JOB_STATE_RUNNING && status.world().transition().empty();
  });
}

void PrintEvent(const v1::Event& event, bool json) {
  if (json) {
    std::cout << nlohmann::json{{"sequence", event.sequence()},
                                {"unix_ms", event.unix_ms()},
                                {"generation", event.generation()},
                                {"kind", event.kind()},
                                {"worker_id", event.worker_id()},
                                {"rank", event.rank()},
                                {"detail", event.detail()}}
                     .dump()
              << "\n"
              << std::flush;  // a follower's reader (a pipe, a file) sees each event at once
    return;
  }
  const std::string when =
      absl::FormatTime("%Y-%m-%d %H:%M:%E3S", absl::FromUnixMillis(event.unix_ms()),
                       absl::LocalTimeZone());
  std::string who;
  if (!event.worker_id().empty()) {
    who = event.rank() >= 0 ? absl::StrCat(event.worker_id(), " (rank ", event.rank(), ")")
                            : event.worker_id();
  }
  std::cout << absl::StrFormat("%4d  %s  gen %-4d  %-21s %s%s%s\n", event.sequence(), when,
                               event.generation(), event.kind(), who,
                               who.empty() || event.detail().empty() ? "" : ": ", event.detail())
            << std::flush;
}

int Events(const ElasticCommands& c, AdminClient& admin) {
  int64_t after = c.after;
  // A follower asks again as soon as it is answered; the coordinator holds each call until
  // there is news (or half a minute).
  const absl::Duration wait = c.follow ? absl::Seconds(30) : absl::ZeroDuration();
  while (true) {
    absl::StatusOr<v1::ListEventsResponse> events = admin.ListEvents(after, wait);
    if (!events.ok()) {
      if (c.follow && CoordinatorGone(events.status()) && after > c.after) {
        // Not on stdout: with --json every line there is an event.
        std::cerr << "the coordinator has exited\n";
        return 0;
      }
      return Fail(events.status());
    }
    for (const v1::Event& event : events->events()) {
      PrintEvent(event, c.json);
      after = std::max(after, event.sequence());
    }
    if (!c.follow) return 0;
  }
}

}  // namespace

void AddElasticCommands(CLI::App& app, ElasticCommands* c) {
  c->resize = app.add_subcommand(
      "resize",
      "change the job's world size: in a running world the workers checkpoint at the next step "
      "boundary, the highest ranks leave (or standbys are folded in) and training continues from "
      "that checkpoint, losing no step; a world still forming takes the new size at once (and "
      "starts if its workers fill it); waits until the world has the new size");
  c->resize->add_option("--world-size", c->world_size,
                        "the new world size (the job's min_world_size..world_size, dividing its "
                        "global batch)")
      ->required()
      ->check(CLI::Range(1, 1 << 20));
  c->drain = app.add_subcommand(
      "drain",
      "take one worker out of the running job the same way (checkpoint, leave, re-form); waits "
      "until it has left");
  c->drain->add_option("worker", c->worker_id, "the worker's id ('shardctl workers')")->required();
  for (CLI::App* command : {c->resize, c->drain}) {
    command->add_flag("--no-wait", c->no_wait, "return once the change is accepted");
    command->add_option("--wait-timeout", c->wait_timeout, "give up waiting after this long")
        ->capture_default_str()
        ->check(DurationValidator());
  }
  c->events = app.add_subcommand(
      "events", "the job's membership and generation history (joins, deaths, re-formations)");
  c->events->add_flag("--follow,-f", c->follow, "keep printing events as they happen");
  c->events->add_option("--after", c->after, "only events after this sequence number");
  c->events->add_flag("--json", c->json, "one JSON object per line");
}

bool ElasticCommandParsed(const ElasticCommands& c) {
  return c.resize->parsed() || c.drain->parsed() || c.events->parsed();
}

int RunElasticCommand(const ElasticCommands& c, AdminClient& admin) {
  if (c.resize->parsed()) return Resize(c, admin);
  if (c.drain->parsed()) return Drain(c, admin);
  return Events(c, admin);
}

}  // namespace shard
