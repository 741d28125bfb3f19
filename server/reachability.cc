#include "server/reachability.h"

#include <algorithm>
#include <map>
#include <set>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/logging.h"
#include "spdlog/spdlog.h"

namespace shard {
namespace {

using Pair = std::pair<std::string, std::string>;

std::string Describe(const BrokenLink& link) {
  return absl::StrCat(link.from, " cannot reach ", link.to, " (",
                      LinkFailureName(link.how),
                      link.how == LinkFailure::kConnect ? " failed" : " timed out",
                      " at generation ", link.generation,
                      link.detail.empty() ? "" : absl::StrCat(": ", link.detail), ")");
}

bool Covers(const std::vector<std::string>& chosen, const std::set<Pair>& edges) {
  const auto in = [&](const std::string& id) {
    return std::find(chosen.begin(), chosen.end(), id) != chosen.end();
  };
  return std::all_of(edges.begin(), edges.end(),
                     [&](const Pair& edge) { return in(edge.first) || in(edge.second); });
}

// The fewest of `candidates` (most preferred first) that touch every edge. Exact over subsets
// in order of size, the most preferred subset of a size first, while that stays small; greedy
// (the candidate on most uncovered edges, then the most preferred) beyond.
std::vector<std::string> SmallestCover(const std::vector<std::string>& candidates,
                                       const std::set<Pair>& edges) {
  const size_t n = candidates.size();
  if (n <= 16) {
    for (size_t k = 1; k <= n; ++k) {
      // Index combinations of size k in lexicographic order.
      std::vector<size_t> pick(k);
      for (size_t i = 0; i < k; ++i) pick[i] = i;
      while (true) {
        std::vector<std::string> chosen;
        for (size_t i : pick) chosen.push_back(candidates[i]);
        if (Covers(chosen, edges)) return chosen;
        size_t i = k;
        while (i > 0 && pick[i - 1] == n - k + i - 1) --i;
        if (i == 0) break;
        ++pick[i - 1];
        for (size_t j = i; j < k; ++j) pick[j] = pick[j - 1] + 1;
      }
    }
    return candidates;
  }
  std::vector<std::string> chosen;
  std::set<Pair> left = edges;
  while (!left.empty()) {
    const std::string* best = nullptr;
    size_t best_degree = 0;
    for (const std::string& id : candidates) {
      const size_t degree = std::count_if(left.begin(), left.end(), [&](const Pair& edge) {
        return edge.first == id || edge.second == id;
      });
      if (degree > best_degree) {
        best = &id;
        best_degree = degree;
      }
    }
    chosen.push_back(*best);
    std::erase_if(left, [&](const Pair& e) { return e.first == *best || e.second == *best; });
  }
  return chosen;
}

}  // namespace

void RecordUnreachable(Membership& membership, const std::string& reporter, int64_t generation,
                       const std::vector<PeerFault>& faults, absl::Time now, Change* change) {
  const Member* from = membership.Find(reporter);
  if (from == nullptr || from->role != Role::kActive) return;
  for (const PeerFault& fault : faults) {
    if (fault.peer_rank < 0 || fault.peer_rank >= membership.ranks()) continue;
    const std::string& peer = membership.holder(fault.peer_rank);
    if (peer.empty() || peer == reporter) continue;
    BrokenLink link{reporter, peer, fault.how, generation, fault.detail};
    auto [it, inserted] = membership.broken_links.try_emplace(Pair{reporter, peer}, link);
    if (!inserted) {
      if (it->second.generation == generation && it->second.how == fault.how) continue;
      // A failed connect stays the evidence it is; a later timeout only adds an event.
      if (it->second.how != LinkFailure::kConnect || fault.how == LinkFailure::kConnect) {
        it->second = link;
      }
    }
    spdlog::warn("{}", Describe(link));
    change->events.push_back(MakeEvent(v1::MEMBERSHIP_EVENT_KIND_UNREACHABLE, reporter,
                                       from->rank, Describe(link), now));
  }
}

bool IsolateUnreachable(Membership& membership, const MembershipRules& rules, absl::Time now,
                        Change* change) {
  if (membership.stop_requested()) return false;
  // The pool: the world's members in rank order, then the isolated standbys (a choice made on
  // the first report may have left out the wrong worker: seen in a test where a worker cut off
  // from both peers was blamed once, as was the peer that reported it first).
  std::vector<std::string> pool;
  std::map<std::string, int> rank_of;
  for (int rank = 0; rank < membership.ranks(); ++rank) {
    const std::string& id = membership.holder(rank);
    if (id.empty()) continue;
    pool.push_back(id);
    rank_of[id] = rank;
  }
  // Only those whose probe has told what they cannot reach: coming back with nothing known
  // would skip the probe.
  for (const Member* standby : membership.Standbys()) {
    const bool probed = std::any_of(
        membership.broken_links.begin(), membership.broken_links.end(),
        [&](const auto& entry) { return entry.second.from == standby->id; });
    if (!standby->unreachable.empty() && probed) pool.push_back(standby->id);
  }
  const auto in_pool = [&](const std::string& id) {
    return std::find(pool.begin(), pool.end(), id) != pool.end();
  };
  std::set<Pair> edges;  // failed connects within the pool, unordered
  bool world_broken = false;
  std::map<std::string, std::set<std::string>> blamed_by;
  for (const auto& [key, link] : membership.broken_links) {
    if (!in_pool(link.from) || !in_pool(link.to)) continue;
    blamed_by[link.to].insert(link.from);
    if (link.how != LinkFailure::kConnect) continue;
    edges.insert(std::minmax(link.from, link.to));
    world_broken = world_broken || (rank_of.contains(link.from) && rank_of.contains(link.to));
  }
  if (!world_broken) return false;
  std::vector<std::string> candidates;
  for (const Pair& edge : edges) {
    candidates.push_back(edge.first);
    candidates.push_back(edge.second);
  }
  std::sort(candidates.begin(), candidates.end());
  candidates.erase(std::unique(candidates.begin(), candidates.end()), candidates.end());
  // Most blamed first; then those out already (no churn); then the highest rank (the lowest
  // ranks stay where they are).
  const auto order = [&](const std::string& id) {
    return std::make_tuple(-static_cast<int>(blamed_by[id].size()), rank_of.contains(id) ? 1 : 0,
                           rank_of.contains(id) ? -rank_of[id] : 0, id);
  };
  std::sort(candidates.begin(), candidates.end(),
            [&](const std::string& a, const std::string& b) { return order(a) < order(b); });
  const std::vector<std::string> left_out = SmallestCover(candidates, edges);
  const auto is_left_out = [&](const std::string& id) {
    return std::find(left_out.begin(), left_out.end(), id) != left_out.end();
  };
  std::vector<std::string> keep;  // the world's members in rank order, then standbys back in
  for (const std::string& id : pool) {
    if (!is_left_out(id)) keep.push_back(id);
  }
  int size = static_cast<int>(keep.size());
  while (size >= rules.min_world_size && size > 0 && !rules.Allowed(size)) --size;
  if (size < std::max(1, rules.min_world_size)) {
    spdlog::warn("the workers that reach one another are fewer than the job's minWorldSize {}: "
                 "the world re-forms with the same members, whose probes report again",
                 rules.min_world_size);
    return false;
  }
  const int members = static_cast<int>(rank_of.size());
  std::vector<std::string> isolated;
  std::vector<std::string> back;
  for (const std::string& id : left_out) {
    if (!rank_of.contains(id)) continue;  // out already, and stays out
    std::vector<std::string> links;
    for (const auto& [key, link] : membership.broken_links) {
      if ((link.from == id || link.to == id) && in_pool(link.from) && in_pool(link.to)) {
        links.push_back(Describe(link));
      }
    }
    Member& member = *membership.Mutable(id);
    const int rank = member.rank;
    member.unreachable = absl::StrJoin(links, "; ");
    membership.MakeStandby(member, now);
    const std::string detail = absl::StrCat(
        member.unreachable, "; ", id,
        " waits as a standby until a connect probe to every member passes");
    spdlog::warn("isolated {}: {}", id, detail);
    change->events.push_back(
        MakeEvent(v1::MEMBERSHIP_EVENT_KIND_ISOLATED, id, rank, detail, now));
    isolated.push_back(id);
  }
  for (int i = 0; i < static_cast<int>(keep.size()); ++i) {
    Member& member = *membership.Mutable(keep[i]);
    if (i >= size) {
      membership.MakeStandby(member, now);  // no allowed size holds it
      continue;
    }
    if (member.role != Role::kStandby) continue;
    // Isolated before, but no failed connect ties it to the members that stay.
    member.unreachable.clear();
    member.self_check = SelfCheckRecord{};
    membership.Touch(member.id);
    back.push_back(member.id);
    change->events.push_back(MakeEvent(
        v1::MEMBERSHIP_EVENT_KIND_REACHABLE, member.id, -1,
        absl::StrCat("no failed connect ties it to the members that stay (",
                     absl::StrJoin(left_out, ", "), " left out instead): back in the world"),
        now));
  }
  keep.resize(size);
  membership.Renumber(keep, size);
  change->events.push_back(MakeEvent(
      v1::MEMBERSHIP_EVENT_KIND_RESIZED, "", -1,
      absl::StrCat("re-formed from ", members, " to ", size, " workers: ",
                   absl::StrJoin(isolated, ", "), isolated.size() == 1 ? " is" : " are",
                   " isolated (peers cannot connect)",
                   back.empty() ? "" : absl::StrCat("; ", absl::StrJoin(back, ", "),
                                                    " back in")),
      now));
  change->bump = true;
  return true;
}

std::vector<PeerProbe> ProbeTargets(const Membership& membership, const std::string& standby) {
  std::vector<PeerProbe> targets;
  for (const std::string& id : membership.holders()) {
    if (id.empty() || id == standby) continue;
    const Member* member = membership.Find(id);
    if (member->probe_address.empty()) continue;
    targets.push_back(PeerProbe{id, member->probe_address, false, ""});
  }
  return targets;
}

void NoteProbe(Membership& membership, const std::string& standby, int64_t generation,
               const std::vector<PeerProbe>& probed, absl::Time now, Change* change) {
  Member* member = membership.Mutable(standby);
  if (member == nullptr || member->role != Role::kStandby || member->unreachable.empty()) return;
  // With no member to reach (the world lost them all), nothing keeps it out.
  const std::vector<PeerProbe> targets = ProbeTargets(membership, standby);
  bool all_reached = true;
  for (const PeerProbe& target : targets) {
    const auto answer = std::find_if(probed.begin(), probed.end(), [&](const PeerProbe& p) {
      return p.worker_id == target.worker_id && p.address == target.address;
    });
    if (answer != probed.end() && answer->reachable) continue;
    all_reached = false;
    if (answer != probed.end()) {
      // What it could not reach counts when the world is chosen again (IsolateUnreachable).
      membership.broken_links[Pair{standby, target.worker_id}] = BrokenLink{
          standby, target.worker_id, LinkFailure::kConnect, generation, answer->detail};
    }
  }
  if (!all_reached) return;
  member->unreachable.clear();
  membership.Touch(standby);
  std::erase_if(membership.broken_links, [&](const auto& entry) {
    return entry.second.from == standby || entry.second.to == standby;
  });
  const std::string detail = absl::StrCat(
      "connected to every member of the world (", targets.size(),
      "); folded in at the next checkpoint boundary while the world is below its target");
  spdlog::info("{} {}", standby, detail);
  change->events.push_back(
      MakeEvent(v1::MEMBERSHIP_EVENT_KIND_REACHABLE, standby, -1, detail, now));
}

void ForgetBrokenLinks(Membership& membership) {
  // What an isolated standby's probe found stays until a probe of it passes.
  std::erase_if(membership.broken_links, [&](const auto& entry) {
    const Member* from = membership.Find(entry.second.from);
    return from == nullptr || from->role != Role::kStandby || from->unreachable.empty();
  });
}

}  // namespace shard
