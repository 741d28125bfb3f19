// Who may make which call, decided in one place for every call of the main port. Each rpc of the
// contract declares its class with the (shard.v1.access) method option
// (proto/shard/v1/coordinator.proto); the guard's table is derived from those options. With a
// job token configured, worker calls (join, heartbeat, rendezvous, reports) must carry it; with
// an admin token, admin calls (save, restore, delete, stop, resize, drain) must carry it; read
// calls take either. Without tokens everything is open, as on a developer's loopback.
//
// The guard is a grpc::AuthMetadataProcessor: installed on the server credentials, it runs
// before any handler, and a refused call never reaches one.
#pragma once

#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "google/protobuf/descriptor.h"
#include "grpcpp/security/auth_metadata_processor.h"
#include "server/metrics.h"
#include "shard/v1/coordinator.pb.h"

namespace shard {

// Method path ("/shard.v1.Admin/Stop") -> who may call it.
using AccessTable = absl::flat_hash_map<std::string, v1::Access>;

// The table of every rpc of every service in `contract`; an error naming the first rpc without
// an access option, so a new rpc cannot be served unguarded.
absl::StatusOr<AccessTable> AccessTableOf(const google::protobuf::FileDescriptor& contract);

// Thread-safe: immutable after construction.
class AccessGuard final : public grpc::AuthMetadataProcessor {
 public:
  // Empty tokens are not required. `metrics` (may be null) counts the refused calls, which never
  // reach the server's interceptors; it must outlive the server the guard is installed on.
  AccessGuard(AccessTable table, std::string job_token, std::string admin_token,
              RpcMetrics* metrics)
      : table_(std::move(table)),
        job_token_(std::move(job_token)),
        admin_token_(std::move(admin_token)),
        metrics_(metrics) {}

  // A call of `path` carrying `authorization` (the header's value; empty without one).
  // Unauthenticated when the call carries no token it needs, PermissionDenied when it carries a
  // wrong one; the message says which flag supplies the right one and never echoes tokens.
  // Health and reflection are open; a path outside the table needs the admin token.
  absl::Status Check(absl::string_view path, absl::string_view authorization) const;

  // Cheap and never blocks, so gRPC runs it inline rather than on a thread of its own.
  bool IsBlocking() const override { return false; }
  grpc::Status Process(const InputMetadata& auth_metadata, grpc::AuthContext* context,
                       OutputMetadata* consumed_auth_metadata,
                       OutputMetadata* response_metadata) override;

 private:
  const AccessTable table_;
  const std::string job_token_;
  const std::string admin_token_;
  RpcMetrics* const metrics_;
};

}  // namespace shard
