// Operations and security with real processes on 127.0.0.1: job and admin tokens (over plaintext
// on loopback and over TLS), TLS and mutual TLS with certificates made by openssl for the test,
// the plaintext health port, the metrics endpoint, flags from the environment, and the warning
// for a plaintext non-loopback listener.
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <optional>
#include <utility>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "google/protobuf/descriptor.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/support/byte_buffer.h"
#include "gtest/gtest.h"
#include "httplib.h"
#include "nlohmann/json.hpp"
#include "shard/v1/coordinator.pb.h"
#include "tests/support/cluster.h"
#include "tests/support/process.h"

namespace shard::testing {
namespace {

class SecurityTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = MakeTempDir("security");
    cluster_.emplace(dir_);
    std::ofstream(dir_ + "/job.token") << "job-4f7d2c\n";
    std::ofstream(dir_ + "/admin.token") << "admin-9a1e6b\n";
  }

  // A CA, a server certificate for 127.0.0.1 and a client certificate, all signed by the CA.
  void MakeCertificates() {
    const std::string script = absl::StrCat(
        "set -e; cd ", dir_, "\n",
        "key() { openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout "
        "$1.key -out $1.csr -subj /CN=$1 2>/dev/null; }\n",
        "openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout "
        "ca.key -out ca.crt -days 1 -subj /CN=shard-test-ca 2>/dev/null\n",
        "printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\\n' > san.ext\n",
        "key server; openssl x509 -req -in server.csr -CA ca.crt -CAkey ca.key -CAcreateserial "
        "-out server.crt -days 1 -extfile san.ext 2>/dev/null\n",
        "key client; openssl x509 -req -in client.csr -CA ca.crt -CAkey ca.key -CAcreateserial "
        "-out client.crt -days 1 2>/dev/null\n",
        // A second CA whose certificates the coordinator must refuse.
        "openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout "
        "rogue-ca.key -out rogue-ca.crt -days 1 -subj /CN=rogue 2>/dev/null\n",
        "key rogue; openssl x509 -req -in rogue.csr -CA rogue-ca.crt -CAkey rogue-ca.key "
        "-CAcreateserial -out rogue.crt -days 1 2>/dev/null\n");
    CommandResult made = RunCommand({"/bin/sh", "-c", script}, absl::Seconds(60));
    ASSERT_EQ(made.exit_code, 0) << made.output;
  }

  std::string File(const std::string& name) const { return dir_ + "/" + name; }

  // A 2-worker job of `steps` steps on the small MLP, with its data.
  std::string WriteJob(int steps) {
    CommandResult data = RunCommand({BinaryPath("shardctl"), "data", "generate", "--widths",
                                     "32,64,10", "--samples", "2048", "--seed", "5", "--out",
                                     File("data.safetensors")},
                                    absl::Seconds(30));
    EXPECT_EQ(data.exit_code, 0) << data.output;
    std::ofstream(File("job.json")) << absl::StrCat(
        R"({"name": "secure", "worldSize": 2, "model": {"mlp": {"widths": [32, 64, 10]}},
        "data": {"path": "data.safetensors"}, "optimizer": {"name": "adam", "lr": 0.003},
        "globalBatch": 32, "steps": )", steps, R"(, "zeroStage": 2, "outputDir": "out"})");
    return File("job.json");
  }

  // Without --job in `extra`, a world of 2 without training.
  void StartCoordinator(std::vector<std::string> extra, const std::vector<std::string>& env = {}) {
    std::vector<std::string> args = {"--state-dir", File("state"), "--lease", "2s"};
    if (std::find(extra.begin(), extra.end(), "--job") == extra.end()) {
      args.insert(args.end(), {"--world-size", "2"});
    }
    args.insert(args.end(), extra.begin(), extra.end());
    const absl::Status started = cluster_->StartCoordinator(args, 0, "coordinator.log", env);
    ASSERT_TRUE(started.ok()) << started;
  }

  // shardctl with `flags` (before the subcommand) and `command`.
  CommandResult Shardctl(std::vector<std::string> flags, const std::vector<std::string>& command) {
    flags.insert(flags.end(), command.begin(), command.end());
    return cluster_->Shardctl(flags, absl::Seconds(20));
  }

  std::string dir_;
  std::optional<LocalCluster> cluster_;
};

// A plaintext unary call of `method` with `request` as its raw bytes, and `token` as its bearer
// token if not empty: the status and the raw response.
std::pair<grpc::Status, std::string> RawCall(const std::string& address,
                                             const std::string& method,
                                             const std::string& request,
                                             const std::string& token = "") {
  grpc::GenericStub stub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  if (!token.empty()) context.AddMetadata("authorization", "Bearer " + token);
  // Short: a request the server refuses while it is still being sent (over the size cap) can
  // complete on the client only at its deadline, though with the server's status.
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(3));
  grpc::Slice slice(request);
  grpc::ByteBuffer buffer(&slice, 1);
  grpc::ByteBuffer response;
  std::mutex mu;
  std::condition_variable done_cv;
  std::optional<grpc::Status> result;
  stub.UnaryCall(&context, method, grpc::StubOptions(), &buffer, &response,
                 [&](grpc::Status status) {
                   std::lock_guard<std::mutex> lock(mu);
                   result = status;
                   done_cv.notify_all();
                 });
  std::unique_lock<std::mutex> lock(mu);
  done_cv.wait(lock, [&] { return result.has_value(); });
  std::string bytes;
  std::vector<grpc::Slice> slices;
  if (result->ok() && response.Dump(&slices).ok()) {
    for (const grpc::Slice& part : slices) {
      bytes.append(reinterpret_cast<const char*>(part.begin()), part.size());
    }
  }
  return {*result, bytes};
}

// grpc.health.v1.Health/Check for the whole server (an empty request): the response's status
// (1: SERVING, 2: NOT_SERVING), or -1 when the call fails.
int HealthStatus(const std::string& address) {
  auto [status, bytes] = RawCall(address, "/grpc.health.v1.Health/Check", "");
  // One varint field: tag 0x08, then the enum value.
  return status.ok() && bytes.size() == 2 && bytes[0] == 0x08 ? bytes[1] : -1;
}

TEST_F(SecurityTest, TokensKeepOutWorkersAndAdminsWithoutTheRightOne) {
  const int metrics_port = FreePort();
  StartCoordinator({"--job-token-file", File("job.token"), "--admin-token-file",
                    File("admin.token"), "--metrics-listen",
                    absl::StrCat("127.0.0.1:", metrics_port)});
  // A worker without the job token, or with the admin's, is refused and says why.
  Process anonymous = cluster_->StartWorker("anonymous");
  const std::optional<int> anonymous_exit = anonymous.Wait(absl::Seconds(20));
  ASSERT_TRUE(anonymous_exit.has_value()) << "still running: " << anonymous.Log();
  EXPECT_NE(*anonymous_exit, 0);
  EXPECT_NE(anonymous.Log().find("job token"), std::string::npos) << anonymous.Log();
  Process wrong = cluster_->StartWorker("wrong", {"--job-token-file", File("admin.token")});
  const std::optional<int> wrong_exit = wrong.Wait(absl::Seconds(20));
  ASSERT_TRUE(wrong_exit.has_value()) << "still running: " << wrong.Log();
  EXPECT_NE(*wrong_exit, 0);
  EXPECT_NE(wrong.Log().find("not valid"), std::string::npos) << wrong.Log();

  std::vector<Process> workers;
  for (const char* id : {"w0", "w1"}) {
    workers.push_back(cluster_->StartWorker(id, {"--job-token-file", File("job.token")}));
  }
  const std::vector<std::string> admin = {"--admin-token-file", File("admin.token")};
  CommandResult ready = Shardctl(admin, {"wait", "--wait-timeout", "30s"});
  ASSERT_EQ(ready.exit_code, 0) << ready.output << cluster_->coordinator().Log();

  // Reading needs a token; changing the job needs the admin's.
  CommandResult status = Shardctl({}, {"status"});
  EXPECT_NE(status.exit_code, 0);
  EXPECT_NE(status.output.find("--admin-token-file"), std::string::npos) << status.output;
  EXPECT_EQ(Shardctl({"--admin-token-file", File("job.token")}, {"status"}).exit_code, 0);
  const nlohmann::json before = nlohmann::json::parse(
      Shardctl(admin, {"status", "--json"}).output, nullptr, false);
  CommandResult stop_as_worker =
      Shardctl({"--admin-token-file", File("job.token")}, {"stop", "--no-wait"});
  EXPECT_NE(stop_as_worker.exit_code, 0);
  EXPECT_NE(stop_as_worker.output.find("not valid"), std::string::npos) << stop_as_worker.output;
  EXPECT_NE(stop_as_worker.output.find("admin token"), std::string::npos) << stop_as_worker.output;
  CommandResult resize_anonymous = Shardctl({}, {"resize", "--world-size", "1", "--no-wait"});
  EXPECT_NE(resize_anonymous.exit_code, 0);
  // The codes on the wire: no token, a wrong token, the right one (an empty StopRequest).
  const std::string address = cluster_->address();
  EXPECT_EQ(RawCall(address, "/shard.v1.Admin/Stop", "").first.error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(RawCall(address, "/shard.v1.Admin/Stop", "", "job-4f7d2c").first.error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(RawCall(address, "/shard.v1.Coordinator/Join", "").first.error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  // Every method of every service, so none added later ships unguarded.
  int methods = 0;
  for (const char* name : {"shard.v1.Coordinator", "shard.v1.Rendezvous", "shard.v1.Admin"}) {
    const google::protobuf::ServiceDescriptor* service =
        google::protobuf::DescriptorPool::generated_pool()->FindServiceByName(name);
    ASSERT_NE(service, nullptr) << name;
    for (int m = 0; m < service->method_count(); ++m, ++methods) {
      const std::string method = absl::StrCat("/", name, "/", service->method(m)->name());
      EXPECT_EQ(RawCall(address, method, "").first.error_code(),
                grpc::StatusCode::UNAUTHENTICATED)
          << method;
    }
  }
  EXPECT_GE(methods, 20);
  // A method the contract does not have needs the admin token before it is found missing;
  // health stays open, as on the health port.
  EXPECT_EQ(RawCall(address, "/shard.v1.Admin/NoSuchMethod", "").first.error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(
      RawCall(address, "/shard.v1.Admin/NoSuchMethod", "", "admin-9a1e6b").first.error_code(),
      grpc::StatusCode::UNIMPLEMENTED);
  EXPECT_EQ(HealthStatus(address), 1);
  // Refused calls never reach a handler, but they are counted: Drain was called once, refused.
  httplib::Client metrics("127.0.0.1", metrics_port);
  httplib::Result page = metrics.Get("/metrics");
  ASSERT_TRUE(page && page->status == 200);
  EXPECT_NE(page->body.find("\nshard_rpc_requests_total{code=\"UNAUTHENTICATED\","
                            "method=\"shard.v1.Admin/Drain\"} 1\n"),
            std::string::npos)
      << page->body;
  const std::string denied_stops =
      "\nshard_rpc_requests_total{code=\"PERMISSION_DENIED\",method=\"shard.v1.Admin/Stop\"} ";
  const size_t denied_at = page->body.find(denied_stops);
  ASSERT_NE(denied_at, std::string::npos) << page->body;
  EXPECT_GE(std::stoll(page->body.substr(denied_at + denied_stops.size())), 2) << page->body;
  // The refused calls changed nothing.
  const nlohmann::json after = nlohmann::json::parse(
      Shardctl(admin, {"status", "--json"}).output, nullptr, false);
  ASSERT_FALSE(before.is_discarded() || after.is_discarded());
  EXPECT_EQ(after["state"], "running");
  EXPECT_EQ(after["generation"], before["generation"]);
  EXPECT_EQ(after["expected_world_size"], before["expected_world_size"]);
  EXPECT_EQ(Shardctl(admin, {"stop"}).exit_code, 0);
  EXPECT_EQ(cluster_->coordinator().Wait(absl::Seconds(30)), 0);
  for (Process& worker : workers) EXPECT_EQ(worker.Wait(absl::Seconds(10)), 0) << worker.Log();
  // No token reaches a log, not even the refusals of the wrong one.
  for (const std::string& log :
       {cluster_->coordinator().Log(), workers[0].Log(), workers[1].Log(), anonymous.Log(),
        wrong.Log(), stop_as_worker.output, status.output}) {
    EXPECT_EQ(log.find("job-4f7d2c"), std::string::npos);
    EXPECT_EQ(log.find("admin-9a1e6b"), std::string::npos);
  }
}

TEST_F(SecurityTest, MutualTlsAdmitsOnlyClientsWithACertificateFromTheClientCa) {
  MakeCertificates();
  StartCoordinator({"--job", WriteJob(60), "--tls-cert", File("server.crt"), "--tls-key",
                    File("server.key"), "--tls-client-ca", File("ca.crt")});
  const std::vector<std::string> tls = {"--tls-ca", File("ca.crt"), "--tls-cert",
                                        File("client.crt"), "--tls-key", File("client.key")};
  EXPECT_NE(Shardctl({"--timeout", "3s"}, {"status"}).exit_code, 0) << "plaintext";
  EXPECT_NE(Shardctl({"--timeout", "3s", "--tls-ca", File("ca.crt")}, {"status"}).exit_code, 0)
      << "TLS without a client certificate";
  EXPECT_NE(Shardctl({"--timeout", "3s", "--tls-ca", File("ca.crt"), "--tls-cert",
                      File("rogue.crt"), "--tls-key", File("rogue.key")},
                     {"status"})
                .exit_code,
            0)
      << "a certificate from another CA";
  EXPECT_NE(Shardctl({"--timeout", "3s", "--tls-ca", File("rogue-ca.crt"), "--tls-cert",
                      File("client.crt"), "--tls-key", File("client.key")},
                     {"status"})
                .exit_code,
            0)
      << "a server certificate the client cannot verify";
  std::vector<std::string> tls_status = {"--timeout", "3s"};
  tls_status.insert(tls_status.end(), tls.begin(), tls.end());
  EXPECT_EQ(Shardctl(tls_status, {"status"}).exit_code, 0) << "the right certificates";

  // Workers over mutual TLS train the job to the end; the coordinator finishes on its own.
  std::vector<Process> workers;
  for (const char* id : {"w0", "w1"}) workers.push_back(cluster_->StartWorker(id, tls));
  EXPECT_EQ(cluster_->coordinator().Wait(absl::Seconds(60)), 0) << cluster_->coordinator().Log();
  for (Process& worker : workers) EXPECT_EQ(worker.Wait(absl::Seconds(10)), 0) << worker.Log();
  EXPECT_NE(cluster_->coordinator().Log().find("training finished (60 steps"), std::string::npos)
      << cluster_->coordinator().Log();
  EXPECT_TRUE(std::filesystem::exists(File("out/final.safetensors")));
}

TEST_F(SecurityTest, TokensGuardCallsOverTlsOnANonLoopbackListener) {
  MakeCertificates();
  const absl::Status started = cluster_->StartCoordinator(
      {"--world-size", "1", "--state-dir", File("state"), "--tls-cert", File("server.crt"),
       "--tls-key", File("server.key"), "--job-token-file", File("job.token"),
       "--admin-token-file", File("admin.token")},
      0, "coordinator.log", {}, /*host=*/"0.0.0.0");
  ASSERT_TRUE(started.ok()) << started;
  const std::vector<std::string> tls = {"--timeout", "5s", "--tls-ca", File("ca.crt")};
  std::vector<std::string> admin = tls;
  admin.insert(admin.end(), {"--admin-token-file", File("admin.token")});
  std::vector<std::string> as_worker = tls;
  as_worker.insert(as_worker.end(), {"--admin-token-file", File("job.token")});

  CommandResult anonymous = Shardctl(tls, {"status"});
  EXPECT_NE(anonymous.exit_code, 0);
  EXPECT_NE(anonymous.output.find("--admin-token-file"), std::string::npos) << anonymous.output;
  Process tokenless = cluster_->StartWorker("tokenless", {"--tls-ca", File("ca.crt")});
  const std::optional<int> tokenless_exit = tokenless.Wait(absl::Seconds(20));
  ASSERT_TRUE(tokenless_exit.has_value()) << "still running: " << tokenless.Log();
  EXPECT_NE(*tokenless_exit, 0);
  EXPECT_NE(tokenless.Log().find("job token"), std::string::npos) << tokenless.Log();

  Process worker = cluster_->StartWorker(
      "w0", {"--tls-ca", File("ca.crt"), "--job-token-file", File("job.token")});
  CommandResult ready = Shardctl(admin, {"wait", "--wait-timeout", "30s"});
  ASSERT_EQ(ready.exit_code, 0) << ready.output << cluster_->coordinator().Log();
  EXPECT_EQ(Shardctl(as_worker, {"status"}).exit_code, 0);
  CommandResult stop_as_worker = Shardctl(as_worker, {"stop", "--no-wait"});
  EXPECT_NE(stop_as_worker.exit_code, 0);
  EXPECT_NE(stop_as_worker.output.find("not valid"), std::string::npos) << stop_as_worker.output;
  EXPECT_EQ(Shardctl(admin, {"stop"}).exit_code, 0);
  EXPECT_EQ(cluster_->coordinator().Wait(absl::Seconds(30)), 0) << cluster_->coordinator().Log();
  EXPECT_EQ(worker.Wait(absl::Seconds(10)), 0) << worker.Log();
}

TEST_F(SecurityTest, TokensWithoutTlsBeyondLoopbackAreRefused) {
  // They would cross the network in the clear, and gRPC can check them on plaintext only for
  // loopback connections.
  CommandResult started = RunCommand(
      {BinaryPath("shard-coordinator"), "--world-size", "1", "--state-dir", File("state"),
       "--listen", "0.0.0.0:0", "--job-token-file", File("job.token"), "--admin-token-file",
       File("admin.token")},
      absl::Seconds(20));
  EXPECT_EQ(started.exit_code, 2) << started.output;
  EXPECT_NE(started.output.find("--tls-cert"), std::string::npos) << started.output;
  EXPECT_NE(started.output.find("loopback"), std::string::npos) << started.output;
  EXPECT_EQ(started.output.find("job-4f7d2c"), std::string::npos) << started.output;
  EXPECT_EQ(started.output.find("admin-9a1e6b"), std::string::npos) << started.output;
}

TEST_F(SecurityTest, AJobTokenWithoutAnAdminTokenIsRefused) {
  // It would lock workers out while leaving stop, resize and the checkpoints open.
  CommandResult started = RunCommand(
      {BinaryPath("shard-coordinator"), "--world-size", "1", "--state-dir", File("state"),
       "--listen", "127.0.0.1:0", "--job-token-file", File("job.token")},
      absl::Seconds(20));
  EXPECT_EQ(started.exit_code, 2) << started.output;
  EXPECT_NE(started.output.find("--admin-token-file"), std::string::npos) << started.output;
}

TEST_F(SecurityTest, TheHealthPortAnswersInPlaintextWhileTheMainPortRequiresTls) {
  MakeCertificates();
  const int health_port = FreePort();
  StartCoordinator({"--tls-cert", File("server.crt"), "--tls-key", File("server.key"),
                    "--health-listen", absl::StrCat("127.0.0.1:", health_port)});
  EXPECT_EQ(HealthStatus(absl::StrCat("127.0.0.1:", health_port)), 1) << "SERVING";
  EXPECT_EQ(HealthStatus(cluster_->address()), -1) << "the main port speaks TLS only";
  // Health alone: reflection (the API's schema) is not served in plaintext. A ListServices
  // request (field 7, empty).
  EXPECT_EQ(RawCall(absl::StrCat("127.0.0.1:", health_port),
                    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
                    std::string("\x3a\x00", 2))
                .first.error_code(),
            grpc::StatusCode::UNIMPLEMENTED);
}

TEST_F(SecurityTest, MetricsShowTheWorldItsWorkersAndTheirCalls) {
  const int metrics_port = FreePort();
  StartCoordinator(
      {"--job", WriteJob(1000000), "--metrics-listen", absl::StrCat("127.0.0.1:", metrics_port)});
  std::vector<Process> workers;
  for (const char* id : {"w0", "w1"}) workers.push_back(cluster_->StartWorker(id));
  httplib::Client client("127.0.0.1", metrics_port);
  // Scrape while it trains, until the step counter has moved on.
  std::string body;
  int64_t scraped_step = 0;
  ASSERT_TRUE(Eventually(
      [&] {
        httplib::Result page = client.Get("/metrics");
        if (!page || page->status != 200) return false;
        body = page->body;
        const size_t at = body.find("\nshard_training_step ");
        if (at == std::string::npos) return false;
        scraped_step = std::stoll(body.substr(at + 21));
        return scraped_step >= 20;
      },
      absl::Seconds(60)))
      << body;
  // The furthest step the workers reported a moment later is at least the scraped one (the
  // counter is the furthest any rank reported, not rank 0's).
  CommandResult stats = cluster_->Shardctl({"stats", "--json"});
  const nlohmann::json parsed = nlohmann::json::parse(stats.output, nullptr, false);
  ASSERT_FALSE(parsed.is_discarded()) << stats.output;
  int64_t furthest_step = -1;
  for (const nlohmann::json& rank : parsed["ranks"]) {
    const nlohmann::json step = rank["last_step"]["step"];
    ASSERT_TRUE(step.is_number_integer()) << stats.output;
    furthest_step = std::max(furthest_step, step.get<int64_t>());
  }
  EXPECT_GE(furthest_step, scraped_step) << stats.output;
  // prometheus-cpp writes a series' labels in the order of their names.
  for (const char* line : {"\nshard_world_size 2\n", "\nshard_worker_up{rank=\"",
                           ",worker=\"w0\"} ", "\nshard_generation ", "\nshard_training_loss "}) {
    EXPECT_NE(body.find(line), std::string::npos) << line << "\n" << body;
  }
  // Both workers' joins (more if one rejoined after a missed lease on a busy machine).
  const std::string joins =
      "\nshard_rpc_requests_total{code=\"OK\",method=\"shard.v1.Coordinator/Join\"} ";
  const size_t joins_at = body.find(joins);
  ASSERT_NE(joins_at, std::string::npos) << body;
  EXPECT_GE(std::stoll(body.substr(joins_at + joins.size())), 2) << body;
  EXPECT_EQ(cluster_->Shardctl({"stop"}).exit_code, 0);
  for (Process& worker : workers) EXPECT_EQ(worker.Wait(absl::Seconds(10)), 0);
}

TEST_F(SecurityTest, OversizedAndMalformedCallsAreRefusedAndTheCoordinatorServesOn) {
  StartCoordinator({});
  const std::string address = cluster_->address();
  // 5 MiB: over the 4 MiB cap on any request.
  grpc::Status oversized =
      RawCall(address, "/shard.v1.Rendezvous/Set", std::string(5 << 20, 'x')).first;
  EXPECT_EQ(oversized.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
      << oversized.error_message();
  // Bytes that are no JoinRequest, and well-formed joins that describe a hostile worker.
  grpc::Status malformed =
      RawCall(address, "/shard.v1.Coordinator/Join", "\xff\xff\xff\x0f").first;
  EXPECT_FALSE(malformed.ok());
  EXPECT_NE(malformed.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED)
      << "answered at once: " << malformed.error_message();
  for (auto [id, host] : {std::pair{"../etc", "127.0.0.1"}, std::pair{"w0", "a b;rm -rf /"},
                          std::pair{"w0", ""}}) {
    v1::JoinRequest join;
    join.set_worker_id(id);
    join.set_host(host);
    join.set_incarnation(1);
    grpc::Status refused =
        RawCall(address, "/shard.v1.Coordinator/Join", join.SerializeAsString()).first;
    EXPECT_EQ(refused.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
        << id << " at " << host << ": " << refused.error_message();
  }
  // Still serving, and nobody joined.
  nlohmann::json status = cluster_->Status();
  ASSERT_FALSE(status.is_null());
  EXPECT_TRUE(status["workers"].empty()) << status.dump();
  EXPECT_EQ(HealthStatus(address), 1);
}

TEST_F(SecurityTest, FlagsComeFromTheEnvironmentAndTheCommandLineWins) {
  const int health_port = FreePort();
  // StartCoordinator passes --lease 2s.
  StartCoordinator({}, {absl::StrCat("SHARD_HEALTH_LISTEN=127.0.0.1:", health_port),
                        "SHARD_LEASE=7s", "SHARD_JOB_NAME=from-env"});
  EXPECT_EQ(HealthStatus(absl::StrCat("127.0.0.1:", health_port)), 1);
  nlohmann::json status = cluster_->Status();
  ASSERT_FALSE(status.is_null());
  EXPECT_EQ(status["job"], "from-env");
  EXPECT_EQ(status["lease_ms"], 2000) << "the command line wins over SHARD_LEASE";
}

TEST_F(SecurityTest, PlaintextOnANonLoopbackAddressIsALoudWarning) {
  const absl::Status started = cluster_->StartCoordinator(
      {"--world-size", "1", "--state-dir", File("state")}, 0, "coordinator.log", {},
      /*host=*/"0.0.0.0");
  ASSERT_TRUE(started.ok()) << started;
  EXPECT_NE(cluster_->coordinator().Log().find("WITHOUT TLS"), std::string::npos)
      << cluster_->coordinator().Log();
}

}  // namespace
}  // namespace shard::testing
