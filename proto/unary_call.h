// The one way a client of the coordinator (worker, shardctl, benchmarks) makes a blocking
// unary call: a deadline on every call, a context the caller owns, and the grpc::Status turned
// into an absl::Status that keeps its code and names the call.
#pragma once

#include <type_traits>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "grpcpp/client_context.h"
#include "grpcpp/support/status.h"
#include "proto/grpc_status.h"

namespace shard {

// A generated stub's blocking method, e.g. &v1::Coordinator::Stub::Join.
template <typename Stub, typename Request, typename Response>
using UnaryMethod = grpc::Status (Stub::*)(grpc::ClientContext*, const Request&, Response*);

// Calls `method` of `stub` on `context` (fresh, one per call) with a deadline `timeout` from
// now. The caller owns `context` so that another thread can TryCancel() the call, which then
// returns CANCELLED at once. A failure keeps its gRPC code (callers retry on UNAVAILABLE and
// DEADLINE_EXCEEDED and act on NOT_FOUND and FAILED_PRECONDITION) and its message starts with
// `what`, which names the call and where it went: "join at 127.0.0.1:7460: ...".
// TLS and the bearer token belong to the channel (CreateSecureChannel), so nothing is added
// per call here.
template <typename Stub, typename Request, typename Response>
absl::StatusOr<Response> UnaryCall(grpc::ClientContext& context, Stub& stub,
                                   UnaryMethod<Stub, Request, Response> method,
                                   const std::type_identity_t<Request>& request,
                                   absl::Duration timeout, absl::string_view what) {
  context.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  Response response;
  absl::Status status = FromGrpcStatus((stub.*method)(&context, request, &response), what);
  if (!status.ok()) return status;
  return response;
}

}  // namespace shard
