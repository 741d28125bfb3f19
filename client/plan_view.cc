#include "client/plan_view.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "client/status_view.h"

namespace shard {
namespace {

std::string Mode(const v1::PlanSpec& spec) { return EnumWord(v1::ShardMode_Name(spec.mode()), "SHARD_MODE_"); }

std::string HumanBytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int unit = 0;
  while (bytes >= 1024 && unit < 4) {
    bytes /= 1024;
    ++unit;
  }
  return unit == 0 ? absl::StrFormat("%.0f %s", bytes, units[unit])
                   : absl::StrFormat("%.2f %s", bytes, units[unit]);
}

std::string ParamsCell(const v1::BucketSummary& bucket) {
  if (bucket.params_size() <= 2) return absl::StrJoin(bucket.params(), ", ");
  return absl::StrCat(bucket.params(0), " .. ", bucket.params(bucket.params_size() - 1), " (",
                      bucket.params_size(), ")");
}

}  // namespace

nlohmann::json PlanToJson(const v1::PlanSummary& plan) {
  const v1::PlanSpec& spec = plan.spec();
  nlohmann::json buckets = nlohmann::json::array();
  for (const v1::BucketSummary& b : plan.buckets()) {
    buckets.push_back({{"index", b.index()},
                       {"dtype", b.dtype()},
                       {"params", std::vector<std::string>(b.params().begin(), b.params().end())},
                       {"numel", b.numel()},
                       {"padded_numel", b.padded_numel()},
                       {"owner", b.owner()}});
  }
  nlohmann::json ranks = nlohmann::json::array();
  for (const v1::RankSummary& r : plan.ranks()) {
    ranks.push_back({{"rank", r.rank()},
                     {"owned_numel", r.owned_numel()},
                     {"owned_bytes", r.owned_bytes()},
                     {"ranges", r.ranges()}});
  }
  return {{"version", spec.version()},
          {"hash", spec.hash()},
          {"manifest_hash", spec.manifest_hash()},
          {"generation", spec.generation()},
          {"world_size", spec.world_size()},
          {"mode", Mode(spec)},
          {"bucket_cap_bytes", spec.bucket_cap_bytes()},
          {"first_bucket_cap_bytes", spec.first_bucket_cap_bytes()},
          {"min_buckets", std::max(1, spec.min_buckets())},
          {"alignment_bytes", spec.alignment_bytes()},
          {"imbalance", plan.imbalance()},
          {"buckets", buckets},
          {"ranks", ranks}};
}

std::string PlanTable(const v1::PlanSummary& plan) {
  const v1::PlanSpec& spec = plan.spec();
  std::string out = absl::StrFormat(
      "plan v%d (hash %s) for %d ranks, %s mode, bucket cap %s (first %s, min buckets %d), "
      "%d buckets, imbalance %.4f\n\n",
      spec.version(), spec.hash(), spec.world_size(), Mode(spec),
      HumanBytes(spec.bucket_cap_bytes()), HumanBytes(spec.first_bucket_cap_bytes()),
      std::max(1, spec.min_buckets()), plan.buckets_size(), plan.imbalance());
  std::vector<std::vector<std::string>> buckets = {
      {"BUCKET", "DTYPE", "NUMEL", "PADDED", "OWNER", "PARAMS"}};
  for (const v1::BucketSummary& b : plan.buckets()) {
    buckets.push_back({absl::StrCat(b.index()), b.dtype(), absl::StrCat(b.numel()),
                       absl::StrCat(b.padded_numel()),
                       b.owner() >= 0 ? absl::StrCat(b.owner()) : "all", ParamsCell(b)});
  }
  absl::StrAppend(&out, RenderTable(buckets), "\n");
  std::vector<std::vector<std::string>> ranks = {{"RANK", "OWNED ELEMENTS", "OWNED", "RANGES"}};
  for (const v1::RankSummary& r : plan.ranks()) {
    ranks.push_back({absl::StrCat(r.rank()), absl::StrCat(r.owned_numel()),
                     HumanBytes(static_cast<double>(r.owned_bytes())), absl::StrCat(r.ranges())});
  }
  absl::StrAppend(&out, RenderTable(ranks));
  return out;
}

nlohmann::json StatsToJson(const v1::GetStatsResponse& stats) {
  nlohmann::json disagreements = nlohmann::json::array();
  for (const v1::OrderDisagreement& d : stats.disagreements()) {
    disagreements.push_back({{"rank", d.rank()},
                             {"position", d.position()},
                             {"expected", d.expected()},
                             {"reported", d.reported()}});
  }
  nlohmann::json ranks = nlohmann::json::array();
  for (const v1::RankStats& r : stats.ranks()) {
    nlohmann::json rank = {{"rank", r.rank()},
                           {"worker_id", r.worker_id()},
                           {"acked_plan_version", r.acked_plan_version()}};
    if (r.has_last()) {
      rank["last_step"] = {{"step", r.last().step()},
                           {"step_ms", r.last().step_ms()},
                           {"backward_ms", r.last().backward_ms()},
                           {"communication_ms", r.last().communication_ms()},
                           {"hidden_ms", r.last().hidden_ms()},
                           {"loss", r.last().loss()},
                           {"held_bytes", r.last().held_bytes()},
                           {"gathered_units", r.last().gathered_units()},
                           {"gather_wait_ms", r.last().gather_wait_ms()}};
    }
    ranks.push_back(rank);
  }
  return {{"status", EnumWord(v1::OverlapStatus_Name(stats.status()), "OVERLAP_STATUS_")},
          {"plan_version", stats.plan_version()},
          {"plan_hash", stats.plan_hash()},
          {"pending_acks", std::vector<int>(stats.pending_acks().begin(),
                                            stats.pending_acks().end())},
          {"disagreements", disagreements},
          {"steps_reported", stats.steps_reported()},
          {"mean_step_ms", stats.mean_step_ms()},
          {"mean_backward_ms", stats.mean_backward_ms()},
          {"mean_communication_ms", stats.mean_communication_ms()},
          {"mean_hidden_ms", stats.mean_hidden_ms()},
          {"overlap_fraction", stats.overlap_fraction()},
          {"bucket_bytes", std::vector<int64_t>(stats.bucket_bytes().begin(),
                                                stats.bucket_bytes().end())},
          {"ranks", ranks}};
}

std::string StatsTable(const v1::GetStatsResponse& stats) {
  std::string out = absl::StrFormat(
      "overlap status %s, plan v%d (hash %s)%s\n",
      v1::OverlapStatus_Name(stats.status()).substr(sizeof("OVERLAP_STATUS_") - 1),
      stats.plan_version(), stats.plan_hash().empty() ? "-" : stats.plan_hash(),
      stats.pending_acks().empty()
          ? std::string()
          : absl::StrCat(", waiting for ranks ", absl::StrJoin(stats.pending_acks(), ","),
                         " to apply it"));
  for (const v1::OrderDisagreement& d : stats.disagreements()) {
    absl::StrAppend(&out, "rank ", d.rank(), " saw ", d.reported(), " ready at position ",
                    d.position(), " where rank 0 saw ", d.expected(), " (rank 0's order used)\n");
  }
  if (stats.steps_reported() == 0) return absl::StrCat(out, "no step statistics reported yet\n");
  absl::StrAppend(
      &out, absl::StrFormat("over the last %d steps reported: step %.2f ms, backward %.2f ms, "
                            "communication %.2f ms of which %.2f ms hidden (%.0f%% overlap)\n",
                            stats.steps_reported(), stats.mean_step_ms(), stats.mean_backward_ms(),
                            stats.mean_communication_ms(), stats.mean_hidden_ms(),
                            100 * stats.overlap_fraction()));
  std::vector<std::vector<std::string>> rows = {
      {"RANK", "WORKER", "PLAN", "STEP", "STEP MS", "BACKWARD MS", "COMM MS", "HIDDEN MS", "LOSS",
       "HELD", "GATHERED", "GATHER WAIT MS"}};
  for (const v1::RankStats& r : stats.ranks()) {
    if (!r.has_last()) {
      rows.push_back({absl::StrCat(r.rank()), r.worker_id(), absl::StrCat("v", r.acked_plan_version()),
                      "-", "-", "-", "-", "-", "-", "-", "-", "-"});
      continue;
    }
    const v1::StepStats& s = r.last();
    rows.push_back({absl::StrCat(r.rank()), r.worker_id(), absl::StrCat("v", r.acked_plan_version()),
                    absl::StrCat(s.step()), absl::StrFormat("%.2f", s.step_ms()),
                    absl::StrFormat("%.2f", s.backward_ms()),
                    absl::StrFormat("%.2f", s.communication_ms()),
                    absl::StrFormat("%.2f", s.hidden_ms()), absl::StrFormat("%.4f", s.loss()),
                    HumanBytes(s.held_bytes()), absl::StrCat(s.gathered_units()),
                    absl::StrFormat("%.2f", s.gather_wait_ms())});
  }
  return absl::StrCat(out, RenderTable(rows));
}

}  // namespace shard
