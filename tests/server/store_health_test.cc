#include "server/store_health.h"

#include <optional>

#include "gtest/gtest.h"

namespace sparsebalance {
namespace {

const absl::Time kStart = absl::FromUnixSeconds(1000);

// A store failure turns health NOT_SERVING at once; no probe runs within the hold, the next one
// is as large as the failed write, and its success turns health SERVING.
TEST(StoreHealthTest, AFailedWriteHoldsNotServingUntilAProbeOfItsSizeSucceeds) {
  StoreHealth health;
  ASSERT_TRUE(health.serving());
  std::optional<StoreHealth::Probe> probe = health.NextProbe(kStart);
  ASSERT_TRUE(probe.has_value());
  EXPECT_EQ(probe->bytes, 0);  // the periodic probe while SERVING is the small one

  health.OnStoreFailure(kStart, 150000);
  EXPECT_FALSE(health.serving());
  EXPECT_FALSE(health.NextProbe(kStart + absl::Milliseconds(999)).has_value());
  probe = health.NextProbe(kStart + StoreHealth::kHold);
  ASSERT_TRUE(probe.has_value());
  EXPECT_EQ(probe->bytes, 150000);
  EXPECT_EQ(health.probe_bytes(), 150000);

  // The disk still refuses it: NOT_SERVING, and the size is kept for the next probe.
  health.OnProbe(*probe, /*ok=*/false, kStart + absl::Seconds(1));
  EXPECT_FALSE(health.serving());
  EXPECT_FALSE(health.NextProbe(kStart + absl::Milliseconds(1500)).has_value());
  probe = health.NextProbe(kStart + absl::Seconds(2));
  ASSERT_TRUE(probe.has_value());
  EXPECT_EQ(probe->bytes, 150000);
  health.OnProbe(*probe, /*ok=*/true, kStart + absl::Seconds(2));
  EXPECT_TRUE(health.serving());
  EXPECT_EQ(health.NextProbe(kStart + absl::Seconds(3))->bytes, 0);
}

// A disk that refuses every real write but takes the probe: each failure restarts the hold, so
// health stays NOT_SERVING while writes keep failing, and a probe handed out before a failure
// does not count.
TEST(StoreHealthTest, FailuresKeepComingAndHealthStaysNotServing) {
  StoreHealth health;
  health.OnStoreFailure(kStart, 4096);
  for (int i = 1; i <= 20; ++i) {
    const absl::Time now = kStart + i * absl::Milliseconds(100);
    health.OnStoreFailure(now, 4096);
    EXPECT_FALSE(health.NextProbe(now + absl::Milliseconds(50)).has_value()) << i;
    EXPECT_FALSE(health.serving());
  }
  const absl::Time quiet = kStart + absl::Seconds(3);
  std::optional<StoreHealth::Probe> probe = health.NextProbe(quiet);
  ASSERT_TRUE(probe.has_value());
  health.OnStoreFailure(quiet + absl::Milliseconds(10), 100);  // while the probe runs
  health.OnProbe(*probe, /*ok=*/true, quiet + absl::Milliseconds(20));
  EXPECT_FALSE(health.serving());
  probe = health.NextProbe(quiet + absl::Seconds(2));
  ASSERT_TRUE(probe.has_value());
  EXPECT_EQ(probe->bytes, 4096);  // the largest failed write, not the last one
  health.OnProbe(*probe, /*ok=*/true, quiet + absl::Seconds(2));
  EXPECT_TRUE(health.serving());
}

// A failed periodic probe turns health NOT_SERVING (a read-only disk); probes are bounded in
// size; a failure of unknown size asks for the small probe.
TEST(StoreHealthTest, AFailedProbeAndTheProbeBound) {
  StoreHealth health;
  std::optional<StoreHealth::Probe> probe = health.NextProbe(kStart);
  ASSERT_TRUE(probe.has_value());
  health.OnProbe(*probe, /*ok=*/false, kStart);
  EXPECT_FALSE(health.serving());
  probe = health.NextProbe(kStart + absl::Seconds(1));
  ASSERT_TRUE(probe.has_value());
  EXPECT_EQ(probe->bytes, 0);
  health.OnProbe(*probe, /*ok=*/true, kStart + absl::Seconds(1));
  EXPECT_TRUE(health.serving());

  health.OnStoreFailure(kStart + absl::Seconds(5), int64_t{1} << 40);
  probe = health.NextProbe(kStart + absl::Seconds(7));
  ASSERT_TRUE(probe.has_value());
  EXPECT_EQ(probe->bytes, StoreHealth::kMaxProbeBytes);
  // The rest of the failed write is asked of the file system's free space.
  EXPECT_EQ(probe->free_bytes, int64_t{1} << 40);
  health.OnProbe(*probe, /*ok=*/true, kStart + absl::Seconds(7));
  EXPECT_TRUE(health.serving());
  // Forgotten once SERVING: a small failure after it needs no such room.
  health.OnStoreFailure(kStart + absl::Seconds(8), 4096);
  probe = health.NextProbe(kStart + absl::Seconds(10));
  ASSERT_TRUE(probe.has_value());
  EXPECT_EQ(probe->bytes, 4096);
  EXPECT_EQ(probe->free_bytes, 0);
}

}  // namespace
}  // namespace sparsebalance
