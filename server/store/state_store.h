// Where the coordinator keeps what must survive its own restart. Implementations are
// thread-compatible: the owner serialises calls.
#pragma once

#include <memory>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "shard/v1/state.pb.h"

namespace shard {

class StateStore {
 public:
  virtual ~StateStore() = default;
  // The last saved state, or nullopt when nothing was ever saved.
  virtual absl::StatusOr<std::optional<v1::CoordinatorState>> Load() = 0;
  // Durably replaces the saved state: after OK, a crash loses nothing.
  virtual absl::Status Save(const v1::CoordinatorState& state) = 0;
};

// For tests and for a coordinator run without a state directory.
class InMemoryStateStore : public StateStore {
 public:
  absl::StatusOr<std::optional<v1::CoordinatorState>> Load() override;
  absl::Status Save(const v1::CoordinatorState& state) override;
  int saves() const { return saves_; }

 private:
  std::optional<v1::CoordinatorState> state_;
  int saves_ = 0;
};

// One JSON file, `coordinator-state.json`, replaced atomically on every save. The directory is
// locked (flock on `LOCK`) for the life of the store, so two coordinators never share one.
class DirectoryStateStore : public StateStore {
 public:
  static absl::StatusOr<std::unique_ptr<DirectoryStateStore>> Open(const std::string& dir);
  ~DirectoryStateStore() override;
  DirectoryStateStore(const DirectoryStateStore&) = delete;
  DirectoryStateStore& operator=(const DirectoryStateStore&) = delete;

  absl::StatusOr<std::optional<v1::CoordinatorState>> Load() override;
  absl::Status Save(const v1::CoordinatorState& state) override;

  const std::string& state_file() const { return state_file_; }

 private:
  DirectoryStateStore(std::string state_file, int lock_fd)
      : state_file_(std::move(state_file)), lock_fd_(lock_fd) {}

  std::string state_file_;
  int lock_fd_;
};

}  // namespace shard
