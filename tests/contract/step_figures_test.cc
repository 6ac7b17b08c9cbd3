#include "contract/step_figures.h"

#include <limits>
#include <vector>

#include "gtest/gtest.h"

namespace sparsebalance {
namespace {

TEST(StepFiguresTest, ImbalanceIsMaxOverMean) {
  EXPECT_DOUBLE_EQ(ImbalanceRatio({1.0, 2.0, 3.0}), 1.5);
  EXPECT_DOUBLE_EQ(ImbalanceRatio({2.0, 2.0}), 1.0);
  EXPECT_DOUBLE_EQ(ImbalanceRatio({4.0}), 1.0);
  // A rank that did nothing still counts in the mean.
  EXPECT_DOUBLE_EQ(ImbalanceRatio({0.0, 3.0, 3.0}), 1.5);
  EXPECT_DOUBLE_EQ(ImbalanceRatio({0.0, 4.0}), 2.0);
}

TEST(StepFiguresTest, BubbleIsTheIdleShareOfRanksTimesMakespan) {
  // Ranks idle 2, 1 and 0 of 3 seconds: 3 idle of 9.
  EXPECT_DOUBLE_EQ(BubbleRatio({1.0, 2.0, 3.0}), 1.0 / 3.0);
  EXPECT_DOUBLE_EQ(BubbleRatio({2.0, 2.0}), 0.0);
  EXPECT_DOUBLE_EQ(BubbleRatio({0.0, 4.0}), 0.5);
  EXPECT_DOUBLE_EQ(BubbleRatio({0.0, 0.0, 0.0, 8.0}), 0.75);
}

TEST(StepFiguresTest, EmptyAndIdleStepsAreBalanced) {
  EXPECT_EQ(ImbalanceRatio({}), 1.0);
  EXPECT_EQ(BubbleRatio({}), 0.0);
  EXPECT_EQ(ImbalanceRatio({0.0, 0.0}), 1.0);
  EXPECT_EQ(BubbleRatio({0.0, 0.0}), 0.0);
}

TEST(StepFiguresTest, LowerBoundIsTheLargerOfTheTwoLimits) {
  // Equal speeds: total / ranks, unless one piece is larger.
  EXPECT_DOUBLE_EQ(MakespanLowerBound(12.0, 2.0, {1.0, 1.0, 1.0}), 4.0);
  EXPECT_DOUBLE_EQ(MakespanLowerBound(12.0, 5.0, {1.0, 1.0, 1.0}), 5.0);
  // Speeds 1 and 2 (seconds per unit): sum(1/h) = 1.5, so 6 / 1.5 = 4; the largest piece of 3
  // on the fastest rank (h = 1) takes 3.
  EXPECT_DOUBLE_EQ(MakespanLowerBound(6.0, 3.0, {2.0, 1.0}), 4.0);
  EXPECT_DOUBLE_EQ(MakespanLowerBound(6.0, 5.0, {2.0, 1.0}), 5.0);
  // Both ranks slower than 1: the largest piece runs at the fastest of them.
  EXPECT_DOUBLE_EQ(MakespanLowerBound(1.0, 1.0, {2.0, 4.0}), 2.0);
  EXPECT_EQ(MakespanLowerBound(6.0, 3.0, {}), 0.0);
  EXPECT_EQ(MakespanLowerBound(0.0, 0.0, {1.0}), 0.0);
}

TEST(StepFiguresTest, QuantilesInterpolateBetweenRanks) {
  const std::vector<double> v = {4.0, 1.0, 3.0, 2.0};  // sorted: 1 2 3 4
  EXPECT_DOUBLE_EQ(Quantile(v, 0.0), 1.0);
  EXPECT_DOUBLE_EQ(Quantile(v, 1.0), 4.0);
  EXPECT_DOUBLE_EQ(Quantile(v, 0.5), 2.5);  // the median of an even count
  EXPECT_DOUBLE_EQ(Quantile(v, 0.25), 1.75);
  EXPECT_DOUBLE_EQ(Quantile({5.0, 1.0, 3.0}, 0.5), 3.0);
  EXPECT_DOUBLE_EQ(Quantile({7.0}, 0.9), 7.0);
  EXPECT_DOUBLE_EQ(Quantile(v, -1.0), 1.0);  // clamped into [0, 1]
  EXPECT_DOUBLE_EQ(Quantile(v, 2.0), 4.0);
  EXPECT_EQ(Quantile({}, 0.5), 0.0);
}

}  // namespace
}  // namespace sparsebalance
