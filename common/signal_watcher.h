// SIGINT and SIGTERM turned into calls on one dedicated thread, so that the callback may take
// locks and log. The handler only writes the signal number to a pipe (async-signal-safe), so it
// does not matter which thread the kernel picks, including threads that libraries started
// before main (OpenBLAS's pool, gRPC's executors).
#pragma once

#include <functional>
#include <thread>

namespace shard {

class SignalWatcher {
 public:
  // Calls `on_signal(signal, count)` for each SIGINT/SIGTERM received, count starting at 1.
  // One watcher per process.
  explicit SignalWatcher(std::function<void(int signal, int count)> on_signal);
  ~SignalWatcher();  // restores the default dispositions
  SignalWatcher(const SignalWatcher&) = delete;
  SignalWatcher& operator=(const SignalWatcher&) = delete;

 private:
  std::thread thread_;
};

}  // namespace shard
