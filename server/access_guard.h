// Who may make which call. With a job token configured, every worker-facing call (join,
// heartbeat, rendezvous, reports) must carry it; with an admin token, every mutating admin call
// (save, restore, delete, stop, resize, drain) must carry it; read-only admin calls take either.
// Without tokens everything is open, as on a developer's loopback.
#pragma once

#include <string>

#include "absl/status/status.h"
#include "grpcpp/server_context.h"

namespace shard {

enum class Access {
  kWorker,  // the data path: needs the job token
  kRead,    // status, plans, stats, lists: the job or the admin token
  kAdmin,   // changes the job or its checkpoints: the admin token
};

class AccessGuard {
 public:
  // Empty tokens are not required.
  AccessGuard(std::string job_token, std::string admin_token)
      : job_token_(std::move(job_token)), admin_token_(std::move(admin_token)) {}

  // Unauthenticated when the call carries no token it needs, PermissionDenied when it carries
  // a wrong one; the message says which flag supplies the right one and never echoes tokens.
  absl::Status Check(const grpc::CallbackServerContext& context, Access access) const;

  bool job_token_required() const { return !job_token_.empty(); }
  bool admin_token_required() const { return !admin_token_.empty(); }

 private:
  const std::string job_token_;
  const std::string admin_token_;
};

}  // namespace shard
