// The data path's collectives between ranks on one host, through shared memory.
//
// Each rank creates one POSIX shared-memory segment: a control block (counters the peers wait
// on with futexes) and `depth` slots of `slot_bytes`. Every collective is a sequence of rounds;
// in a round each rank copies what its peers need into its slot (one copy in), and each rank
// then reads its peers' slots directly: the owner of a range reduces it in place into its
// output, the others copy results out (one copy out). A rank may run `depth` rounds ahead of
// its slowest peer. Reductions add the ranks' contributions in the same order as the TCP ring
// (GlooCommunicator), so both transports give the same bits.
//
// A buffer shared with ShareHostBuffer (the engine's buckets) moves into a segment of its own,
// at the same address, which every peer maps. A collective whose send buffer (an all-reduce's
// recv buffer too; a broadcast's buffer) lies in one needs no copy in: the first round only
// says where the buffers are, the owner of a range (or the root) reduces it straight from the
// peers' buffers, and the others copy results straight out of them. Such a collective returns
// once every peer has finished reading this rank's buffers.
//
// Segments (shared buffers' too) are unlinked as soon as every rank has mapped them, so nothing
// is left in /dev/shm after the job, even when a process is killed; segments of processes
// killed while connecting are swept by the next communicator created on the host.
//
// A wait for a peer ends when the peer gets there, when the peer aborts or leaves (its
// collectives fail Unavailable), when the peer's process is gone (found within a tenth of a
// second, where the peers share a pid namespace), when this communicator is aborted, or after
// the collective timeout (DeadlineExceeded). A stopped peer is found by the timeout or by the
// coordinator's lease, which ends the generation and aborts the communicator.
//
// Thread-compatible for collectives (one caller at a time); Abort() is thread-safe.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "worker/dataplane/communicator.h"
#include "worker/dataplane/key_value_store.h"

namespace shard {

struct ShmOptions {
  int rank = 0;
  int size = 1;
  // Waiting for peers to arrive in the store, and each wait of a collective.
  absl::Duration timeout = absl::Seconds(60);
  // Once a peer's segment name is in the store, how long mapping every segment may take.
  absl::Duration connect_timeout = absl::Seconds(10);
  std::string key_prefix = "shm/";  // namespace in the rendezvous store
  size_t slot_bytes = size_t{1} << 20;  // one round's data per rank
  int depth = 4;  // rounds a rank may be ahead of its slowest peer (slots per segment)
};

// Which shared-memory domain this process is in: processes with equal domains can map each
// other's segments and count as one host (same boot, same /dev/shm, same network namespace:
// containers of one pod share it, and so do ranks started side by side on one machine).
std::string SharedMemoryDomain();

// Maps every rank's segment through `store` and returns once every rank has mapped them all
// (creation is collective). Fails after `timeout` if a peer does not arrive, or with
// FailedPrecondition if a peer's segment cannot be opened (another host, another /dev/shm) or
// /dev/shm has no room for this rank's.
absl::StatusOr<std::unique_ptr<Communicator>> CreateShmCommunicator(KeyValueStore* store,
                                                                    const ShmOptions& options);

}  // namespace shard
