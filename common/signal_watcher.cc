#include "common/signal_watcher.h"

#include <pthread.h>
#include <signal.h>

namespace shard {
namespace {

// SIGUSR1 is our own: the destructor sends it to end the watching thread.
sigset_t WatchedSignals() {
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGUSR1);
  return signals;
}

}  // namespace

SignalWatcher::SignalWatcher(std::function<void(int, int)> on_signal) {
  const sigset_t signals = WatchedSignals();
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  thread_ = std::thread([signals, on_signal = std::move(on_signal)] {
    int count = 0;
    int received = 0;
    while (sigwait(&signals, &received) == 0 && received != SIGUSR1) {
      on_signal(received, ++count);
    }
  });
}

SignalWatcher::~SignalWatcher() {
  pthread_kill(thread_.native_handle(), SIGUSR1);
  thread_.join();
}

}  // namespace shard
