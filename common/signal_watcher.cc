#include "common/signal_watcher.h"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>

namespace shard {
namespace {

int pipe_fds[2] = {-1, -1};

void OnSignal(int signal) {
  const int saved_errno = errno;
  const unsigned char byte = static_cast<unsigned char>(signal);
  [[maybe_unused]] ssize_t written = ::write(pipe_fds[1], &byte, 1);
  errno = saved_errno;
}

}  // namespace

SignalWatcher::SignalWatcher(std::function<void(int, int)> on_signal) {
  ::pipe2(pipe_fds, O_CLOEXEC);
  struct sigaction action = {};
  action.sa_handler = OnSignal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  sigaction(SIGINT, &action, nullptr);
  sigaction(SIGTERM, &action, nullptr);
  thread_ = std::thread([on_signal = std::move(on_signal)] {
    int count = 0;
    unsigned char byte = 0;
    while (true) {
      const ssize_t n = ::read(pipe_fds[0], &byte, 1);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0 || byte == 0) return;  // 0: the destructor's wake-up
      on_signal(byte, ++count);
    }
  });
}

SignalWatcher::~SignalWatcher() {
  struct sigaction action = {};
  action.sa_handler = SIG_DFL;
  sigaction(SIGINT, &action, nullptr);
  sigaction(SIGTERM, &action, nullptr);
  const unsigned char stop = 0;
  [[maybe_unused]] ssize_t written = ::write(pipe_fds[1], &stop, 1);
  thread_.join();
  ::close(pipe_fds[0]);
  ::close(pipe_fds[1]);
}

}  // namespace shard
