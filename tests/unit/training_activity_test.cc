#include "worker/dataplane/training_activity.h"

#include <cstring>

#include "gtest/gtest.h"

namespace shard {
namespace {

// One rank that copies send to recv, says whether its buffers are device memory, and records
// what the tracker read while a collective was inside it.
class RecordingCommunicator : public Communicator {
 public:
  RecordingCommunicator(bool device_buffers, const ActivityTracker* tracker)
      : device_buffers_(device_buffers), tracker_(tracker) {}
  int rank() const override { return 0; }
  int size() const override { return 1; }
  absl::string_view backend() const override { return "recording"; }
  bool device_buffers() const override { return device_buffers_; }
  absl::Status AllReduce(const void* send, void* recv, size_t count, DataType dtype,
                         ReduceOp) override {
    std::memmove(recv, send, count * DataTypeSize(dtype));
    seen_inside = tracker_->Read();
    return absl::OkStatus();
  }
  absl::Status ReduceScatter(const void*, void*, size_t, DataType, ReduceOp) override {
    return absl::UnimplementedError("unused");
  }
  absl::Status AllGather(const void*, void*, size_t, DataType) override {
    return absl::UnimplementedError("unused");
  }
  absl::Status Reduce(const void*, void*, size_t, DataType, ReduceOp, int) override {
    return absl::UnimplementedError("unused");
  }
  absl::Status Broadcast(void*, size_t, DataType, int) override { return absl::OkStatus(); }
  absl::Status Barrier() override { return absl::OkStatus(); }
  void Abort(absl::string_view) override { aborted_ = true; }
  bool aborted() const override { return aborted_; }

  TrainingActivity seen_inside;

 private:
  const bool device_buffers_;
  const ActivityTracker* const tracker_;
  bool aborted_ = false;
};

// The GPU device refuses a communicator that does not take device buffers; the worker hands it
// the tracked one, so the wrapper must say what the communicator under it takes (on an H200 the
// GPU worker failed its first step when it did not).
TEST(TrackCollectivesTest, SaysWhatTheWrappedCommunicatorsBuffersAre) {
  ActivityTracker tracker;
  for (const bool device : {false, true}) {
    auto inner = std::make_shared<RecordingCommunicator>(device, &tracker);
    std::shared_ptr<Communicator> tracked = TrackCollectives(inner, &tracker);
    EXPECT_EQ(tracked->device_buffers(), device);
    EXPECT_EQ(tracked->backend(), "recording");
  }
}

TEST(TrackCollectivesTest, ACollectiveIsInFlightOnlyWhileItRuns) {
  ActivityTracker tracker;
  auto inner = std::make_shared<RecordingCommunicator>(false, &tracker);
  std::shared_ptr<Communicator> tracked = TrackCollectives(inner, &tracker);
  tracker.Begin(/*generation=*/3, /*step=*/7);
  const float send[2] = {1.5f, -2.0f};
  float recv[2] = {0, 0};
  ASSERT_TRUE(tracked->AllReduce(send, recv, 2, DataType::kFloat32, ReduceOp::kSum).ok());
  EXPECT_EQ(recv[1], -2.0f);
  EXPECT_EQ(inner->seen_inside.generation, 3);
  EXPECT_GT(inner->seen_inside.waiting, absl::ZeroDuration());
  EXPECT_EQ(tracker.Read().waiting, absl::ZeroDuration());
  tracked->Abort("test");
  EXPECT_TRUE(tracked->aborted());
}

}  // namespace
}  // namespace shard
