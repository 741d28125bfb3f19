#include "common/bus_bandwidth.h"

#include "gtest/gtest.h"

namespace shard {
namespace {

TEST(BusBandwidthTest, FactorsFollowNcclTests) {
  EXPECT_DOUBLE_EQ(BusBandwidthFactor(Collective::kAllReduce, 4), 1.5);
  EXPECT_DOUBLE_EQ(BusBandwidthFactor(Collective::kAllReduce, 2), 1.0);
  EXPECT_DOUBLE_EQ(BusBandwidthFactor(Collective::kReduceScatter, 4), 0.75);
  EXPECT_DOUBLE_EQ(BusBandwidthFactor(Collective::kAllGather, 8), 0.875);
  EXPECT_DOUBLE_EQ(BusBandwidthFactor(Collective::kBroadcast, 8), 1.0);
  EXPECT_DOUBLE_EQ(BusBandwidthFactor(Collective::kAllReduce, 1), 0.0);
}

TEST(BusBandwidthTest, GigabytesAreTenToTheNinth) {
  EXPECT_DOUBLE_EQ(AlgorithmBandwidthGBps(2e9, 1.0), 2.0);
  EXPECT_DOUBLE_EQ(BusBandwidthGBps(Collective::kAllReduce, 4, 1e9, 0.5), 3.0);
  EXPECT_DOUBLE_EQ(AlgorithmBandwidthGBps(1e9, 0.0), 0.0);
}

TEST(BusBandwidthTest, CollectiveNamesRoundTrip) {
  for (Collective c : {Collective::kAllReduce, Collective::kReduceScatter, Collective::kAllGather,
                       Collective::kBroadcast}) {
    absl::StatusOr<Collective> parsed = ParseCollective(CollectiveName(c));
    ASSERT_TRUE(parsed.ok());
    EXPECT_EQ(*parsed, c);
  }
  EXPECT_EQ(ParseCollective("allreduce").status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace shard
