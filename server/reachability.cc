#include "server/reachability.h"

#include <algorithm>
#include <map>
#include <set>
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
  if (membership.stop_requested) return false;
  std::map<std::string, int> rank_of;
  for (int rank = 0; rank < membership.ranks(); ++rank) {
    if (!membership.holder(rank).empty()) rank_of[membership.holder(rank)] = rank;
  }
  std::set<Pair> edges;  // failed connects between members, unordered
  std::map<std::string, std::set<std::string>> blamed_by;
  for (const auto& [key, link] : membership.broken_links) {
    if (!rank_of.contains(link.from) || !rank_of.contains(link.to)) continue;
    blamed_by[link.to].insert(link.from);
    if (link.how == LinkFailure::kConnect) edges.insert(std::minmax(link.from, link.to));
  }
  if (edges.empty()) return false;
  std::vector<std::string> candidates;
  for (const Pair& edge : edges) {
    candidates.push_back(edge.first);
    candidates.push_back(edge.second);
  }
  std::sort(candidates.begin(), candidates.end());
  candidates.erase(std::unique(candidates.begin(), candidates.end()), candidates.end());
  // Most blamed first, then the highest rank (the lowest ranks stay where they are).
  std::sort(candidates.begin(), candidates.end(), [&](const std::string& a, const std::string& b) {
    const size_t blame_a = blamed_by[a].size();
    const size_t blame_b = blamed_by[b].size();
    if (blame_a != blame_b) return blame_a > blame_b;
    return rank_of[a] > rank_of[b];
  });
  const std::vector<std::string> isolated = SmallestCover(candidates, edges);
  const int members = static_cast<int>(rank_of.size());
  int size = members - static_cast<int>(isolated.size());
  while (size >= rules.min_world_size && size > 0 && !rules.Allowed(size)) --size;
  if (size < std::max(1, rules.min_world_size)) {
    spdlog::warn("{} of the {} workers cannot be reached by their peers; leaving them out would "
                 "go below the job's minWorldSize {}: the world re-forms with all of them",
                 isolated.size(), members, rules.min_world_size);
    return false;
  }
  const auto is_isolated = [&](const std::string& id) {
    return std::find(isolated.begin(), isolated.end(), id) != isolated.end();
  };
  std::vector<std::string> keep;
  for (const std::string& id : membership.holders()) {
    if (id.empty() || is_isolated(id)) continue;
    if (static_cast<int>(keep.size()) < size) {
      keep.push_back(id);
    } else {
      membership.MakeStandby(*membership.Mutable(id), now);  // no allowed size holds it
    }
  }
  for (const std::string& id : isolated) {
    std::vector<std::string> links;
    for (const auto& [key, link] : membership.broken_links) {
      if ((link.from == id || link.to == id) && rank_of.contains(link.from) &&
          rank_of.contains(link.to)) {
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
  }
  membership.Renumber(keep, size);
  change->events.push_back(MakeEvent(
      v1::MEMBERSHIP_EVENT_KIND_RESIZED, "", -1,
      absl::StrCat("re-formed from ", members, " to ", size, " workers: ",
                   absl::StrJoin(isolated, ", "), isolated.size() == 1 ? " is" : " are",
                   " isolated (peers cannot connect)"),
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

void NoteProbe(Membership& membership, const std::string& standby,
               const std::vector<PeerProbe>& probed, absl::Time now, Change* change) {
  Member* member = membership.Mutable(standby);
  if (member == nullptr || member->role != Role::kStandby || member->unreachable.empty()) return;
  // With no member to reach (the world lost them all), nothing keeps it out.
  const std::vector<PeerProbe> targets = ProbeTargets(membership, standby);
  for (const PeerProbe& target : targets) {
    const bool reached = std::any_of(probed.begin(), probed.end(), [&](const PeerProbe& p) {
      return p.worker_id == target.worker_id && p.address == target.address && p.reachable;
    });
    if (!reached) return;
  }
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

void ForgetBrokenLinks(Membership& membership) { membership.broken_links.clear(); }

}  // namespace shard
