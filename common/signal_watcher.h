// SIGINT and SIGTERM handled on one dedicated thread (sigwait), so that no other thread is
// ever interrupted and handlers may take locks and log.
#pragma once

#include <functional>
#include <thread>

namespace shard {

class SignalWatcher {
 public:
  // Blocks SIGINT/SIGTERM in the calling thread (and so in threads it starts later) and calls
  // `on_signal(signal, count)` for each one received, count starting at 1. Construct it before
  // starting any other thread.
  explicit SignalWatcher(std::function<void(int signal, int count)> on_signal);
  ~SignalWatcher();
  SignalWatcher(const SignalWatcher&) = delete;
  SignalWatcher& operator=(const SignalWatcher&) = delete;

 private:
  std::thread thread_;
};

}  // namespace shard
