// The rendezvous key-value store the data path uses to find its peers (Gloo's Store, NCCL's
// unique id). Keys live in a scope (job, generation); only the current generation's scope is
// open, and a scope's keys and waiters are dropped when its generation ends.
//
// Thread-safe. Wait callbacks run on the thread that completes them (a Set, a generation
// change or ExpireWaiters), never under the manager's lock.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/wait_list.h"

namespace shard {

struct KvScope {
  std::string job;
  int64_t generation = 0;
};

struct KvLimits {
  size_t max_key_bytes = 512;
  size_t max_value_bytes = 1 << 20;
  size_t max_scope_bytes = size_t{256} << 20;
  size_t max_wait_keys = 4096;
  absl::Duration max_wait = absl::Minutes(10);
};

class KvStoreManager {
 public:
  using WaitCallback = std::function<void(absl::Status)>;

  KvStoreManager(std::string job, int64_t generation, KvLimits limits = {});

  // Opens `generation`'s scope and closes every older one: their keys are dropped and their
  // waiters complete with Aborted.
  void SetCurrentGeneration(int64_t generation);

  absl::Status Set(const KvScope& scope, const std::string& key, std::string value);

  // The value now; NotFound if unset.
  absl::StatusOr<std::string> Get(const KvScope& scope, const std::string& key) const;

  // Calls `done` exactly once: OK when every key is set, DeadlineExceeded when `timeout`
  // passes first (see ExpireWaiters), Aborted when the scope's generation ends, or the
  // validation error at once.
  void Wait(const KvScope& scope, std::vector<std::string> keys, absl::Duration timeout,
            absl::Time now, WaitCallback done);

  // Completes waiters whose deadline is at or before `now` with DeadlineExceeded.
  void ExpireWaiters(absl::Time now);

  // Completes every waiter with `reason` and refuses all later calls with it.
  void Close(absl::Status reason);

  size_t pending_waiters() const;

 private:
  struct Waiter {
    std::vector<std::string> keys;
    absl::Duration timeout;
    WaitCallback done;
  };

  absl::Status CheckScope(const KvScope& scope) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  bool AllSet(const std::vector<std::string>& keys) const ABSL_SHARED_LOCKS_REQUIRED(mu_);

  const std::string job_;
  const KvLimits limits_;
  mutable absl::Mutex mu_;
  int64_t generation_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, std::string> values_ ABSL_GUARDED_BY(mu_);
  size_t scope_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  WaitList<Waiter> waiters_ ABSL_GUARDED_BY(mu_);
};

}  // namespace shard
