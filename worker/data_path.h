// What a worker's data path is made of: the device its buffers and model live on, and how the
// ranks of each generation connect their collectives (the generation's rendezvous store carries
// Gloo's addresses or NCCL's unique id). The agent builds one communicator per generation.
//
//   --device cpu        host memory; shared memory between ranks on one host, Gloo over TCP
//                       otherwise (--transport)                            (CpuDataPath)
//   --device cuda:N     GPU memory, NCCL (backend auto or nccl), or Gloo
//                       staged through pinned memory (backend gloo)      (worker/gpu/gpu_data_path.h)
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "worker/dataplane/communicator.h"
#include "worker/dataplane/device.h"
#include "worker/dataplane/key_value_store.h"

namespace shard {

class DataPath {
 public:
  virtual ~DataPath() = default;

  virtual Device& device() = 0;
  // The collective library, as the coordinator and the logs show it ("gloo", "nccl",
  // "gloo+staged").
  virtual std::string backend() const = 0;
  // What the worker announces when it joins (the backends it can run).
  virtual std::vector<std::string> capabilities() const = 0;
  // Connects rank `rank` of `size` through `store`; returns once every rank is connected.
  virtual absl::StatusOr<std::unique_ptr<Communicator>> Connect(KeyValueStore* store, int rank,
                                                                int size) = 0;
};

// How ranks exchange host memory. auto: shared memory when every rank of the generation is in
// this process's shared-memory domain (one host: SharedMemoryDomain()); where the ranks span
// hosts and some host has several, shared memory within each host and Gloo over TCP between the
// hosts' leaders (hierarchical_communicator.h); Gloo over TCP between every rank where each host
// has one. tcp: always Gloo between every rank; shm: shared memory, or an error naming the rank
// elsewhere.
enum class HostTransport { kAuto, kTcp, kShm };

// "auto", "tcp" or "shm"; InvalidArgument naming them otherwise.
absl::StatusOr<HostTransport> ParseHostTransport(absl::string_view name);

struct HostPathOptions {
  std::string host = "127.0.0.1";  // where Gloo listens for its peers
  // Collectives and connecting time out after `timeout`, a silent TCP link after
  // `link_timeout` (GlooOptions::link_timeout).
  absl::Duration timeout = absl::Seconds(60);
  absl::Duration link_timeout = absl::Seconds(10);
  HostTransport transport = HostTransport::kAuto;
  // The shared-memory domain this rank reports; empty: SharedMemoryDomain(). Tests give ranks
  // on one machine different ones to stand in for several hosts.
  std::string domain = "";
};

// Host memory, with collectives over `options.transport`.
std::unique_ptr<DataPath> CpuDataPath(HostPathOptions options);

// Connects rank `rank` of `size` for collectives on host memory over `options.transport`: each
// rank publishes its shared-memory domain in `store`, and every rank makes the same choice.
absl::StatusOr<std::unique_ptr<Communicator>> ConnectHostCollectives(
    KeyValueStore* store, int rank, int size, const HostPathOptions& options);

// The backend a worker runs for `device` ("cpu", "cpu:N" or "cuda:N") when asked for `backend`
// ("auto", "gloo" or "nccl"): auto is NCCL on a GPU and Gloo on the host. InvalidArgument for a
// malformed device, an unknown backend, or NCCL on the host. `index` receives N of cuda:N (-1
// for the host).
absl::StatusOr<std::string> ResolveBackend(const std::string& device, const std::string& backend,
                                           int* index);

}  // namespace shard
