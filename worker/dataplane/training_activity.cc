#include "worker/dataplane/training_activity.h"

namespace shard {

void ActivityTracker::Begin(int64_t generation, int64_t step) {
  absl::MutexLock lock(&mu_);
  generation_ = generation;
  step_ = step;
  step_at_ = absl::Now();
}

void ActivityTracker::StepDone(int64_t step) {
  absl::MutexLock lock(&mu_);
  step_ = step;
  step_at_ = absl::Now();
}

void ActivityTracker::End() {
  absl::MutexLock lock(&mu_);
  generation_ = 0;
}

void ActivityTracker::CollectiveStarted() {
  absl::MutexLock lock(&mu_);
  if (in_flight_++ == 0) in_flight_since_ = absl::Now();
}

void ActivityTracker::CollectiveEnded() {
  absl::MutexLock lock(&mu_);
  --in_flight_;
}

TrainingActivity ActivityTracker::Read() const {
  absl::MutexLock lock(&mu_);
  TrainingActivity activity;
  if (generation_ == 0) return activity;
  const absl::Time now = absl::Now();
  activity.generation = generation_;
  activity.step = step_;
  activity.since_step = now - step_at_;
  if (in_flight_ > 0) activity.waiting = std::max(now - in_flight_since_, absl::Nanoseconds(1));
  return activity;
}

namespace {

class TrackingCommunicator : public Communicator {
 public:
  TrackingCommunicator(std::shared_ptr<Communicator> inner, ActivityTracker* tracker)
      : inner_(std::move(inner)), tracker_(tracker) {}

  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  absl::string_view backend() const override { return inner_->backend(); }
  bool device_buffers() const override { return inner_->device_buffers(); }

  absl::Status AllReduce(const void* send, void* recv, size_t count, DataType dtype,
                         ReduceOp op) override {
    return Tracked([&] { return inner_->AllReduce(send, recv, count, dtype, op); });
  }
  absl::Status ReduceScatter(const void* send, void* recv, size_t recv_count, DataType dtype,
                             ReduceOp op) override {
    return Tracked([&] { return inner_->ReduceScatter(send, recv, recv_count, dtype, op); });
  }
  absl::Status AllGather(const void* send, void* recv, size_t send_count,
                         DataType dtype) override {
    return Tracked([&] { return inner_->AllGather(send, recv, send_count, dtype); });
  }
  absl::Status Reduce(const void* send, void* recv, size_t count, DataType dtype, ReduceOp op,
                      int root) override {
    return Tracked([&] { return inner_->Reduce(send, recv, count, dtype, op, root); });
  }
  absl::Status Broadcast(void* buffer, size_t count, DataType dtype, int root) override {
    return Tracked([&] { return inner_->Broadcast(buffer, count, dtype, root); });
  }
  absl::Status Barrier() override {
    return Tracked([&] { return inner_->Barrier(); });
  }
  absl::StatusOr<std::unique_ptr<SharedHostBuffer>> ShareHostBuffer(void* data,
                                                                    size_t bytes) override {
    tracker_->CollectiveStarted();
    absl::StatusOr<std::unique_ptr<SharedHostBuffer>> shared = inner_->ShareHostBuffer(data, bytes);
    tracker_->CollectiveEnded();
    return shared;
  }
  absl::Status OrderComputeAfterCollectives() override {
    return Tracked([&] { return inner_->OrderComputeAfterCollectives(); });
  }
  void SetCollectiveTimeout(absl::Duration timeout) override {
    inner_->SetCollectiveTimeout(timeout);
  }
  void Abort(absl::string_view reason) override { inner_->Abort(reason); }
  bool aborted() const override { return inner_->aborted(); }
  std::optional<PeerFault> peer_fault() const override { return inner_->peer_fault(); }

 private:
  template <typename Call>
  absl::Status Tracked(Call call) {
    tracker_->CollectiveStarted();
    absl::Status status = call();
    tracker_->CollectiveEnded();
    return status;
  }

  const std::shared_ptr<Communicator> inner_;
  ActivityTracker* const tracker_;
};

}  // namespace

std::shared_ptr<Communicator> TrackCollectives(std::shared_ptr<Communicator> inner,
                                               ActivityTracker* tracker) {
  return std::make_shared<TrackingCommunicator>(std::move(inner), tracker);
}

}  // namespace shard
