#include "server/access_guard.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "proto/channel_security.h"
#include "proto/grpc_status.h"

namespace shard {
namespace {

// Open to every caller on the main port, as they are on the health port: probes, and the schema
// (which the repository publishes anyway).
constexpr absl::string_view kOpenServices[] = {"/grpc.health.v1.Health/",
                                               "/grpc.reflection.v1alpha.ServerReflection/"};

absl::string_view View(const grpc::string_ref& ref) { return {ref.data(), ref.size()}; }

}  // namespace

absl::StatusOr<AccessTable> AccessTableOf(const google::protobuf::FileDescriptor& contract) {
  AccessTable table;
  for (int s = 0; s < contract.service_count(); ++s) {
    const google::protobuf::ServiceDescriptor& service = *contract.service(s);
    for (int m = 0; m < service.method_count(); ++m) {
      const google::protobuf::MethodDescriptor& method = *service.method(m);
      const v1::Access access = method.options().GetExtension(v1::access);
      if (access == v1::ACCESS_UNSPECIFIED) {
        return absl::InternalError(absl::StrCat(
            "rpc ", method.full_name(), " has no (shard.v1.access) option in ", contract.name(),
            ": declare who may call it (ACCESS_WORKER, ACCESS_READ or ACCESS_ADMIN)"));
      }
      table.emplace(absl::StrCat("/", service.full_name(), "/", method.name()), access);
    }
  }
  return table;
}

absl::Status AccessGuard::Check(absl::string_view path, absl::string_view authorization) const {
  v1::Access access = v1::ACCESS_ADMIN;
  if (auto found = table_.find(path); found != table_.end()) {
    access = found->second;
  } else {
    for (absl::string_view open : kOpenServices) {
      if (absl::StartsWith(path, open)) return absl::OkStatus();
    }
  }
  const bool needs_job = access == v1::ACCESS_WORKER && !job_token_.empty();
  const bool needs_admin = access == v1::ACCESS_ADMIN && !admin_token_.empty();
  const bool needs_any =
      access == v1::ACCESS_READ && (!job_token_.empty() || !admin_token_.empty());
  if (!needs_job && !needs_admin && !needs_any) return absl::OkStatus();
  absl::string_view token = authorization;
  if (!absl::ConsumePrefix(&token, "Bearer ")) token = {};
  const char* remedy =
      needs_job ? "this call needs the job token: start shard-worker with --job-token-file"
      : needs_admin ? "this call changes the job and needs the admin token: give shardctl "
                      "--admin-token-file"
                    : "this call needs the admin (or job) token: give shardctl "
                      "--admin-token-file";
  if (token.empty()) return absl::UnauthenticatedError(remedy);
  const bool job_ok = !job_token_.empty() && TokensEqual(token, job_token_);
  const bool admin_ok = !admin_token_.empty() && TokensEqual(token, admin_token_);
  if ((needs_job && job_ok) || (needs_admin && admin_ok) || (needs_any && (job_ok || admin_ok))) {
    return absl::OkStatus();
  }
  return absl::PermissionDeniedError(absl::StrCat("the token presented is not valid: ", remedy));
}

grpc::Status AccessGuard::Process(const InputMetadata& auth_metadata,
                                  grpc::AuthContext* /*context*/,
                                  OutputMetadata* consumed_auth_metadata,
                                  OutputMetadata* /*response_metadata*/) {
  absl::string_view path;
  absl::string_view authorization;
  if (auto found = auth_metadata.find(":path"); found != auth_metadata.end()) {
    path = View(found->second);
  }
  if (auto found = auth_metadata.find(kAuthorizationHeader); found != auth_metadata.end()) {
    authorization = View(found->second);
  }
  const absl::Status allowed = Check(path, authorization);
  if (!allowed.ok()) {
    if (metrics_ != nullptr) {
      metrics_->Begin(path);
      metrics_->End(path, static_cast<grpc::StatusCode>(allowed.code()), absl::ZeroDuration());
    }
    return ToGrpcStatus(allowed);
  }
  // No handler needs the token: taking it off the call keeps it out of anything they log.
  if (!authorization.empty()) {
    consumed_auth_metadata->emplace(kAuthorizationHeader, std::string(authorization));
  }
  return grpc::Status::OK;
}

}  // namespace shard
