// Operations and security with real processes on 127.0.0.1: job and admin tokens, TLS and
// mutual TLS with certificates made by openssl for the test, the plaintext health port, the
// metrics endpoint, flags from the environment, and the warning for a plaintext non-loopback
// listener.
#include <chrono>
#include <condition_variable>
#include <fstream>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/support/byte_buffer.h"
#include "gtest/gtest.h"
#include "httplib.h"
#include "nlohmann/json.hpp"
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

  void StartCoordinator(std::vector<std::string> extra, const std::vector<std::string>& env = {}) {
    std::vector<std::string> args = {"--world-size", "2", "--state-dir", File("state"),
                                     "--lease", "2s"};
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

TEST_F(SecurityTest, TokensKeepOutWorkersAndAdminsWithoutTheRightOne) {
  StartCoordinator({"--job-token-file", File("job.token"), "--admin-token-file",
                    File("admin.token")});
  // A worker without the job token, or with the admin's, is refused and says why.
  Process anonymous = cluster_->StartWorker("anonymous");
  EXPECT_NE(anonymous.Wait(absl::Seconds(20)), 0);
  EXPECT_NE(anonymous.Log().find("job token"), std::string::npos) << anonymous.Log();
  Process wrong = cluster_->StartWorker("wrong", {"--job-token-file", File("admin.token")});
  EXPECT_NE(wrong.Wait(absl::Seconds(20)), 0);
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
  CommandResult stop_as_worker =
      Shardctl({"--admin-token-file", File("job.token")}, {"stop", "--no-wait"});
  EXPECT_NE(stop_as_worker.exit_code, 0);
  EXPECT_NE(stop_as_worker.output.find("admin token"), std::string::npos) << stop_as_worker.output;
  EXPECT_EQ(Shardctl(admin, {"stop"}).exit_code, 0);
  EXPECT_EQ(cluster_->coordinator().Wait(absl::Seconds(30)), 0);
  for (Process& worker : workers) EXPECT_EQ(worker.Wait(absl::Seconds(10)), 0) << worker.Log();
  // No token reaches a log.
  for (const std::string& log : {cluster_->coordinator().Log(), workers[0].Log()}) {
    EXPECT_EQ(log.find("job-4f7d2c"), std::string::npos);
    EXPECT_EQ(log.find("admin-9a1e6b"), std::string::npos);
  }
}

TEST_F(SecurityTest, MutualTlsAdmitsOnlyClientsWithACertificateFromTheClientCa) {
  MakeCertificates();
  StartCoordinator({"--tls-cert", File("server.crt"), "--tls-key", File("server.key"),
                    "--tls-client-ca", File("ca.crt")});
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

  std::vector<Process> workers;
  for (const char* id : {"w0", "w1"}) workers.push_back(cluster_->StartWorker(id, tls));
  CommandResult ready = Shardctl(tls, {"wait", "--wait-timeout", "30s"});
  ASSERT_EQ(ready.exit_code, 0) << ready.output << cluster_->coordinator().Log()
                                << workers[0].Log();
  EXPECT_EQ(Shardctl(tls, {"stop"}).exit_code, 0);
  EXPECT_EQ(cluster_->coordinator().Wait(absl::Seconds(30)), 0);
  for (Process& worker : workers) EXPECT_EQ(worker.Wait(absl::Seconds(10)), 0) << worker.Log();
}

// grpc.health.v1.Health/Check with an empty request (service ""): the response's status
// field (1: SERVING, 2: NOT_SERVING), or -1 when the call fails.
int HealthStatus(const std::string& address) {
  grpc::GenericStub stub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  grpc::ByteBuffer request;
  grpc::ByteBuffer response;
  grpc::Status result;
  std::mutex mu;
  std::condition_variable done_cv;
  bool done = false;
  grpc::Slice empty;
  request = grpc::ByteBuffer(&empty, 1);
  stub.UnaryCall(&context, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &request,
                 &response, [&](grpc::Status status) {
                   std::lock_guard<std::mutex> lock(mu);
                   result = status;
                   done = true;
                   done_cv.notify_all();
                 });
  std::unique_lock<std::mutex> lock(mu);
  done_cv.wait(lock, [&] { return done; });
  if (!result.ok()) return -1;
  std::vector<grpc::Slice> slices;
  if (!response.Dump(&slices).ok()) return -1;
  std::string bytes;
  for (const grpc::Slice& slice : slices) {
    bytes.append(reinterpret_cast<const char*>(slice.begin()), slice.size());
  }
  // One varint field: tag 0x08, then the enum value.
  return bytes.size() == 2 && bytes[0] == 0x08 ? bytes[1] : -1;
}

TEST_F(SecurityTest, TheHealthPortAnswersInPlaintextWhileTheMainPortRequiresTls) {
  MakeCertificates();
  const int health_port = FreePort();
  StartCoordinator({"--tls-cert", File("server.crt"), "--tls-key", File("server.key"),
                    "--health-listen", absl::StrCat("127.0.0.1:", health_port)});
  EXPECT_EQ(HealthStatus(absl::StrCat("127.0.0.1:", health_port)), 1) << "SERVING";
  EXPECT_EQ(HealthStatus(cluster_->address()), -1) << "the main port speaks TLS only";
}

TEST_F(SecurityTest, MetricsShowTheWorldItsWorkersAndTheirCalls) {
  const int metrics_port = FreePort();
  StartCoordinator({"--metrics-listen", absl::StrCat("127.0.0.1:", metrics_port)});
  std::vector<Process> workers;
  for (const char* id : {"w0", "w1"}) workers.push_back(cluster_->StartWorker(id));
  ASSERT_EQ(cluster_->Shardctl({"wait", "--wait-timeout", "30s"}).exit_code, 0);
  httplib::Client client("127.0.0.1", metrics_port);
  httplib::Result page = client.Get("/metrics");
  ASSERT_TRUE(page) << httplib::to_string(page.error());
  EXPECT_EQ(page->status, 200);
  for (const char* line :
       {"shard_world_size 2\n", "shard_worker_up{worker=\"w0\",rank=", "shard_generation ",
        "shard_rpc_requests_total{method=\"shard.v1.Coordinator/Join\",code=\"OK\"} 2\n"}) {
    EXPECT_NE(page->body.find(line), std::string::npos) << line << "\n" << page->body;
  }
  EXPECT_EQ(cluster_->Shardctl({"stop"}).exit_code, 0);
  for (Process& worker : workers) EXPECT_EQ(worker.Wait(absl::Seconds(10)), 0);
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
