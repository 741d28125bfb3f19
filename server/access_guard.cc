#include "server/access_guard.h"

#include "absl/strings/match.h"
#include "absl/strings/strip.h"
#include "absl/strings/str_cat.h"
#include "proto/channel_security.h"

namespace shard {
namespace {

// The bearer token of the call, or empty; a view into the call's metadata.
absl::string_view PresentedToken(const grpc::CallbackServerContext& context) {
  const auto& metadata = context.client_metadata();
  auto found = metadata.find(kAuthorizationHeader);
  if (found == metadata.end()) return {};
  absl::string_view value(found->second.data(), found->second.size());
  return absl::ConsumePrefix(&value, "Bearer ") ? value : absl::string_view();
}

}  // namespace

absl::Status AccessGuard::Check(const grpc::CallbackServerContext& context, Access access) const {
  const bool needs_job = access == Access::kWorker && !job_token_.empty();
  const bool needs_admin = access == Access::kAdmin && !admin_token_.empty();
  const bool needs_any = access == Access::kRead && (!job_token_.empty() || !admin_token_.empty());
  if (!needs_job && !needs_admin && !needs_any) return absl::OkStatus();
  const absl::string_view token = PresentedToken(context);
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

}  // namespace shard
