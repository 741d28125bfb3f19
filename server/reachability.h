// Reachability as part of membership: the links ranks report broken, and the rules that keep a
// world whose members reach one another. Functions over the membership, as reshape.h: no locks,
// no clock, no storage; WorldManager calls them under its lock and the simulation drives them.
//
// Rules (docs/elasticity.md, "Network partitions"):
// - A rank that cannot reach a peer of its generation reports the peer and how: its connect
//   probe or connect failed, or a send or receive timed out in a collective. Each report is an
//   UNREACHABLE event ("w1 cannot reach w2 (connect failed at generation 3: ...)"), and ends the
//   generation as any failed data path does.
// - A failed connect is the evidence that the same members would re-form into the same failure.
//   A timed-out send or receive is not: in a ring every rank ends up waiting on its left
//   neighbour, so timeouts blame peers that are merely waiting too. The next generation's
//   connect probe (run by every rank to every peer at rendezvous, with a short deadline)
//   settles it in seconds.
// - Once a connect failed between members, the world re-forms with the largest set of members
//   among which no connect failed: the fewest workers leave it, the one blamed by most peers
//   first, then the highest rank; never below min_world_size (then nothing changes, and the
//   world re-forms with the same members, whose probe reports the link again). The workers left
//   out wait as isolated standbys (ISOLATED): they take no rank, neither a free one nor at a
//   fold-in, until a connect probe they make to every member of the world passes (REACHABLE);
//   from then on they are standbys like any other, folded in at the next checkpoint boundary.
// - The world is chosen from its members and the isolated standbys together, with what the
//   standbys' probes found: a choice made on the first report (a tie) that left out the wrong
//   worker is undone when the members that stayed cannot connect either; the isolated standby
//   that reaches them comes back (REACHABLE) and the worker blamed by most is left out instead.
// - Reports are kept until every rank of a generation passes its self-check (the world then
//   reaches itself in full) and only count between current members.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "common/control_types.h"
#include "server/membership.h"

namespace shard {

// Records that `reporter` (a rank of the world at `generation`, the current one) could not reach
// the peers of `faults`, with an UNREACHABLE event for each link not reported before.
void RecordUnreachable(Membership& membership, const std::string& reporter, int64_t generation,
                       const std::vector<PeerFault>& faults, absl::Time now, Change* change);

// If a connect failed between two members of the running world, re-forms it with members that
// reach one another (see above) and returns true; the isolated become standbys.
bool IsolateUnreachable(Membership& membership, const MembershipRules& rules, absl::Time now,
                        Change* change);

// What an isolated standby must probe: every member of the world that peers can connect to.
std::vector<PeerProbe> ProbeTargets(const Membership& membership, const std::string& standby);

// An isolated standby's probe results: once it reached every member of the world, it is no
// longer isolated (REACHABLE) and may be folded in.
// What it could not reach is kept as failed connects (at `generation`, the current one): when the
// world is chosen again, isolated standbys are candidates too.
void NoteProbe(Membership& membership, const std::string& standby, int64_t generation,
               const std::vector<PeerProbe>& probed, absl::Time now, Change* change);

// The world connected in full: what its members reported broken is past (what isolated standbys'
// probes found is kept).
void ForgetBrokenLinks(Membership& membership);

}  // namespace shard
