#include "worker/dataplane/checkpoint_saver.h"

#include "common/fault.h"

namespace shard {

CheckpointSaver::CheckpointSaver(std::function<void(const SavedShard&)> on_saved)
    : on_saved_(std::move(on_saved)),
      thread_([this] { Loop(); }),
      reporter_([this] { ReportLoop(); }) {}

CheckpointSaver::~CheckpointSaver() {
  WaitIdle();
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  thread_.join();
  reporter_.join();
}

int64_t CheckpointSaver::writing_step() const {
  absl::MutexLock lock(&mu_);
  return busy_ ? writing_step_ : 0;
}

absl::Duration CheckpointSaver::WaitIdle() {
  const absl::Time start = absl::Now();
  absl::MutexLock lock(&mu_);
  auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !busy_; };
  mu_.Await(absl::Condition(&idle));
  return absl::Now() - start;
}

bool CheckpointSaver::WaitIdleFor(absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !busy_; };
  return mu_.AwaitWithTimeout(absl::Condition(&idle), timeout);
}

StateBuffer CheckpointSaver::TakeBuffer() {
  WaitIdle();
  absl::MutexLock lock(&mu_);
  // A buffer that was a memory snapshot too may still be a buddy's replica: not to be written.
  if (kept_.retired() || kept_.HeldElsewhere()) return StateBuffer();
  return std::move(kept_);
}

void CheckpointSaver::Start(SavedShard saved, int world_size, SnapshotBytes bytes) {
  WaitIdle();
  absl::MutexLock lock(&mu_);
  writing_step_ = saved.step;
  job_ = std::move(saved);
  world_size_ = world_size;
  bytes_ = std::move(bytes);
  cancel_ = false;
  busy_ = true;
}

void CheckpointSaver::Cancel() {
  absl::MutexLock lock(&mu_);
  if (busy_) cancel_ = true;
}

void CheckpointSaver::ReportSkipped(SavedShard saved) {
  absl::MutexLock lock(&mu_);
  skipped_ = std::move(saved);
}

void CheckpointSaver::ReportLoop() {
  while (true) {
    SavedShard saved;
    {
      absl::MutexLock lock(&mu_);
      auto work = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stopping_ || skipped_.has_value();
      };
      mu_.Await(absl::Condition(&work));
      if (!skipped_.has_value()) return;
      saved = *std::move(skipped_);
      skipped_.reset();
    }
    on_saved_(saved);
  }
}

void CheckpointSaver::Loop() {
  while (true) {
    SavedShard saved;
    SnapshotBytes bytes;
    int world_size = 0;
    {
      absl::MutexLock lock(&mu_);
      auto work = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopping_ || busy_; };
      mu_.Await(absl::Condition(&work));
      if (!busy_) return;
      saved = std::move(job_);
      bytes.swap(bytes_);
      world_size = world_size_;
    }
    const absl::Time start = absl::Now();
    {
      // Destroyed before the report: a write that failed or was cancelled has removed its file.
      absl::StatusOr<std::unique_ptr<ShardWriter>> writer =
          ShardWriter::Create(saved.dir, saved.rank, world_size, &cancel_);
      if (!writer.ok()) {
        saved.record = writer.status();
      } else if (absl::Status written = (*writer)->Append(bytes->data(), bytes->size());
                 !written.ok()) {
        saved.record = written;
      } else {
        FaultPoint("shard-before-sync");
        saved.record = (*writer)->Finish();
        if (saved.record.ok()) saved.record->extras = saved.extras;
      }
    }
    saved.write_ms = absl::ToDoubleMilliseconds(absl::Now() - start);
    // A save given up is not reported: its generation is over (or ends with this worker's
    // failure), and the coordinator removes what any save of an ended generation left.
    if (!(cancel_ && absl::IsCancelled(saved.record.status()))) on_saved_(saved);
    absl::MutexLock lock(&mu_);
    // Kept for the next copy unless a memory snapshot holds it.
    if (bytes.use_count() == 1) kept_ = std::move(*bytes);
    busy_ = false;
  }
}

}  // namespace shard
