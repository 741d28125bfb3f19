#include "server/membership_log.h"

#include <map>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "proto/control_convert.h"

namespace shard {
namespace {

constexpr char kMembershipRecord[] = "membership";

v1::MemberRole RoleToProto(Role role) {
  switch (role) {
    case Role::kActive: return v1::MEMBER_ROLE_ACTIVE;
    case Role::kStandby: return v1::MEMBER_ROLE_STANDBY;
    case Role::kLeaving: return v1::MEMBER_ROLE_LEAVING;
    case Role::kDeparted: break;
  }
  return v1::MEMBER_ROLE_UNSPECIFIED;
}

v1::MemberRecord MemberToProto(const Member& member) {
  v1::MemberRecord record;
  record.set_id(member.id);
  record.set_incarnation(member.incarnation);
  record.set_rank(member.rank);
  record.set_host(member.host);
  record.set_device(member.device);
  for (const std::string& capability : member.capabilities) record.add_capabilities(capability);
  record.set_joined_generation(member.joined_generation);
  record.set_role(RoleToProto(member.role));
  record.set_draining(member.draining);
  if (member.role == Role::kLeaving) record.set_leave_reason(member.detail);
  record.set_done_generation(member.done_generation);
  record.set_unreachable(member.unreachable);
  record.set_probe_address(member.probe_address);
  return record;
}

// The job-level fields of a record.
void SetHeader(const std::string& job, const Membership& membership, int64_t generation,
               const EventLog& log, v1::CoordinatorState* record) {
  record->set_format_version(MembershipLog::kFormatVersion);
  record->set_job(job);
  record->set_generation(generation);
  record->set_ranks(membership.ranks());
  record->set_target_world_size(membership.target);
  record->set_formed(membership.formed);
  record->set_connected_generation(membership.connected_generation);
  record->set_stop_requested(membership.stop_requested());
  record->set_stop_reason(membership.stop_reason);
  record->set_phase(ToProto(membership.phase()));
  record->set_stop_kind(ToProto(membership.stop_kind()));
  record->set_worker_failures(membership.worker_failures);
  record->set_last_event_sequence(log.last_sequence());
}

}  // namespace

absl::StatusOr<std::optional<v1::CoordinatorState>> MembershipLog::Load(StateStore* store,
                                                                       size_t max_events) {
  SHARD_ASSIGN_OR_RETURN(std::optional<Journal> journal, store->LoadJournal(kMembershipRecord));
  v1::CoordinatorState record;
  if (!journal.has_value()) {
    SHARD_ASSIGN_OR_RETURN(bool legacy, store->Load(kMembershipRecord, &record));
    if (!legacy) return std::nullopt;
    if (record.format_version() != 1) {
      return absl::FailedPreconditionError(absl::StrCat(
          "the state directory's membership record has format version ", record.format_version(),
          "; this shard-coordinator reads versions 1 and ", kFormatVersion));
    }
    return record;
  }
  if (!record.ParseFromString(journal->snapshot) || record.format_version() != kFormatVersion) {
    return absl::DataLossError(absl::StrCat(
        "the state directory's membership snapshot is unreadable or of another format (version ",
        record.format_version(), "; this shard-coordinator reads ", kFormatVersion, ")"));
  }
  std::map<std::string, v1::MemberRecord> members;
  for (const v1::MemberRecord& member : record.members()) members[member.id()] = member;
  std::vector<v1::MembershipEvent> events(record.events().begin(), record.events().end());
  for (size_t i = 0; i < journal->deltas.size(); ++i) {
    v1::CoordinatorState delta;
    if (!delta.ParseFromString(journal->deltas[i])) {
      return absl::DataLossError(
          absl::StrCat("membership journal entry ", i + 1, " does not parse"));
    }
    for (const v1::MemberRecord& member : delta.members()) members[member.id()] = member;
    for (const std::string& id : delta.removed_members()) members.erase(id);
    events.insert(events.end(), delta.events().begin(), delta.events().end());
    // Every delta carries every job-level field: the latest ones are the record's.
    record = std::move(delta);
  }
  record.clear_members();
  record.clear_removed_members();
  record.clear_events();
  for (auto& [id, member] : members) *record.add_members() = std::move(member);
  const size_t first = events.size() > max_events ? events.size() - max_events : 0;
  for (size_t i = first; i < events.size(); ++i) *record.add_events() = std::move(events[i]);
  return record;
}

v1::CoordinatorState MembershipLog::Snapshot(const Membership& membership, int64_t generation,
                                             const EventLog& log) const {
  v1::CoordinatorState record;
  SetHeader(job_, membership, generation, log, &record);
  for (const v1::MembershipEvent& event : log.events()) *record.add_events() = event;
  for (const auto& [id, member] : membership.members()) {
    if (member.role != Role::kDeparted) *record.add_members() = MemberToProto(member);
  }
  return record;
}

uint64_t MembershipLog::Compact(const Membership& membership, int64_t generation,
                                const EventLog& log) {
  std::string snapshot = Snapshot(membership, generation, log).SerializeAsString();
  snapshot_bytes_ = snapshot.size();
  delta_bytes_ = 0;
  return store_->Compact(kMembershipRecord, std::move(snapshot));
}

uint64_t MembershipLog::Record(const Membership& membership, int64_t generation,
                               const std::set<std::string>& dirty,
                               const std::vector<v1::MembershipEvent>& events,
                               const EventLog& log) {
  // Past the snapshot's own size (and a floor, so small worlds do not rewrite it every time),
  // a new snapshot is cheaper to read back than the deltas.
  if (delta_bytes_ > std::max<size_t>(64 << 10, snapshot_bytes_)) {
    return Compact(membership, generation, log);
  }
  v1::CoordinatorState delta;
  SetHeader(job_, membership, generation, log, &delta);
  for (const std::string& id : dirty) {
    const Member* member = membership.Find(id);
    if (member == nullptr || member->role == Role::kDeparted) {
      delta.add_removed_members(id);
    } else {
      *delta.add_members() = MemberToProto(*member);
    }
  }
  for (const v1::MembershipEvent& event : events) *delta.add_events() = event;
  std::string bytes = delta.SerializeAsString();
  delta_bytes_ += bytes.size();
  return store_->Append(kMembershipRecord, std::move(bytes));
}

StopKind SavedStopKind(const v1::CoordinatorState& record) {
  if (record.stop_kind() != v1::STOP_KIND_UNSPECIFIED) return FromProto(record.stop_kind());
  if (!record.stop_requested()) return StopKind::kNone;
  // A record of an earlier release said only how the stop read.
  return absl::StartsWith(record.stop_reason(), "training finished") ? StopKind::kTrained
                                                                      : StopKind::kOperator;
}

Membership RestoreMembership(const v1::CoordinatorState& record, int default_target,
                             absl::Time heartbeat, absl::Time now) {
  const int target = record.target_world_size() > 0 ? record.target_world_size() : default_target;
  Membership membership(record.formed() ? record.ranks() : target, target);
  membership.formed = record.formed();
  membership.connected_generation = record.connected_generation();
  membership.worker_failures = record.worker_failures();
  for (const v1::MemberRecord& saved : record.members()) {
    Member& member = membership.Upsert(saved.id());
    member.incarnation = saved.incarnation();
    member.host = saved.host();
    member.device = saved.device();
    member.capabilities.assign(saved.capabilities().begin(), saved.capabilities().end());
    member.joined_generation = saved.joined_generation();
    member.done_generation = saved.done_generation();
    member.unreachable = saved.unreachable();
    member.probe_address = saved.probe_address();
    member.last_heartbeat = heartbeat;
    const int rank = saved.rank();
    if (saved.role() == v1::MEMBER_ROLE_ACTIVE && rank >= 0 && rank < membership.ranks() &&
        membership.holder(rank).empty()) {
      membership.Activate(member, rank);
    } else if (saved.role() == v1::MEMBER_ROLE_LEAVING) {
      membership.MakeLeaving(member, saved.leave_reason());
    } else {
      membership.MakeStandby(member, now);
    }
    member.draining = saved.draining();
  }
  if (membership.held() < membership.ranks() && membership.formed) {
    membership.free_rank_since = now;
  }
  return membership;
}

}  // namespace shard
