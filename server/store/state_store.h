// Where the coordinator keeps what must survive its own restart, as named records of two kinds:
// - plain records (the job, the checkpoint catalog, the plan): protobuf messages, each replaced
//   whole and durably by Save;
// - journaled records (the membership, which changes with every join and death): a snapshot and
//   the deltas appended after it. An append is cheap (O(size of the change), not of the
//   record), and appends are made durable in groups: one fsync covers every append made while
//   the previous one ran (group commit). Callers hold their acknowledgements until WhenDurable
//   fires, so nothing acknowledged is ever lost.
// Implementations are thread-safe.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "google/protobuf/message.h"

namespace shard {

// A journaled record as loaded: its latest snapshot and the deltas appended after it, in order
// (serialized messages; the owner knows their types).
struct Journal {
  std::string snapshot;
  std::vector<std::string> deltas;
};

class StateStore {
 public:
  virtual ~StateStore() = default;
  // Reads plain record `key` into `message`: true if found, false if it was never saved.
  virtual absl::StatusOr<bool> Load(absl::string_view key, google::protobuf::Message* message) = 0;
  // Durably replaces plain record `key`: after OK, a crash loses nothing.
  virtual absl::Status Save(absl::string_view key, const google::protobuf::Message& message) = 0;

  // The journaled record `key`; nullopt if it was never written.
  virtual absl::StatusOr<std::optional<Journal>> LoadJournal(absl::string_view key) = 0;
  // Appends a delta to `key`, after everything appended before; returns its sequence number
  // (numbers grow across all keys). Durable once WhenDurable says so.
  virtual uint64_t Append(absl::string_view key, std::string delta) = 0;
  // Starts `key` afresh from `snapshot`, which includes every delta appended so far (so the
  // journal stays proportional to the record). Durable like an append.
  virtual uint64_t Compact(absl::string_view key, std::string snapshot) = 0;
  // Runs `done` once every append and compaction up to `sequence` is durable: at once, on this
  // thread, if they are; else on the thread that makes them durable.
  virtual void WhenDurable(uint64_t sequence, std::function<void()> done) = 0;
  // The sequence number of the last append or compaction.
  virtual uint64_t last_sequence() const = 0;
};

// In memory: for tests and for a coordinator run without a state directory. Everything is
// durable at once.
class InMemoryStateStore : public StateStore {
 public:
  absl::StatusOr<bool> Load(absl::string_view key, google::protobuf::Message* message) override;
  absl::Status Save(absl::string_view key, const google::protobuf::Message& message) override;
  absl::StatusOr<std::optional<Journal>> LoadJournal(absl::string_view key) override;
  uint64_t Append(absl::string_view key, std::string delta) override;
  uint64_t Compact(absl::string_view key, std::string snapshot) override;
  void WhenDurable(uint64_t sequence, std::function<void()> done) override;
  uint64_t last_sequence() const override;

 private:
  mutable absl::Mutex mu_;
  std::map<std::string, std::string> records_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, Journal> journals_ ABSL_GUARDED_BY(mu_);
  uint64_t sequence_ ABSL_GUARDED_BY(mu_) = 0;
};

// A directory: plain records as `<dir>/<key>.json`, replaced atomically (temporary file, fsync,
// rename, fsync of the directory); journaled records as `<dir>/<key>.log` (common/journal.h
// frames: a snapshot, then deltas), compacted by the same atomic replacement and appended to
// by a writer thread that fsyncs each group of appends once. The directory is locked (flock on
// `LOCK`) for the life of the store, so two coordinators never share one. A failed journal
// write is retried (with backoff, logged) until it succeeds: acknowledgements wait meanwhile.
class DirectoryStateStore : public StateStore {
 public:
  static absl::StatusOr<std::unique_ptr<DirectoryStateStore>> Open(const std::string& dir);
  // Makes everything appended durable, then stops the writer.
  ~DirectoryStateStore() override;
  DirectoryStateStore(const DirectoryStateStore&) = delete;
  DirectoryStateStore& operator=(const DirectoryStateStore&) = delete;

  absl::StatusOr<bool> Load(absl::string_view key, google::protobuf::Message* message) override;
  absl::Status Save(absl::string_view key, const google::protobuf::Message& message) override;
  absl::StatusOr<std::optional<Journal>> LoadJournal(absl::string_view key) override;
  uint64_t Append(absl::string_view key, std::string delta) override;
  uint64_t Compact(absl::string_view key, std::string snapshot) override;
  void WhenDurable(uint64_t sequence, std::function<void()> done) override;
  uint64_t last_sequence() const override;

  std::string PathOf(absl::string_view key) const;
  std::string JournalPathOf(absl::string_view key) const;

 private:
  struct Write {
    uint64_t sequence;
    std::string key;
    bool snapshot;
    std::string payload;
  };

  DirectoryStateStore(std::string dir, int lock_fd);
  void Writer();
  // Writes one group: compactions as whole new files, deltas appended; fsyncs.
  absl::Status WriteGroup(const std::vector<Write>& group);

  const std::string dir_;
  const int lock_fd_;
  absl::Mutex files_mu_;  // plain records

  mutable absl::Mutex mu_;
  std::deque<Write> pending_ ABSL_GUARDED_BY(mu_);
  uint64_t sequence_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t durable_ ABSL_GUARDED_BY(mu_) = 0;
  std::multimap<uint64_t, std::function<void()>> waiting_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::map<std::string, int> journal_fds_;  // the writer thread's own
  std::thread writer_;
};

}  // namespace shard
