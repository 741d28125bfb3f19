// Collectives for a world that spans hosts with several ranks on some: shared memory within each
// host, TCP between the hosts' leaders (the lowest rank of each host).
//
// A reduction is reduced within the host to its leader, across the leaders, and broadcast back
// within the host; a gather goes the other way. Ranks of one host need not have consecutive
// ranks. The order in which contributions are added differs from the flat ring's, so a
// hierarchical world gives results equal to a flat one's within rounding, not bit for bit.
//
// Thread-compatible for collectives (one caller at a time); Abort() is thread-safe.
#pragma once

#include <memory>
#include <vector>

#include "worker/dataplane/communicator.h"

namespace shard {

// Where each rank is: host[r] is the index of rank r's host, hosts numbered by their lowest rank
// (so rank 0 is on host 0).
struct HostLayout {
  std::vector<int> host;

  // From each rank's shared-memory domain (SharedMemoryDomain()).
  static HostLayout FromDomains(const std::vector<std::string>& domains);
  int hosts() const;
  // The ranks on `h`, lowest first; the first is its leader.
  std::vector<int> RanksOn(int h) const;
};

// `local` connects this rank with the ranks of its host (rank i of it is RanksOn(host)[i]);
// `leaders` connects the hosts' leaders (rank h of it is host h's leader), and is null on a rank
// that is not its host's leader.
std::unique_ptr<Communicator> MakeHierarchicalCommunicator(int rank, HostLayout layout,
                                                           std::unique_ptr<Communicator> local,
                                                           std::unique_ptr<Communicator> leaders);

}  // namespace shard
