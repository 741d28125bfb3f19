// What a worker's data path is made of: the device its buffers and model live on, and how the
// ranks of each generation connect their collectives (the generation's rendezvous store carries
// Gloo's addresses or NCCL's unique id). The agent builds one communicator per generation.
//
//   --device cpu        host memory, Gloo over TCP                         (CpuDataPath)
//   --device cuda:N     GPU memory, NCCL (backend auto or nccl), or Gloo
//                       staged through pinned memory (backend gloo)      (worker/gpu/gpu_data_path.h)
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
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

// Host memory and Gloo over TCP, listening on `host`; collectives and connecting time out after
// `timeout`, a silent link after `link_timeout` (GlooOptions::link_timeout).
std::unique_ptr<DataPath> CpuDataPath(std::string host, absl::Duration timeout,
                                      absl::Duration link_timeout = absl::Seconds(10));

// The backend a worker runs for `device` ("cpu", "cpu:N" or "cuda:N") when asked for `backend`
// ("auto", "gloo" or "nccl"): auto is NCCL on a GPU and Gloo on the host. InvalidArgument for a
// malformed device, an unknown backend, or NCCL on the host. `index` receives N of cuda:N (-1
// for the host).
absl::StatusOr<std::string> ResolveBackend(const std::string& device, const std::string& backend,
                                           int* index);

}  // namespace shard
