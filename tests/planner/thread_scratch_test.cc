// ThreadScratch: a thread's holders one after another share its storage and find what the one
// before left (capacity kept between plans); a holder made while another on the same thread
// holds it gets storage of its own; a step above kKeptScratchSamples frees the storage; another
// thread has storage of its own.
#include "planner/thread_scratch.h"

#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace sparsebalance {
namespace {

struct Arrays {
  std::vector<int> values;
};

TEST(ThreadScratchTest, HoldersOneAfterAnotherShareTheThreadsStorageAndNestedOnesGetTheirOwn) {
  const Arrays* first = nullptr;
  {
    ThreadScratch<Arrays> outer(1000);
    outer->values.assign(1000, 7);
    first = &*outer;
    {
      ThreadScratch<Arrays> nested(10);  // while `outer` holds the thread's
      EXPECT_NE(&*nested, first);
      EXPECT_TRUE(nested->values.empty());
      nested->values.assign(10, 1);
    }
    EXPECT_EQ(outer->values, std::vector<int>(1000, 7));  // untouched by the nested holder
  }
  {
    ThreadScratch<Arrays> next(500);
    EXPECT_EQ(&*next, first);
    EXPECT_EQ(next->values.size(), 1000u);  // kept: the next step reuses the capacity
  }
  const Arrays* elsewhere = nullptr;
  std::thread([&] {
    ThreadScratch<Arrays> other(1000);
    elsewhere = &*other;
    EXPECT_TRUE(other->values.empty());
  }).join();
  EXPECT_NE(elsewhere, first);
}

TEST(ThreadScratchTest, AStepAboveTheKeptSizeFreesTheStorageWhenItEnds) {
  {
    ThreadScratch<Arrays> large(kKeptScratchSamples + 1);
    large->values.assign(kKeptScratchSamples + 1, 3);
  }
  ThreadScratch<Arrays> next(100);
  EXPECT_TRUE(next->values.empty());
  EXPECT_EQ(next->values.capacity(), 0u);
  next->values.assign(100, 4);
}

}  // namespace
}  // namespace sparsebalance
