// shard-net-impair: the stand-in for `tc qdisc ... netem delay D loss P` on kernels built
// without sch_netem (CONFIG_NET_SCH_NETEM unset, as on the project's VM). It holds the packets
// an iptables NFQUEUE rule hands it and gives each back to the kernel (NF_ACCEPT) `--delay`
// after it arrived, dropping a `--loss` fraction of them (NF_DROP), so a link gets netem's
// latency and loss while the sockets on it see nothing unusual. scripts/fault-hosts.sh starts
// one per test host, inside the host's network namespace, for the packets the host sends:
//
//   iptables -A SHARD-IMPAIR -o eth0 -j NFQUEUE --queue-num 0     (in the host's namespace)
//   shard-net-impair --queue 0 --delay 20ms --loss 0.05
//
// so a packet between two hosts is delayed once (by its sender) and a round trip twice:
// 20 ms each way is a 40 ms ping, as with netem on every host's interface.
//
// Packets leave in the order they came (a constant delay, or `--jitter` that never reorders,
// like netem's jitter with a rate), so TCP sees latency and loss but no reordering. Only the
// packets' metadata crosses into this process (NFQNL_COPY_META): it never reads or changes
// their contents. On SIGTERM or SIGINT it gives every held packet back at once, undelayed
// (remove the NFQUEUE rule first, then stop it, and no packet is lost), and prints its
// counters; SIGUSR1 prints them without stopping. It exits 1 with a message if the queue
// cannot be bound (not root in the namespace, another process holds the queue number).
#include <arpa/inet.h>
#include <errno.h>
#include <linux/netfilter.h>
#include <poll.h>
#include <signal.h>
#include <time.h>
extern "C" {
#include <libnetfilter_queue/libnetfilter_queue.h>
}

#include <algorithm>
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <random>
#include <string>

#include "CLI/CLI.hpp"
#include "absl/time/time.h"
#include "common/cli.h"

namespace {

volatile sig_atomic_t g_stop = 0;
volatile sig_atomic_t g_report = 0;

void OnStop(int) { g_stop = 1; }
void OnReport(int) { g_report = 1; }

int64_t NowNs() {
  timespec now;
  clock_gettime(CLOCK_MONOTONIC, &now);
  return int64_t{now.tv_sec} * 1'000'000'000 + now.tv_nsec;
}

struct Held {
  int64_t due_ns;
  uint32_t id;
};

struct Counters {
  uint64_t packets = 0;   // handed to us by the kernel
  uint64_t dropped = 0;   // NF_DROP (the --loss draw)
  uint64_t accepted = 0;  // NF_ACCEPT after the delay
  uint64_t flushed = 0;   // NF_ACCEPT undelayed, at exit
  uint64_t overruns = 0;  // ENOBUFS: the kernel dropped packets it could not hand over
  size_t max_held = 0;
};

// The state the libnetfilter_queue callback works on.
struct Impairer {
  nfq_q_handle* queue = nullptr;
  int64_t delay_ns = 0;
  int64_t jitter_ns = 0;
  double loss = 0;
  std::mt19937_64 random;
  std::uniform_real_distribution<double> unit{0.0, 1.0};
  std::deque<Held> held;
  int64_t last_due_ns = 0;
  Counters counters;
};

int OnPacket(nfq_q_handle* queue, nfgenmsg*, nfq_data* packet, void* data) {
  auto* impairer = static_cast<Impairer*>(data);
  const nfqnl_msg_packet_hdr* header = nfq_get_msg_packet_hdr(packet);
  if (header == nullptr) return 0;
  const uint32_t id = ntohl(header->packet_id);
  ++impairer->counters.packets;
  if (impairer->loss > 0 && impairer->unit(impairer->random) < impairer->loss) {
    ++impairer->counters.dropped;
    return nfq_set_verdict(queue, id, NF_DROP, 0, nullptr);
  }
  int64_t due = NowNs() + impairer->delay_ns;
  if (impairer->jitter_ns > 0) {
    due += static_cast<int64_t>((2 * impairer->unit(impairer->random) - 1) *
                                static_cast<double>(impairer->jitter_ns));
  }
  // Never before the packet ahead of it: the link keeps its order.
  due = std::max(due, impairer->last_due_ns);
  impairer->last_due_ns = due;
  impairer->held.push_back({due, id});
  impairer->counters.max_held = std::max(impairer->counters.max_held, impairer->held.size());
  return 0;
}

void Report(const Counters& c, uint16_t queue_number) {
  std::printf("shard-net-impair queue %u: %" PRIu64 " packets, %" PRIu64 " dropped, %" PRIu64
              " delayed, %" PRIu64 " let through at exit, %" PRIu64
              " overruns, at most %zu held at once\n",
              queue_number, c.packets, c.dropped, c.accepted, c.flushed, c.overruns, c.max_held);
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "shard-net-impair: delays (and drops a fraction of) the packets an iptables NFQUEUE rule "
      "queues, the stand-in for tc netem where the kernel lacks it (scripts/fault-hosts.sh "
      "impair, docs/faults.md). Run it as root in the network namespace of the rule."};
  int queue_number = 0;
  std::string delay = "20ms";
  std::string jitter = "0s";
  double loss = 0;
  uint64_t seed = 1;
  uint32_t max_held = 65536;
  app.add_option("--queue", queue_number, "NFQUEUE number to take packets from")
      ->capture_default_str()
      ->check(CLI::Range(0, 65535));
  app.add_option("--delay", delay, "how long each packet is held (e.g. 20ms; 0s: none)")
      ->capture_default_str();
  app.add_option("--jitter", jitter,
                 "each delay varies uniformly by up to this much, never reordering packets")
      ->capture_default_str();
  app.add_option("--loss", loss, "fraction of the packets dropped, 0 to 1 (0.05 is 5%)")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 1.0));
  app.add_option("--seed", seed, "seed of the loss and jitter draws")->capture_default_str();
  app.add_option("--max-held", max_held,
                 "packets the kernel queues for us at most (beyond: it drops them)")
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);

  absl::Duration parsed_delay, parsed_jitter;
  if (!absl::ParseDuration(delay, &parsed_delay) || parsed_delay < absl::ZeroDuration() ||
      !absl::ParseDuration(jitter, &parsed_jitter) || parsed_jitter < absl::ZeroDuration()) {
    std::fprintf(stderr, "shard-net-impair: --delay and --jitter take durations such as 20ms\n");
    return 2;
  }

  Impairer impairer;
  impairer.delay_ns = absl::ToInt64Nanoseconds(parsed_delay);
  impairer.jitter_ns = std::min(absl::ToInt64Nanoseconds(parsed_jitter), impairer.delay_ns);
  impairer.loss = loss;
  impairer.random.seed(seed);

  nfq_handle* handle = nfq_open();
  if (handle == nullptr) {
    std::fprintf(stderr, "shard-net-impair: nfq_open failed: %s (root in this namespace?)\n",
                 std::strerror(errno));
    return 1;
  }
  impairer.queue = nfq_create_queue(handle, static_cast<uint16_t>(queue_number), &OnPacket,
                                    &impairer);
  if (impairer.queue == nullptr) {
    std::fprintf(stderr,
                 "shard-net-impair: cannot bind NFQUEUE %d: %s (another process holds it, or "
                 "the kernel lacks nfnetlink_queue)\n",
                 queue_number, std::strerror(errno));
    nfq_close(handle);
    return 1;
  }
  // Metadata only: the packet id is all we need, and the contents never cross into userspace.
  if (nfq_set_mode(impairer.queue, NFQNL_COPY_META, 0) < 0 ||
      nfq_set_queue_maxlen(impairer.queue, max_held) < 0) {
    std::fprintf(stderr, "shard-net-impair: configuring NFQUEUE %d failed: %s\n", queue_number,
                 std::strerror(errno));
    nfq_destroy_queue(impairer.queue);
    nfq_close(handle);
    return 1;
  }
  // Room for bursts of queue messages between two reads.
  nfnl_rcvbufsiz(nfq_nfnlh(handle), 8u << 20);
  const int fd = nfq_fd(handle);

  struct sigaction stop = {};
  stop.sa_handler = &OnStop;
  sigaction(SIGTERM, &stop, nullptr);
  sigaction(SIGINT, &stop, nullptr);
  struct sigaction report = {};
  report.sa_handler = &OnReport;
  sigaction(SIGUSR1, &report, nullptr);

  std::printf("shard-net-impair: queue %d, delay %s, jitter %s, loss %.4f, seed %" PRIu64 "\n",
              queue_number, absl::FormatDuration(parsed_delay).c_str(),
              absl::FormatDuration(absl::Nanoseconds(impairer.jitter_ns)).c_str(), loss, seed);
  std::fflush(stdout);

  alignas(8) char buffer[65536];
  while (!g_stop) {
    if (g_report) {
      g_report = 0;
      Report(impairer.counters, static_cast<uint16_t>(queue_number));
    }
    // Give back every packet whose time has come, then sleep until the next one is due or a
    // packet arrives.
    const int64_t now = NowNs();
    while (!impairer.held.empty() && impairer.held.front().due_ns <= now) {
      nfq_set_verdict(impairer.queue, impairer.held.front().id, NF_ACCEPT, 0, nullptr);
      impairer.held.pop_front();
      ++impairer.counters.accepted;
    }
    timespec timeout;
    timespec* wait = nullptr;
    if (!impairer.held.empty()) {
      const int64_t left = std::max<int64_t>(0, impairer.held.front().due_ns - now);
      timeout.tv_sec = left / 1'000'000'000;
      timeout.tv_nsec = left % 1'000'000'000;
      wait = &timeout;
    }
    pollfd readable = {fd, POLLIN, 0};
    const int ready = ppoll(&readable, 1, wait, nullptr);
    if (ready < 0) {
      if (errno == EINTR) continue;
      std::fprintf(stderr, "shard-net-impair: poll failed: %s\n", std::strerror(errno));
      break;
    }
    if (ready == 0) continue;
    // Everything that is waiting, without blocking.
    for (;;) {
      const ssize_t got = recv(fd, buffer, sizeof(buffer), MSG_DONTWAIT);
      if (got < 0) {
        if (errno == ENOBUFS) {
          ++impairer.counters.overruns;
          continue;
        }
        break;  // EAGAIN: drained (EINTR: the loop looks at the signals)
      }
      nfq_handle_packet(handle, buffer, static_cast<int>(got));
    }
  }

  // Stopping: every held packet goes on now, so that no connection loses a packet to us.
  for (const Held& held : impairer.held) {
    nfq_set_verdict(impairer.queue, held.id, NF_ACCEPT, 0, nullptr);
    ++impairer.counters.flushed;
  }
  impairer.held.clear();
  Report(impairer.counters, static_cast<uint16_t>(queue_number));
  nfq_destroy_queue(impairer.queue);
  nfq_close(handle);
  return 0;
}
