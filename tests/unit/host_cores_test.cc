// The cores a process may use: a cgroup v2 quota read from cpu.max, and the process's own count.
#include "common/host_cores.h"

#include <sched.h>

#include "gtest/gtest.h"

namespace shard {
namespace {

TEST(HostCoresTest, ACpuMaxQuotaIsReadAsCores) {
  EXPECT_EQ(CoresInCpuMax("200000 100000\n"), 2.0);
  EXPECT_EQ(CoresInCpuMax("150000 100000"), 1.5);
  EXPECT_EQ(CoresInCpuMax("50000 100000"), 0.5);
}

TEST(HostCoresTest, NoLimitOrAnUnreadableLineIsNoQuota) {
  EXPECT_EQ(CoresInCpuMax("max 100000"), std::nullopt);
  EXPECT_EQ(CoresInCpuMax(""), std::nullopt);
  EXPECT_EQ(CoresInCpuMax("100000"), std::nullopt);
  EXPECT_EQ(CoresInCpuMax("0 100000"), std::nullopt);
  EXPECT_EQ(CoresInCpuMax("100000 0"), std::nullopt);
  EXPECT_EQ(CoresInCpuMax("1 2 3"), std::nullopt);
}

// Counted another way: the affinity mask from sched_getaffinity's own bits, which no quota
// raises.
TEST(HostCoresTest, UsableCoresIsAtLeastOneAndAtMostTheAffinity) {
  cpu_set_t set;
  CPU_ZERO(&set);
  ASSERT_EQ(::sched_getaffinity(0, sizeof(set), &set), 0);
  int allowed = 0;
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) allowed += CPU_ISSET(cpu, &set) ? 1 : 0;
  EXPECT_GE(UsableCores(), 1);
  EXPECT_LE(UsableCores(), allowed);
}

}  // namespace
}  // namespace shard
