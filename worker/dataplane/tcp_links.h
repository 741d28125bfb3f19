// What the Gloo mesh's TCP links need that Gloo does not do: a dead peer must fail a
// collective rather than end the process, and a silent or stalled link must fail within the link
// timeout rather than hang. Gloo does not expose its sockets, so they are found in /proc.
#pragma once

#include <sys/types.h>

#include <set>

#include "absl/time/time.h"

namespace shard {

// A peer that dies mid-transfer must fail the collective (EPIPE), not end the process: Gloo
// writes with writev, which cannot ask for MSG_NOSIGNAL. So SIGPIPE is ignored, unless the
// program installed a handler of its own (Python, for one, ignores it already). Once a process.
void IgnoreSigpipeUnlessHandled();

// The inodes of this process's sockets now.
std::set<ino_t> OpenSockets();

// The connected TCP sockets that appeared since `before` (OpenSockets() taken before the mesh
// connected) get the link timeout: TCP_USER_TIMEOUT for data left unacknowledged, keepalive for a
// connection that falls silent. Nothing for a timeout of zero or less.
void SetLinkTimeouts(const std::set<ino_t>& before, absl::Duration timeout);

}  // namespace shard
