// The coordinator's Prometheus metrics, read back from the page a scrape gets (writing the text
// format is prometheus-cpp's job; what we check is which series we expose and their values): the
// RPC interceptor against a real in-process callback server, the scrape-time gauges from real
// managers, and the HTTP endpoint through a real HTTP client.
#include "server/metrics.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/notification.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "httplib.h"
#include "server/checkpoint_manager.h"
#include "server/snapshot_manager.h"
#include "server/checkpoint_storage.h"
#include "server/plan_manager.h"
#include "server/store/state_store.h"
#include "server/world_manager.h"
#include "shard/v1/coordinator.grpc.pb.h"

namespace shard {
namespace {

// The samples of a scrape: "name{labels}" as written (prometheus-cpp orders the labels by
// name) -> value. A line that is not "SERIES VALUE" fails the test.
std::map<std::string, double> Samples(const std::string& text) {
  std::map<std::string, double> samples;
  for (absl::string_view line : absl::StrSplit(text, '\n', absl::SkipEmpty())) {
    if (absl::StartsWith(line, "#")) continue;
    const size_t space = line.rfind(' ');
    double value = 0;
    EXPECT_TRUE(space != absl::string_view::npos &&
                absl::SimpleAtod(line.substr(space + 1), &value))
        << line;
    samples[std::string(line.substr(0, space))] = value;
  }
  return samples;
}

// The value of `series` in `samples`, or NaN if it is absent (so that a comparison fails).
double Sample(const std::map<std::string, double>& samples, const std::string& series) {
  auto found = samples.find(series);
  return found != samples.end() ? found->second : std::nan("");
}

// The page that RenderCoordinatorMetrics() makes of the RPC metrics alone.
std::string RpcPage(const RpcMetrics& metrics) {
  CoordinatorMetricsSources sources;
  sources.rpc = &metrics;
  return RenderCoordinatorMetrics(sources, absl::Now());
}

// shard_rpc_requests_total{code="OK",method="x.Y/A"} and the like.
std::string Requests(absl::string_view method, absl::string_view code) {
  return absl::StrCat("shard_rpc_requests_total{code=\"", code, "\",method=\"", method, "\"}");
}

// A series labelled by method alone: shard_rpc_in_flight{method="x.Y/A"} and the like.
std::string OfMethod(absl::string_view name, absl::string_view method) {
  return absl::StrCat(name, "{method=\"", method, "\"}");
}

// --- RPC metrics through a real callback server --------------------------------------------------

// Answers GetStatus: OK, or NOT_FOUND when asked with the metadata "fail".
class StubAdmin final : public v1::Admin::CallbackService {
 public:
  grpc::ServerUnaryReactor* GetStatus(grpc::CallbackServerContext* context,
                                      const v1::GetStatusRequest*,
                                      v1::GetStatusResponse* response) override {
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    if (context->client_metadata().count("fail") > 0) {
      reactor->Finish(grpc::Status(grpc::StatusCode::NOT_FOUND, "asked to fail"));
    } else {
      response->set_job("stub");
      reactor->Finish(grpc::Status::OK);
    }
    return reactor;
  }
};

TEST(RpcMetricsTest, TheInterceptorCountsCallsOfACallbackService) {
  RpcMetrics metrics({"shard.v1.Admin/GetStatus"});
  StubAdmin service;
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&service);
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> creators;
  creators.push_back(MakeRpcMetricsInterceptorFactory(&metrics));
  builder.experimental().SetInterceptorCreators(std::move(creators));
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  ASSERT_GT(port, 0);

  auto channel =
      grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials());
  auto stub = v1::Admin::NewStub(channel);
  for (int i = 0; i < 3; ++i) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    v1::GetStatusResponse response;
    grpc::Status status = stub->GetStatus(&context, v1::GetStatusRequest(), &response);
    ASSERT_TRUE(status.ok()) << status.error_message();
    EXPECT_EQ(response.job(), "stub");
  }
  {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    context.AddMetadata("fail", "1");
    v1::GetStatusResponse response;
    EXPECT_EQ(stub->GetStatus(&context, v1::GetStatusRequest(), &response).error_code(),
              grpc::StatusCode::NOT_FOUND);
  }
  // A method the server does not have.
  {
    grpc::GenericStub generic(channel);
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    grpc::Slice empty("");
    grpc::ByteBuffer request(&empty, 1);
    grpc::ByteBuffer response;
    grpc::Status status;
    absl::Notification done;
    generic.UnaryCall(&context, "/shard.v1.Admin/NoSuchMethod", grpc::StubOptions(), &request,
                      &response, [&](grpc::Status s) {
                        status = std::move(s);
                        done.Notify();
                      });
    done.WaitForNotification();
    EXPECT_EQ(status.error_code(), grpc::StatusCode::UNIMPLEMENTED);
  }
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  server->Wait();

  const std::string text = RpcPage(metrics);
  const std::map<std::string, double> samples = Samples(text);
  const std::string method = "shard.v1.Admin/GetStatus";
  EXPECT_EQ(Sample(samples, Requests(method, "OK")), 3) << text;
  EXPECT_EQ(Sample(samples, Requests(method, "NOT_FOUND")), 1) << text;
  EXPECT_EQ(Sample(samples, OfMethod("shard_rpc_duration_seconds_count", method)), 4) << text;
  EXPECT_EQ(Sample(samples, absl::StrCat("shard_rpc_duration_seconds_bucket{method=\"", method,
                                         "\",le=\"+Inf\"}")),
            4)
      << text;
  EXPECT_EQ(Sample(samples, OfMethod("shard_rpc_in_flight", method)), 0) << text;
  // A method the server lacks goes through the interceptors too: counted as "other".
  EXPECT_EQ(Sample(samples, Requests("other", "UNIMPLEMENTED")), 1) << text;
  EXPECT_FALSE(absl::StrContains(text, "NoSuchMethod")) << text;
}

TEST(RpcMetricsTest, MethodsTheServerDoesNotServeAreCountedAsOther) {
  RpcMetrics metrics({"x.Y/Served"});
  for (int i = 0; i < 200; ++i) {
    const std::string method = absl::StrCat("/x.Y/M", i);
    metrics.Begin(method);
    metrics.End(method, grpc::StatusCode::UNIMPLEMENTED, absl::Milliseconds(1));
  }
  metrics.Begin("/x.Y/Served");
  metrics.End("/x.Y/Served", grpc::StatusCode::OK, absl::Milliseconds(1));
  const std::string text = RpcPage(metrics);
  const std::map<std::string, double> samples = Samples(text);
  EXPECT_EQ(Sample(samples, Requests("other", "UNIMPLEMENTED")), 200) << text;
  EXPECT_EQ(Sample(samples, OfMethod("shard_rpc_duration_seconds_count", "other")), 200) << text;
  EXPECT_EQ(Sample(samples, Requests("x.Y/Served", "OK")), 1) << text;
  EXPECT_FALSE(absl::StrContains(text, "x.Y/M0")) << text;
}

TEST(RpcMetricsTest, ACodeOutsideGrpcsIsCountedAsUnknown) {
  RpcMetrics metrics({"x.Y/A"});
  metrics.Begin("/x.Y/A");
  metrics.End("/x.Y/A", static_cast<grpc::StatusCode>(99), absl::Milliseconds(1));
  const std::string text = RpcPage(metrics);
  EXPECT_EQ(Sample(Samples(text), Requests("x.Y/A", "UNKNOWN")), 1) << text;
}

TEST(RpcMetricsTest, EverySeriesReadsZeroBeforeItsFirstCall) {
  RpcMetrics metrics({"x.Y/A", "x.Y/B"});
  const std::string text = RpcPage(metrics);
  const std::map<std::string, double> samples = Samples(text);
  for (const char* method : {"x.Y/A", "x.Y/B", "other"}) {
    for (const char* code : {"OK", "CANCELLED", "UNAVAILABLE", "UNAUTHENTICATED"}) {
      EXPECT_EQ(Sample(samples, Requests(method, code)), 0) << method << " " << code << "\n"
                                                            << text;
    }
    EXPECT_EQ(Sample(samples, OfMethod("shard_rpc_duration_seconds_count", method)), 0) << text;
    EXPECT_EQ(Sample(samples, OfMethod("shard_rpc_in_flight", method)), 0) << text;
  }
  // 17 codes for each of the three methods, nothing else.
  EXPECT_EQ(std::count_if(samples.begin(), samples.end(),
                          [](const auto& sample) {
                            return absl::StartsWith(sample.first, "shard_rpc_requests_total{");
                          }),
            3 * 17)
      << text;
}

TEST(RpcMetricsTest, ConcurrentCallsAreAllCounted) {
  RpcMetrics metrics({"x.Y/A"});
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&metrics, t] {
      // Half the threads call a served method, half an unserved one, while pages are written.
      const std::string method = t % 2 == 0 ? "/x.Y/A" : "/x.Y/Unserved";
      for (int i = 0; i < 1000; ++i) {
        metrics.Begin(method);
        metrics.End(method, grpc::StatusCode::OK, absl::Microseconds(i));
        if (i % 100 == 0) RpcPage(metrics);
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  const std::map<std::string, double> samples = Samples(RpcPage(metrics));
  for (const char* method : {"x.Y/A", "other"}) {
    EXPECT_EQ(Sample(samples, Requests(method, "OK")), 2000) << method;
    EXPECT_EQ(Sample(samples, OfMethod("shard_rpc_duration_seconds_count", method)), 2000)
        << method;
    EXPECT_EQ(Sample(samples, OfMethod("shard_rpc_in_flight", method)), 0) << method;
  }
}

TEST(RpcMetricsTest, MethodNamesComeFromTheServiceDescriptor) {
  const google::protobuf::ServiceDescriptor* admin =
      google::protobuf::DescriptorPool::generated_pool()->FindServiceByName("shard.v1.Admin");
  ASSERT_NE(admin, nullptr);
  const std::vector<std::string> names = MethodNames(*admin);
  EXPECT_EQ(static_cast<int>(names.size()), admin->method_count());
  EXPECT_NE(std::find(names.begin(), names.end(), "shard.v1.Admin/GetStatus"), names.end());
}

// --- The coordinator's gauges from real managers -------------------------------------------------

JoinParams Worker(const std::string& id) {
  JoinParams params;
  params.worker_id = id;
  params.host = "127.0.0.1";
  params.device = "cpu";
  params.incarnation = 1;
  return params;
}

TEST(CoordinatorMetricsTest, GaugesComeFromTheManagersSnapshots) {
  const absl::Time started = absl::FromUnixSeconds(1700000000);
  absl::Time now = started + absl::Seconds(90);
  InMemoryStateStore store;
  WorldOptions options;
  options.job = "metrics";
  options.expected_world_size = 2;
  options.lease = absl::Seconds(10);
  auto world = WorldManager::Create(options, &store, now);
  ASSERT_TRUE(world.ok()) << world.status();
  ASSERT_TRUE((*world)->Join(Worker("w0"), now).ok());
  ASSERT_TRUE((*world)->Join(Worker("w1"), now).ok());
  const int64_t generation = (*world)->world().generation;
  for (const char* id : {"w0", "w1"}) {
    ASSERT_TRUE((*world)->ReportSelfCheck(id, 1, generation, true, "", now).ok());
  }
  now += absl::Seconds(3);
  ASSERT_TRUE((*world)->Heartbeat("w0", 1, now).ok());

  PlanManager plans{PlanConfig{}};
  plans.OnGeneration(generation);
  for (int rank = 0; rank < 2; ++rank) {
    for (int step = 1; step <= 5; ++step) {
      StepReport report;
      report.step = step;
      report.step_ms = rank == 0 ? 20 : 30;
      report.communication_ms = 4;
      report.hidden_ms = 3;
      report.bucket_bytes = {1000, 24};
      report.loss = 0.5;
      report.held_bytes = rank == 0 ? 4096 : 4160;
      report.gathered_units = 2;
      report.gather_wait_ms = 1.5;
      auto reported = plans.ReportStepStats(MemberRef{absl::StrCat("w", rank), rank, generation, 2},
                                            report, absl::Now());
      ASSERT_TRUE(reported.ok()) << reported;
    }
  }

  // A catalog with two committed checkpoints (their manifests on disk).
  const std::string root = ::testing::TempDir() + "/shard-metrics-test";
  std::filesystem::remove_all(root);
  v1::CheckpointCatalog catalog;
  for (int i = 1; i <= 2; ++i) {
    v1::CheckpointRecord* record = catalog.add_checkpoints();
    record->set_id(absl::StrCat("step-", i * 100));
    record->set_step(i * 100);
    record->set_world_size(2);
    record->set_dir(absl::StrCat(root, "/metrics/", record->id()));
    record->set_bytes(4096 * i);
    record->set_committed_unix_ms(1700000000000 + i * 1500);
    record->set_request(i);
    record->set_max_pause_ms(12.5 * i);
    record->set_max_write_ms(250 * i);
    std::filesystem::create_directories(record->dir());
    std::ofstream(record->dir() + "/manifest.json") << "{}";
  }
  ASSERT_TRUE(store.Save("checkpoints", catalog).ok());
  CheckpointOptions checkpoint_options;
  checkpoint_options.job = "metrics";
  checkpoint_options.root = root;
  FilesystemCheckpointStorage storage;
  auto checkpoints = CheckpointManager::Create(checkpoint_options, &store, &storage, generation,
                                               /*generation_kept=*/false);
  ASSERT_TRUE(checkpoints.ok()) << checkpoints.status();
  ASSERT_EQ((*checkpoints)->List().size(), 2u);

  // A snapshot of step 5 that both workers hold, each shard once; one of step 10 only taken.
  SnapshotManager snapshots(SnapshotOptions{.replicas = 1});
  for (int rank = 0; rank < 2; ++rank) {
    for (int64_t step : {5, 10}) {
      if (step == 10 && rank == 1) continue;
      SnapshotShard shard;
      shard.id = SnapshotId(step, generation);
      shard.generation = generation;
      shard.step = step;
      shard.rank = rank;
      shard.plan.world_size = 2;
      shard.counters.optimizer_step = step;
      shard.record = ShardRecord{ShardFileName(rank, 2), rank, 8, "00", {"00"}, {}};
      SnapshotReport report;
      report.worker_id = absl::StrCat("w", rank);
      report.incarnation = 1;
      report.held = {shard};
      report.snapshot_address = "127.0.0.1:1";
      ASSERT_TRUE(snapshots.Report(report, now - absl::Seconds(2)).ok());
    }
  }

  RpcMetrics rpc({"shard.v1.Coordinator/Join"});
  rpc.Begin("/shard.v1.Coordinator/Join");
  rpc.End("/shard.v1.Coordinator/Join", grpc::StatusCode::OK, absl::Milliseconds(2));

  CoordinatorMetricsSources sources;
  sources.world = world->get();
  sources.plan = &plans;
  sources.checkpoints = checkpoints->get();
  sources.snapshots = &snapshots;
  sources.rpc = &rpc;
  sources.started = started;
  const std::string text = RenderCoordinatorMetrics(sources, now);

  const std::map<std::string, double> samples = Samples(text);
  for (const auto& [series, value] : std::vector<std::pair<std::string, double>>{
           {"shard_coordinator_start_time_seconds", 1700000000},
           {"shard_coordinator_uptime_seconds", 93},
           {"shard_job_state{state=\"running\"}", 1},
           {"shard_job_state{state=\"forming\"}", 0},
           {"shard_generation", generation},
           {"shard_world_size", 2},
           {"shard_world_ranks", 2},
           {"shard_world_target_size", 2},
           {"shard_worker_lease_seconds", 10},
           {"shard_workers{state=\"ready\"}", 2},
           {"shard_workers{state=\"joining\"}", 0},
           {"shard_workers{state=\"dead\"}", 0},
           {"shard_worker_up{rank=\"0\",worker=\"w0\"}", 1},
           {"shard_worker_up{rank=\"1\",worker=\"w1\"}", 1},
           {"shard_worker_last_heartbeat_seconds{worker=\"w0\"}", 0},
           {"shard_worker_last_heartbeat_seconds{worker=\"w1\"}", 3},
           {"shard_training_step", 5},
           {"shard_step_duration_seconds", 0.02},
           {"shard_step_duration_mean_seconds", 0.025},
           {"shard_training_loss", 0.5},
           {"shard_step_reduced_bytes", 1024},
           {"shard_overlap_hidden_ratio", 0.75},
           {"shard_rank_model_state_bytes{rank=\"0\"}", 4096},
           {"shard_rank_model_state_bytes{rank=\"1\"}", 4160},
           {"shard_rank_gathered_units{rank=\"1\"}", 2},
           {"shard_rank_gather_wait_seconds{rank=\"0\"}", 0.0015},
           {"shard_checkpoints_committed", 2},
           {"shard_checkpoint_last_step", 200},
           {"shard_checkpoint_last_commit_timestamp_seconds", 1700000003},
           {"shard_checkpoint_save_duration_seconds", 0.5},
           {"shard_checkpoint_pause_seconds", 0.025},
           {"shard_checkpoint_bytes", 8192},
           {"shard_checkpoint_save_pending", 0},
           {"shard_snapshot_last_step", 5},
           {"shard_snapshot_age_seconds", 2},
           {"shard_snapshot_copies", 1},
           {"shard_snapshot_replica_lag_steps", 10},
           {"shard_snapshot_replica_lag_seconds", 2},
           {"shard_restores_total{source=\"memory\"}", 0},
           {"shard_restores_total{source=\"disk\"}", 0},
           {Requests("shard.v1.Coordinator/Join", "OK"), 1},
       }) {
    EXPECT_DOUBLE_EQ(Sample(samples, series), value) << series << "\n" << text;
  }
  EXPECT_TRUE(absl::StrContains(text, "\n# TYPE shard_rpc_requests_total counter\n")) << text;
  // A family's series are in the order of their labels, whatever prometheus-cpp's hash map holds.
  EXPECT_TRUE(absl::StrContains(text,
                                "shard_workers{state=\"dead\"} 0\n"
                                "shard_workers{state=\"failed\"} 0\n"
                                "shard_workers{state=\"joining\"} 0\n"
                                "shard_workers{state=\"leaving\"} 0\n"
                                "shard_workers{state=\"left\"} 0\n"
                                "shard_workers{state=\"ready\"} 2\n"
                                "shard_workers{state=\"standby\"} 0\n"))
      << text;

  // A worker past its lease is dead: counted so, and down.
  now += absl::Seconds(30);
  (*world)->ExpireLeases(now);
  const std::string later = RenderCoordinatorMetrics(sources, now);
  const std::map<std::string, double> later_samples = Samples(later);
  EXPECT_EQ(Sample(later_samples, "shard_workers{state=\"dead\"}"), 2) << later;
  EXPECT_EQ(Sample(later_samples, "shard_worker_up{rank=\"\",worker=\"w0\"}"), 0) << later;
  EXPECT_EQ(Sample(later_samples, "shard_world_size"), 0) << later;
  std::filesystem::remove_all(root);
}

TEST(CoordinatorMetricsTest, WithoutAJobOrStepsThereAreNoTrainingValues) {
  InMemoryStateStore store;
  WorldOptions options;
  options.expected_world_size = 3;
  const absl::Time now = absl::FromUnixSeconds(1700000000);
  auto world = WorldManager::Create(options, &store, now);
  ASSERT_TRUE(world.ok()) << world.status();
  PlanManager plans{PlanConfig{}};
  CoordinatorMetricsSources sources;
  sources.world = world->get();
  sources.plan = &plans;
  sources.started = now;
  const std::string text = RenderCoordinatorMetrics(sources, now);
  const std::map<std::string, double> samples = Samples(text);
  EXPECT_EQ(Sample(samples, "shard_world_size"), 0) << text;
  EXPECT_EQ(Sample(samples, "shard_world_target_size"), 3) << text;
  EXPECT_EQ(Sample(samples, "shard_job_state{state=\"forming\"}"), 1) << text;
  EXPECT_EQ(Sample(samples, "shard_training_step"), 0) << text;
  EXPECT_EQ(Sample(samples, "shard_overlap_status{status=\"UNINITIALIZED\"}"), 1) << text;
  EXPECT_FALSE(absl::StrContains(text, "shard_training_loss")) << text;
  EXPECT_FALSE(absl::StrContains(text, "shard_checkpoint")) << text;
  EXPECT_FALSE(absl::StrContains(text, "shard_rpc_")) << text;
}

// --- The HTTP endpoint ---------------------------------------------------------------------------

TEST(MetricsHttpServerTest, ServesMetricsAndNothingElse) {
  std::atomic<int> scrapes{0};
  auto server = MetricsHttpServer::Start("127.0.0.1:0", [&scrapes] {
    ++scrapes;
    return std::string("# HELP test_up Up.\n# TYPE test_up gauge\ntest_up 1\n");
  });
  ASSERT_TRUE(server.ok()) << server.status();
  ASSERT_GT((*server)->port(), 0);
  EXPECT_EQ((*server)->address(), absl::StrCat("127.0.0.1:", (*server)->port()));

  httplib::Client client("127.0.0.1", (*server)->port());
  client.set_connection_timeout(5);
  client.set_read_timeout(5);
  client.set_keep_alive(true);  // one connection, still open when the server stops
  httplib::Result metrics = client.Get("/metrics");
  ASSERT_TRUE(metrics) << httplib::to_string(metrics.error());
  EXPECT_EQ(metrics->status, 200);
  EXPECT_EQ(metrics->get_header_value("Content-Type"), "text/plain; version=0.0.4; charset=utf-8");
  EXPECT_EQ(metrics->body, "# HELP test_up Up.\n# TYPE test_up gauge\ntest_up 1\n");
  EXPECT_EQ(scrapes.load(), 1);
  httplib::Result head = client.Head("/metrics");
  ASSERT_TRUE(head);
  EXPECT_EQ(head->status, 200);
  EXPECT_EQ(head->body, "");

  for (const char* path : {"/", "/metrics/x", "/favicon.ico"}) {
    httplib::Result other = client.Get(path);
    ASSERT_TRUE(other) << path;
    EXPECT_EQ(other->status, 404) << path;
  }
  httplib::Result post = client.Post("/metrics", "x", "text/plain");
  ASSERT_TRUE(post);
  EXPECT_EQ(post->status, 404);
  EXPECT_EQ(scrapes.load(), 2);  // the HEAD rendered too

  // Stopping joins the threads, with a client still connected (keep-alive).
  server->reset();
  httplib::Result after = client.Get("/metrics");
  EXPECT_FALSE(after);
}

TEST(MetricsHttpServerTest, APortInUseAndBadAddressesAreClearErrors) {
  auto first = MetricsHttpServer::Start("127.0.0.1:0", [] { return std::string(); });
  ASSERT_TRUE(first.ok()) << first.status();
  auto second = MetricsHttpServer::Start(absl::StrCat("127.0.0.1:", (*first)->port()),
                                         [] { return std::string(); });
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), absl::StatusCode::kFailedPrecondition) << second.status();
  EXPECT_TRUE(absl::StrContains(second.status().message(), "in use")) << second.status();

  for (const char* bad : {"", "127.0.0.1", ":9460", "127.0.0.1:", "127.0.0.1:x",
                          "127.0.0.1:65536", "::1:9460", "[::1:9460"}) {
    auto server = MetricsHttpServer::Start(bad, [] { return std::string(); });
    ASSERT_FALSE(server.ok()) << bad;
    EXPECT_EQ(server.status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
  auto unresolvable = MetricsHttpServer::Start("no-such-host.invalid:0", [] { return ""; });
  ASSERT_FALSE(unresolvable.ok());
  EXPECT_EQ(unresolvable.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(unresolvable.status().message(), "cannot resolve"))
      << unresolvable.status();
}

}  // namespace
}  // namespace shard
