// The access table derived from the contract's (shard.v1.access) options, and the guard's
// decisions on it, without a server: the processor is called as gRPC calls it.
#include "server/access_guard.h"

#include <map>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "google/protobuf/descriptor.pb.h"
#include "grpcpp/security/auth_context.h"
#include "gtest/gtest.h"
#include "shard/v1/coordinator.pb.h"

namespace shard {
namespace {

using v1::ACCESS_ADMIN;
using v1::ACCESS_READ;
using v1::ACCESS_WORKER;

constexpr char kJob[] = "job-4f7d2c";
constexpr char kAdmin[] = "admin-9a1e6b";

const google::protobuf::FileDescriptor& Contract() { return *v1::Access_descriptor()->file(); }

AccessTable ContractTable() {
  absl::StatusOr<AccessTable> table = AccessTableOf(Contract());
  EXPECT_TRUE(table.ok()) << table.status();
  return table.ok() ? *table : AccessTable();
}

AccessGuard Guard(const std::string& job_token, const std::string& admin_token,
                  RpcMetrics* metrics = nullptr) {
  return AccessGuard(ContractTable(), job_token, admin_token, metrics);
}

std::string Bearer(absl::string_view token) { return absl::StrCat("Bearer ", token); }

TEST(AccessTableTest, EveryRpcOfTheContractIsClassifiedAsTheHandlersWere) {
  // Who may call what, rpc by rpc: a new rpc fails here until its class is chosen on purpose.
  const absl::flat_hash_map<std::string, v1::Access> expected = {
      {"/shard.v1.Coordinator/Join", ACCESS_WORKER},
      {"/shard.v1.Coordinator/Heartbeat", ACCESS_WORKER},
      {"/shard.v1.Coordinator/ReportSelfCheck", ACCESS_WORKER},
      {"/shard.v1.Coordinator/Leave", ACCESS_WORKER},
      {"/shard.v1.Coordinator/RegisterManifest", ACCESS_WORKER},
      {"/shard.v1.Coordinator/AckPlan", ACCESS_WORKER},
      {"/shard.v1.Coordinator/ReportGradientOrder", ACCESS_WORKER},
      {"/shard.v1.Coordinator/ReportStepStats", ACCESS_WORKER},
      {"/shard.v1.Coordinator/ReportTrainingDone", ACCESS_WORKER},
      {"/shard.v1.Coordinator/ReportCheckpointShard", ACCESS_WORKER},
      {"/shard.v1.Coordinator/ReportSnapshot", ACCESS_WORKER},
      {"/shard.v1.Coordinator/GetRestoreSnapshot", ACCESS_WORKER},
      {"/shard.v1.Coordinator/ReportRestore", ACCESS_WORKER},
      {"/shard.v1.Rendezvous/Set", ACCESS_WORKER},
      {"/shard.v1.Rendezvous/Get", ACCESS_WORKER},
      {"/shard.v1.Rendezvous/Wait", ACCESS_WORKER},
      {"/shard.v1.Admin/GetStatus", ACCESS_READ},
      {"/shard.v1.Admin/GetPlan", ACCESS_READ},
      {"/shard.v1.Admin/GetStats", ACCESS_READ},
      {"/shard.v1.Admin/SaveCheckpoint", ACCESS_ADMIN},
      {"/shard.v1.Admin/GetSaveProgress", ACCESS_READ},
      {"/shard.v1.Admin/ListCheckpoints", ACCESS_READ},
      {"/shard.v1.Admin/GetCheckpoint", ACCESS_READ},
      {"/shard.v1.Admin/DeleteCheckpoint", ACCESS_ADMIN},
      {"/shard.v1.Admin/RestoreCheckpoint", ACCESS_ADMIN},
      {"/shard.v1.Admin/Stop", ACCESS_ADMIN},
      {"/shard.v1.Admin/Resize", ACCESS_ADMIN},
      {"/shard.v1.Admin/Drain", ACCESS_ADMIN},
      {"/shard.v1.Admin/ListEvents", ACCESS_READ},
  };
  EXPECT_EQ(ContractTable(), expected);
}

TEST(AccessTableTest, TheTableCoversEveryMethodOfTheThreeServices) {
  int methods = 0;
  for (const char* name : {"shard.v1.Coordinator", "shard.v1.Rendezvous", "shard.v1.Admin"}) {
    const google::protobuf::ServiceDescriptor* service =
        google::protobuf::DescriptorPool::generated_pool()->FindServiceByName(name);
    ASSERT_NE(service, nullptr) << name;
    ASSERT_EQ(service->file(), &Contract()) << name;
    for (int m = 0; m < service->method_count(); ++m, ++methods) {
      EXPECT_NE(service->method(m)->options().GetExtension(v1::access), v1::ACCESS_UNSPECIFIED)
          << service->method(m)->full_name();
    }
  }
  EXPECT_EQ(Contract().service_count(), 3);
  EXPECT_EQ(ContractTable().size(), static_cast<size_t>(methods));
}

TEST(AccessTableTest, AnRpcWithoutAnAccessOptionIsAnErrorNamingIt) {
  google::protobuf::FileDescriptorProto file;
  file.set_name("x/v1/open.proto");
  file.set_package("x.v1");
  file.set_syntax("proto3");
  file.add_message_type()->set_name("Empty");
  google::protobuf::ServiceDescriptorProto* service = file.add_service();
  service->set_name("Backdoor");
  google::protobuf::MethodDescriptorProto* method = service->add_method();
  method->set_name("Open");
  method->set_input_type(".x.v1.Empty");
  method->set_output_type(".x.v1.Empty");
  google::protobuf::DescriptorPool pool;
  const google::protobuf::FileDescriptor* built = pool.BuildFile(file);
  ASSERT_NE(built, nullptr);
  absl::StatusOr<AccessTable> table = AccessTableOf(*built);
  ASSERT_FALSE(table.ok());
  EXPECT_NE(table.status().message().find("x.v1.Backdoor.Open"), std::string::npos)
      << table.status();
  EXPECT_NE(table.status().message().find("(shard.v1.access)"), std::string::npos)
      << table.status();
}

TEST(AccessGuardTest, WithoutTokensEveryCallIsOpen) {
  const AccessGuard guard = Guard("", "");
  for (const auto& [path, access] : ContractTable()) {
    EXPECT_TRUE(guard.Check(path, "").ok()) << path;
  }
  EXPECT_TRUE(guard.Check("/other.Service/Method", "").ok());
}

TEST(AccessGuardTest, WorkerCallsNeedTheJobToken) {
  const AccessGuard guard = Guard(kJob, kAdmin);
  const absl::Status missing = guard.Check("/shard.v1.Rendezvous/Wait", "");
  EXPECT_EQ(missing.code(), absl::StatusCode::kUnauthenticated);
  EXPECT_NE(missing.message().find("--job-token-file"), std::string::npos) << missing;
  const absl::Status admin = guard.Check("/shard.v1.Coordinator/Join", Bearer(kAdmin));
  EXPECT_EQ(admin.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_NE(admin.message().find("not valid"), std::string::npos) << admin;
  EXPECT_NE(admin.message().find("--job-token-file"), std::string::npos) << admin;
  EXPECT_TRUE(guard.Check("/shard.v1.Coordinator/Join", Bearer(kJob)).ok());
}

TEST(AccessGuardTest, ReadCallsTakeEitherTokenAndAdminCallsOnlyTheAdminOne) {
  const AccessGuard guard = Guard(kJob, kAdmin);
  const absl::Status anonymous = guard.Check("/shard.v1.Admin/GetStatus", "");
  EXPECT_EQ(anonymous.code(), absl::StatusCode::kUnauthenticated);
  EXPECT_NE(anonymous.message().find("--admin-token-file"), std::string::npos) << anonymous;
  EXPECT_TRUE(guard.Check("/shard.v1.Admin/GetStatus", Bearer(kJob)).ok());
  EXPECT_TRUE(guard.Check("/shard.v1.Admin/GetStatus", Bearer(kAdmin)).ok());
  EXPECT_EQ(guard.Check("/shard.v1.Admin/GetStatus", Bearer("guess")).code(),
            absl::StatusCode::kPermissionDenied);

  const absl::Status as_worker = guard.Check("/shard.v1.Admin/Stop", Bearer(kJob));
  EXPECT_EQ(as_worker.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_NE(as_worker.message().find("admin token"), std::string::npos) << as_worker;
  EXPECT_EQ(guard.Check("/shard.v1.Admin/Stop", "").code(), absl::StatusCode::kUnauthenticated);
  EXPECT_TRUE(guard.Check("/shard.v1.Admin/Stop", Bearer(kAdmin)).ok());
}

TEST(AccessGuardTest, OnlyABearerTokenCounts) {
  const AccessGuard guard = Guard(kJob, kAdmin);
  for (const std::string& header : {std::string(kAdmin), absl::StrCat("Basic ", kAdmin),
                                    std::string("Bearer "), absl::StrCat("bearer ", kAdmin)}) {
    EXPECT_EQ(guard.Check("/shard.v1.Admin/Stop", header).code(),
              absl::StatusCode::kUnauthenticated)
        << header;
  }
  // A prefix or an extension of the right token is not the right token.
  for (const std::string& token : {std::string(kAdmin).substr(0, 5), absl::StrCat(kAdmin, "x")}) {
    EXPECT_EQ(guard.Check("/shard.v1.Admin/Stop", Bearer(token)).code(),
              absl::StatusCode::kPermissionDenied)
        << token;
  }
}

TEST(AccessGuardTest, HealthAndReflectionAreOpenAndUnknownPathsNeedTheAdminToken) {
  const AccessGuard guard = Guard(kJob, kAdmin);
  EXPECT_TRUE(guard.Check("/grpc.health.v1.Health/Check", "").ok());
  EXPECT_TRUE(guard.Check("/grpc.health.v1.Health/Watch", "").ok());
  EXPECT_TRUE(
      guard.Check("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", "").ok());
  for (const char* path : {"/shard.v1.Admin/NotYetClassified", "/other.Service/Method", ""}) {
    EXPECT_EQ(guard.Check(path, Bearer(kJob)).code(), absl::StatusCode::kPermissionDenied)
        << path;
    EXPECT_TRUE(guard.Check(path, Bearer(kAdmin)).ok()) << path;
  }
}

TEST(AccessGuardTest, NoMessageEchoesAToken) {
  const AccessGuard guard = Guard(kJob, kAdmin);
  for (const auto& [path, access] : ContractTable()) {
    for (const char* token : {kJob, kAdmin, "job-4f7d2cX"}) {
      const absl::Status status = guard.Check(path, Bearer(token));
      EXPECT_EQ(status.ToString().find(token), std::string::npos) << status;
    }
  }
}

// The count of shard_rpc_requests_total{method, code} in `metrics`, or -1 if it has no such
// series.
double RequestCount(const RpcMetrics& metrics, const std::string& method,
                    const std::string& code) {
  for (const prometheus::MetricFamily& family : metrics.Collect()) {
    if (family.name != "shard_rpc_requests_total") continue;
    for (const prometheus::ClientMetric& metric : family.metric) {
      std::map<std::string, std::string> labels;
      for (const prometheus::ClientMetric::Label& label : metric.label) {
        labels[label.name] = label.value;
      }
      if (labels["method"] == method && labels["code"] == code) return metric.counter.value;
    }
  }
  return -1;
}

TEST(AccessGuardTest, TheProcessorReadsThePathAndTokenCountsRefusalsAndTakesTheTokenOff) {
  RpcMetrics metrics({"shard.v1.Admin/Stop"});
  AccessGuard guard = Guard(kJob, kAdmin, &metrics);
  const std::string stop = "/shard.v1.Admin/Stop";
  const std::string as_worker = Bearer(kJob);
  const std::string as_admin = Bearer(kAdmin);

  grpc::AuthMetadataProcessor::InputMetadata anonymous = {{":path", stop}};
  grpc::AuthMetadataProcessor::OutputMetadata consumed;
  grpc::AuthMetadataProcessor::OutputMetadata response;
  grpc::Status refused = guard.Process(anonymous, nullptr, &consumed, &response);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_NE(refused.error_message().find("--admin-token-file"), std::string::npos);

  grpc::AuthMetadataProcessor::InputMetadata worker = {{":path", stop},
                                                       {"authorization", as_worker}};
  EXPECT_EQ(guard.Process(worker, nullptr, &consumed, &response).error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_TRUE(consumed.empty());
  EXPECT_EQ(RequestCount(metrics, "shard.v1.Admin/Stop", "UNAUTHENTICATED"), 1);
  EXPECT_EQ(RequestCount(metrics, "shard.v1.Admin/Stop", "PERMISSION_DENIED"), 1);

  grpc::AuthMetadataProcessor::InputMetadata admin = {{":path", stop},
                                                      {"authorization", as_admin}};
  EXPECT_TRUE(guard.Process(admin, nullptr, &consumed, &response).ok());
  ASSERT_EQ(consumed.size(), 1u);
  EXPECT_EQ(consumed.begin()->first, "authorization");
  EXPECT_EQ(consumed.begin()->second, as_admin);
  // Calls let through are counted by the server's interceptor when they end, not here.
  EXPECT_EQ(RequestCount(metrics, "shard.v1.Admin/Stop", "OK"), 0);
}

}  // namespace
}  // namespace shard
