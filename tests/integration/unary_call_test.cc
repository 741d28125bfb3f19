// UnaryCall (proto/unary_call.h) and shardctl's AdminClient on top of it, against a real gRPC
// server on loopback: a small Admin service whose answer each test chooses.
#include "proto/unary_call.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "client/admin_client.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "gtest/gtest.h"
#include "proto/channel_security.h"
#include "shard/v1/coordinator.grpc.pb.h"

namespace shard {
namespace {

// A call the service never answers: it ends when the client cancels it or its deadline passes
// (the server sees both as a cancellation).
class HeldCall : public grpc::ServerUnaryReactor {
 public:
  void OnCancel() override { Finish(grpc::Status::CANCELLED); }
  void OnDone() override { delete this; }
};

// GetStatus answers with the status set by Answer(), or holds the call after Hold().
class FakeAdmin final : public v1::Admin::CallbackService {
 public:
  void Answer(grpc::Status status) {
    absl::MutexLock lock(&mu_);
    answer_ = std::move(status);
  }
  void Hold() {
    absl::MutexLock lock(&mu_);
    answer_.reset();
  }
  // Returns once a call is being held, so that cancelling it tests a call in flight.
  void AwaitHeldCall() {
    absl::MutexLock lock(&mu_);
    auto held = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return held_calls_ > 0; };
    mu_.Await(absl::Condition(&held));
  }
  // The "authorization" metadata of the last call, empty if it had none.
  std::string authorization() {
    absl::MutexLock lock(&mu_);
    return authorization_;
  }

  grpc::ServerUnaryReactor* GetStatus(grpc::CallbackServerContext* context,
                                      const v1::GetStatusRequest* /*request*/,
                                      v1::GetStatusResponse* response) override {
    std::optional<grpc::Status> answer;
    {
      absl::MutexLock lock(&mu_);
      const auto& metadata = context->client_metadata();
      const auto found = metadata.find(kAuthorizationHeader);
      authorization_ = found == metadata.end()
                           ? std::string()
                           : std::string(found->second.data(), found->second.size());
      answer = answer_;
      if (!answer.has_value()) {
        ++held_calls_;
        return new HeldCall();
      }
    }
    response->set_job("fake");
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    reactor->Finish(*answer);
    return reactor;
  }

 private:
  absl::Mutex mu_;
  std::optional<grpc::Status> answer_ ABSL_GUARDED_BY(mu_) = grpc::Status::OK;
  int held_calls_ ABSL_GUARDED_BY(mu_) = 0;
  std::string authorization_ ABSL_GUARDED_BY(mu_);
};

// A loopback port that refuses connections for as long as this lives: bound, never listening,
// so no other process can take it meanwhile.
class RefusingPort {
 public:
  RefusingPort() : fd_(socket(AF_INET, SOCK_STREAM, 0)) {
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t size = sizeof(address);
    if (fd_ >= 0 && bind(fd_, reinterpret_cast<sockaddr*>(&address), size) == 0 &&
        getsockname(fd_, reinterpret_cast<sockaddr*>(&address), &size) == 0) {
      port_ = ntohs(address.sin_port);
    }
  }
  ~RefusingPort() {
    if (fd_ >= 0) close(fd_);
  }
  RefusingPort(const RefusingPort&) = delete;
  RefusingPort& operator=(const RefusingPort&) = delete;

  int port() const { return port_; }

 private:
  int fd_;
  int port_ = 0;
};

class UnaryCallTest : public ::testing::Test {
 protected:
  void SetUp() override {
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(&service_);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    ASSERT_GT(port, 0);
    address_ = absl::StrCat("127.0.0.1:", port);
  }

  void TearDown() override {
    if (server_ != nullptr) server_->Shutdown(std::chrono::system_clock::now());
  }

  // GetStatus through UnaryCall on a channel made as the clients make theirs.
  static absl::StatusOr<v1::GetStatusResponse> GetStatus(const std::string& address,
                                                         grpc::ClientContext& context,
                                                         absl::Duration timeout,
                                                         const ClientSecurity& security = {}) {
    auto stub = v1::Admin::NewStub(CreateSecureChannel(address, security));
    return UnaryCall(context, *stub, &v1::Admin::Stub::GetStatus, v1::GetStatusRequest(),
                     timeout, absl::StrCat("status at ", address));
  }

  FakeAdmin service_;  // outlives server_
  std::unique_ptr<grpc::Server> server_;
  std::string address_;
};

TEST_F(UnaryCallTest, AnAnswerComesBackAndTheChannelSendsTheToken) {
  ClientSecurity security;
  security.token = "s3cret";
  grpc::ClientContext context;
  auto response = GetStatus(address_, context, absl::Seconds(30), security);
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_EQ(response->job(), "fake");
  // The token is the channel's business: UnaryCall adds nothing per call.
  EXPECT_EQ(service_.authorization(), "Bearer s3cret");
}

TEST_F(UnaryCallTest, TheServersCodeSurvivesAndTheMessageNamesTheCall) {
  // The worker's retries tell these apart by code alone.
  for (grpc::StatusCode code :
       {grpc::StatusCode::NOT_FOUND, grpc::StatusCode::FAILED_PRECONDITION,
        grpc::StatusCode::UNAVAILABLE, grpc::StatusCode::DEADLINE_EXCEEDED,
        grpc::StatusCode::ABORTED, grpc::StatusCode::PERMISSION_DENIED}) {
    service_.Answer(grpc::Status(code, "the server says no"));
    grpc::ClientContext context;
    auto response = GetStatus(address_, context, absl::Seconds(30));
    EXPECT_EQ(static_cast<int>(response.status().code()), static_cast<int>(code))
        << response.status();
    EXPECT_EQ(response.status().message(),
              absl::StrCat("status at ", address_, ": the server says no"));
  }
}

TEST_F(UnaryCallTest, TheDeadlineEndsAHeldCallAsDeadlineExceeded) {
  service_.Hold();
  grpc::ClientContext context;
  auto response = GetStatus(address_, context, absl::Milliseconds(200));
  EXPECT_EQ(response.status().code(), absl::StatusCode::kDeadlineExceeded) << response.status();
  EXPECT_TRUE(absl::StartsWith(response.status().message(), absl::StrCat("status at ", address_)))
      << response.status();
}

TEST_F(UnaryCallTest, CancellingTheContextFromAnotherThreadEndsTheCallAtOnce) {
  service_.Hold();
  grpc::ClientContext context;
  std::thread canceller([&] {
    service_.AwaitHeldCall();
    context.TryCancel();
  });
  // CANCELLED rather than DEADLINE_EXCEEDED: the call ended well before its deadline.
  auto response = GetStatus(address_, context, absl::Seconds(60));
  canceller.join();
  EXPECT_EQ(response.status().code(), absl::StatusCode::kCancelled) << response.status();
  EXPECT_TRUE(absl::StartsWith(response.status().message(), absl::StrCat("status at ", address_)))
      << response.status();
}

TEST_F(UnaryCallTest, AContextCancelledBeforeTheCallStartsCancelsIt) {
  // RendezvousClient::Cancel() may land between publishing the context and the call's start.
  service_.Hold();
  grpc::ClientContext context;
  context.TryCancel();
  auto response = GetStatus(address_, context, absl::Seconds(60));
  EXPECT_EQ(response.status().code(), absl::StatusCode::kCancelled) << response.status();
}

TEST_F(UnaryCallTest, AnAddressNobodyServesIsUnavailableAndNamed) {
  RefusingPort refusing;
  ASSERT_GT(refusing.port(), 0);
  const std::string address = absl::StrCat("127.0.0.1:", refusing.port());
  grpc::ClientContext context;
  auto response = GetStatus(address, context, absl::Seconds(30));
  EXPECT_EQ(response.status().code(), absl::StatusCode::kUnavailable) << response.status();
  EXPECT_TRUE(absl::StartsWith(response.status().message(), absl::StrCat("status at ", address)))
      << response.status();
}

TEST_F(UnaryCallTest, ShardctlSaysWhatToCheckWhenNobodyServesTheAddress) {
  RefusingPort refusing;
  ASSERT_GT(refusing.port(), 0);
  const std::string address = absl::StrCat("127.0.0.1:", refusing.port());
  auto status = AdminClient(address, absl::Seconds(30)).GetStatus();
  EXPECT_EQ(status.status().code(), absl::StatusCode::kUnavailable) << status.status();
  EXPECT_TRUE(absl::StartsWith(status.status().message(),
                               absl::StrCat("cannot reach the coordinator at ", address,
                                            " (status: ")))
      << status.status();
  EXPECT_TRUE(absl::EndsWith(status.status().message(),
                             "is shard-coordinator running there? Check --coordinator"))
      << status.status();
}

TEST_F(UnaryCallTest, ShardctlPassesTheServersRefusalOn) {
  service_.Answer(grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "no job yet"));
  auto status = AdminClient(address_, absl::Seconds(30)).GetStatus();
  EXPECT_EQ(status.status().code(), absl::StatusCode::kFailedPrecondition) << status.status();
  EXPECT_EQ(status.status().message(), "status: no job yet");
}

}  // namespace
}  // namespace shard
