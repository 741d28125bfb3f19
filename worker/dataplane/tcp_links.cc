#include "worker/dataplane/tcp_links.h"

#include <dirent.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <mutex>

namespace shard {

void IgnoreSigpipeUnlessHandled() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction current = {};
    if (::sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL) {
      ::signal(SIGPIPE, SIG_IGN);
    }
  });
}

std::set<ino_t> OpenSockets() {
  std::set<ino_t> sockets;
  DIR* dir = ::opendir("/proc/self/fd");
  if (dir == nullptr) return sockets;
  while (const dirent* entry = ::readdir(dir)) {
    struct stat info {};
    if (::fstatat(::dirfd(dir), entry->d_name, &info, 0) == 0 && S_ISSOCK(info.st_mode)) {
      sockets.insert(info.st_ino);
    }
  }
  ::closedir(dir);
  return sockets;
}

void SetLinkTimeouts(const std::set<ino_t>& before, absl::Duration timeout) {
  if (timeout <= absl::ZeroDuration()) return;
  const int seconds = std::max<int>(1, static_cast<int>(absl::ToInt64Seconds(timeout)));
  const int idle = std::max(1, seconds / 2);
  const int interval = 1;
  const int probes = std::max(1, seconds - idle);
  const unsigned user_timeout_ms = static_cast<unsigned>(absl::ToInt64Milliseconds(timeout));
  const int one = 1;
  DIR* dir = ::opendir("/proc/self/fd");
  if (dir == nullptr) return;
  while (const dirent* entry = ::readdir(dir)) {
    char* end = nullptr;
    const long fd = std::strtol(entry->d_name, &end, 10);
    if (end == entry->d_name || *end != '\0' || fd == ::dirfd(dir)) continue;
    struct stat info {};
    if (::fstat(static_cast<int>(fd), &info) != 0 || !S_ISSOCK(info.st_mode) ||
        before.contains(info.st_ino)) {
      continue;
    }
    int type = 0;
    int listening = 0;
    socklen_t length = sizeof(type);
    sockaddr_storage peer{};
    socklen_t peer_length = sizeof(peer);
    if (::getsockopt(static_cast<int>(fd), SOL_SOCKET, SO_TYPE, &type, &length) != 0 ||
        type != SOCK_STREAM) {
      continue;
    }
    length = sizeof(listening);
    if (::getsockopt(static_cast<int>(fd), SOL_SOCKET, SO_ACCEPTCONN, &listening, &length) != 0 ||
        listening != 0 ||
        ::getpeername(static_cast<int>(fd), reinterpret_cast<sockaddr*>(&peer), &peer_length) !=
            0 ||
        (peer.ss_family != AF_INET && peer.ss_family != AF_INET6)) {
      continue;
    }
    const int s = static_cast<int>(fd);
    ::setsockopt(s, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
    ::setsockopt(s, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof(idle));
    ::setsockopt(s, IPPROTO_TCP, TCP_KEEPINTVL, &interval, sizeof(interval));
    ::setsockopt(s, IPPROTO_TCP, TCP_KEEPCNT, &probes, sizeof(probes));
    ::setsockopt(s, IPPROTO_TCP, TCP_USER_TIMEOUT, &user_timeout_ms, sizeof(user_timeout_ms));
  }
  ::closedir(dir);
}

}  // namespace shard
