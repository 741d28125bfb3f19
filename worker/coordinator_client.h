// The worker's side of the coordinator's gRPC services. Every call has a deadline.
#pragma once

#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/channel.h"
#include "proto/channel_security.h"
#include "proto/unary_call.h"
#include "shard/v1/coordinator.grpc.pb.h"
#include "worker/dataplane/key_value_store.h"

namespace shard {

// The Rendezvous service bound to one generation's scope. Cancel() makes a blocked Wait (and
// every later call) return Cancelled at once, so a stopping worker never sits out a rendezvous.
class RendezvousClient : public KeyValueStore {
 public:
  RendezvousClient(std::shared_ptr<v1::Rendezvous::Stub> stub, v1::RendezvousScope scope,
                   std::string address, absl::Duration rpc_timeout);

  absl::Status Set(const std::string& key, const std::string& value) override;
  absl::StatusOr<std::string> Get(const std::string& key) override;
  absl::Status Wait(const std::vector<std::string>& keys, absl::Duration timeout) override;
  void Cancel();

 private:
  // One call on a context that Cancel() can reach.
  template <typename Request, typename Response>
  absl::StatusOr<Response> Call(UnaryMethod<v1::Rendezvous::Stub, Request, Response> method,
                                const std::type_identity_t<Request>& request,
                                absl::Duration timeout, absl::string_view what);

  std::shared_ptr<v1::Rendezvous::Stub> stub_;
  v1::RendezvousScope scope_;
  std::string address_;
  absl::Duration rpc_timeout_;
  absl::Mutex mu_;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  grpc::ClientContext* in_flight_ ABSL_GUARDED_BY(mu_) = nullptr;
};

class CoordinatorClient {
 public:
  // `security`: TLS and the job token, if the coordinator requires them.
  CoordinatorClient(std::string address, absl::Duration rpc_timeout,
                    const ClientSecurity& security = {});

  const std::string& address() const { return address_; }

  absl::StatusOr<v1::JoinResponse> Join(const v1::JoinRequest& request);
  absl::StatusOr<v1::HeartbeatResponse> Heartbeat(const v1::HeartbeatRequest& request);
  absl::Status ReportSelfCheck(const v1::ReportSelfCheckRequest& request);
  absl::Status Leave(const v1::LeaveRequest& request);
  absl::StatusOr<v1::PlanResponse> RegisterManifest(const v1::RegisterManifestRequest& request);
  absl::StatusOr<v1::PlanResponse> AckPlan(const v1::AckPlanRequest& request);
  // Held by the coordinator up to request.wait_ms(); the deadline allows for that.
  absl::StatusOr<v1::PlanResponse> ReportGradientOrder(
      const v1::ReportGradientOrderRequest& request);
  absl::Status ReportStepStats(const v1::ReportStepStatsRequest& request);
  absl::Status ReportTrainingDone(const v1::ReportTrainingDoneRequest& request);
  absl::Status ReportCheckpointShard(const v1::ReportCheckpointShardRequest& request);
  absl::Status ReportSnapshot(const v1::ReportSnapshotRequest& request);
  absl::StatusOr<v1::RestoreSnapshot> GetRestoreSnapshot(
      const v1::GetRestoreSnapshotRequest& request);
  absl::Status ReportRestore(const v1::ReportRestoreRequest& request);

  // The rendezvous store of one generation, for the data path.
  std::unique_ptr<RendezvousClient> RendezvousStore(const v1::RendezvousScope& scope);

 private:
  struct Stubs {
    std::shared_ptr<grpc::Channel> channel;
    std::unique_ptr<v1::Coordinator::Stub> coordinator;
    std::shared_ptr<v1::Rendezvous::Stub> rendezvous;
  };

  std::shared_ptr<const Stubs> MakeStubs() const;
  std::shared_ptr<const Stubs> stubs() const;
  // Swaps in a new channel when `failed` (the one a call just failed on) cannot connect.
  void ReplaceFailedChannel(const std::shared_ptr<const Stubs>& failed);
  // One call on the current channel (replaced if the call finds it cannot connect); `what`
  // ("join at") is followed by the address in errors.
  template <typename Request, typename Response>
  absl::StatusOr<Response> Call(UnaryMethod<v1::Coordinator::Stub, Request, Response> method,
                                const std::type_identity_t<Request>& request,
                                absl::Duration timeout, absl::string_view what);

  const std::string address_;
  const absl::Duration rpc_timeout_;
  const ClientSecurity security_;
  mutable absl::Mutex mu_;
  std::shared_ptr<const Stubs> stubs_ ABSL_GUARDED_BY(mu_);
  absl::Time replaced_at_ ABSL_GUARDED_BY(mu_);
};

}  // namespace shard
