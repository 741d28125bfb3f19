#include "server/kv_store_manager.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace shard {

KvStoreManager::KvStoreManager(std::string job, int64_t generation, KvLimits limits)
    : job_(std::move(job)), limits_(limits), generation_(generation) {}

void KvStoreManager::SetCurrentGeneration(int64_t generation) {
  std::vector<Waiter> aborted;
  int64_t ended = 0;
  {
    absl::MutexLock lock(&mu_);
    if (generation == generation_) return;
    ended = generation_;
    generation_ = generation;
    values_.clear();
    scope_bytes_ = 0;
    aborted = waiters_.TakeAll();
  }
  for (Waiter& waiter : aborted) {
    waiter.done(absl::AbortedError(absl::StrCat(
        "generation ", ended, " ended while waiting for rendezvous keys (now at generation ",
        generation, "); re-read the world and rendezvous again")));
  }
}

absl::Status KvStoreManager::CheckScope(const KvScope& scope) const {
  if (!waiters_.closed().ok()) return waiters_.closed();
  if (scope.job != job_) {
    return absl::NotFoundError(absl::StrCat("unknown job '", scope.job,
                                            "'; this coordinator serves job '", job_, "'"));
  }
  if (scope.generation < generation_) {
    return absl::AbortedError(absl::StrCat(
        "generation ", scope.generation, " has ended; the current generation is ", generation_,
        ": re-read the world and rendezvous again"));
  }
  if (scope.generation > generation_) {
    return absl::FailedPreconditionError(absl::StrCat("generation ", scope.generation,
                                                      " does not exist; the current generation is ",
                                                      generation_));
  }
  return absl::OkStatus();
}

bool KvStoreManager::AllSet(const std::vector<std::string>& keys) const {
  for (const std::string& key : keys) {
    if (!values_.contains(key)) return false;
  }
  return true;
}

absl::Status KvStoreManager::Set(const KvScope& scope, const std::string& key, std::string value) {
  if (key.empty() || key.size() > limits_.max_key_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("rendezvous key must be 1..",
                                                   limits_.max_key_bytes, " bytes, got ",
                                                   key.size()));
  }
  if (value.size() > limits_.max_value_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("value for rendezvous key '", key, "' is ",
                                                   value.size(), " bytes; the limit is ",
                                                   limits_.max_value_bytes));
  }
  std::vector<Waiter> ready;
  {
    absl::MutexLock lock(&mu_);
    SHARD_RETURN_IF_ERROR(CheckScope(scope));
    auto it = values_.find(key);
    const size_t old_bytes = it == values_.end() ? 0 : key.size() + it->second.size();
    const size_t new_bytes = scope_bytes_ - old_bytes + key.size() + value.size();
    if (new_bytes > limits_.max_scope_bytes) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "rendezvous scope of generation ", generation_, " would hold ", new_bytes,
          " bytes; the limit is ", limits_.max_scope_bytes));
    }
    scope_bytes_ = new_bytes;
    values_[key] = std::move(value);
    ready = waiters_.TakeIf([this](const Waiter& waiter)
                                ABSL_SHARED_LOCKS_REQUIRED(mu_) { return AllSet(waiter.keys); });
  }
  for (Waiter& waiter : ready) waiter.done(absl::OkStatus());
  return absl::OkStatus();
}

absl::StatusOr<std::string> KvStoreManager::Get(const KvScope& scope,
                                                const std::string& key) const {
  absl::ReaderMutexLock lock(&mu_);
  SHARD_RETURN_IF_ERROR(CheckScope(scope));
  auto it = values_.find(key);
  if (it == values_.end()) {
    return absl::NotFoundError(absl::StrCat("rendezvous key '", key, "' is not set in generation ",
                                            generation_));
  }
  return it->second;
}

void KvStoreManager::Wait(const KvScope& scope, std::vector<std::string> keys,
                          absl::Duration timeout, absl::Time now, WaitCallback done) {
  absl::Status result;
  if (keys.empty() || keys.size() > limits_.max_wait_keys) {
    result = absl::InvalidArgumentError(absl::StrCat(
        "a rendezvous wait takes 1..", limits_.max_wait_keys, " keys, got ", keys.size()));
  } else if (timeout <= absl::ZeroDuration() || timeout > limits_.max_wait) {
    result = absl::InvalidArgumentError(
        absl::StrCat("rendezvous wait timeout must be in (0, ",
                     absl::FormatDuration(limits_.max_wait), "], got ",
                     absl::FormatDuration(timeout)));
  } else {
    absl::MutexLock lock(&mu_);
    result = CheckScope(scope);
    if (result.ok() && !AllSet(keys)) {
      waiters_.Add(now + timeout, Waiter{std::move(keys), timeout, std::move(done)});
      return;
    }
  }
  done(result);
}

void KvStoreManager::ExpireWaiters(absl::Time now) {
  std::vector<Waiter> expired;
  int64_t generation = 0;
  {
    absl::MutexLock lock(&mu_);
    generation = generation_;
    expired = waiters_.TakeExpired(now);
  }
  for (Waiter& waiter : expired) {
    std::string missing;
    {
      absl::ReaderMutexLock lock(&mu_);
      for (const std::string& key : waiter.keys) {
        if (values_.contains(key)) continue;
        if (!missing.empty()) absl::StrAppend(&missing, ", ");
        if (missing.size() > 200) {
          absl::StrAppend(&missing, "...");
          break;
        }
        absl::StrAppend(&missing, "'", key, "'");
      }
    }
    waiter.done(absl::DeadlineExceededError(absl::StrCat(
        "rendezvous keys still missing after ", absl::FormatDuration(waiter.timeout),
        " in generation ", generation, ": ", missing,
        " (a peer has not arrived; is every worker of this generation running?)")));
  }
}

void KvStoreManager::Close(absl::Status reason) {
  std::vector<Waiter> closed;
  {
    absl::MutexLock lock(&mu_);
    closed = waiters_.Close(reason);
  }
  for (Waiter& waiter : closed) waiter.done(reason);
}

size_t KvStoreManager::pending_waiters() const {
  absl::ReaderMutexLock lock(&mu_);
  return waiters_.size();
}

}  // namespace shard
