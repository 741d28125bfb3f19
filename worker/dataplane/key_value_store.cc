#include "worker/dataplane/key_value_store.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace shard {

absl::Status InProcessKeyValueStore::Set(const std::string& key, const std::string& value) {
  absl::MutexLock lock(&mu_);
  values_[key] = value;
  return absl::OkStatus();
}

absl::StatusOr<std::string> InProcessKeyValueStore::Get(const std::string& key) {
  absl::MutexLock lock(&mu_);
  auto it = values_.find(key);
  if (it == values_.end()) return absl::NotFoundError(absl::StrCat("key '", key, "' is not set"));
  return it->second;
}

absl::Status InProcessKeyValueStore::Wait(const std::vector<std::string>& keys,
                                          absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  auto all_set = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (const std::string& key : keys) {
      if (!values_.contains(key)) return false;
    }
    return true;
  };
  if (!mu_.AwaitWithTimeout(absl::Condition(&all_set), timeout)) {
    return absl::DeadlineExceededError(absl::StrCat("keys [", absl::StrJoin(keys, ", "),
                                                    "] not all set after ",
                                                    absl::FormatDuration(timeout)));
  }
  return absl::OkStatus();
}

}  // namespace shard
