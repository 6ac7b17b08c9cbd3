// The property every deferral test checks (overflow=defer must never drop a document): over the
// steps a run made, each sample submitted in them was trained exactly once, and nothing else
// was trained.
//
//   std::vector<std::vector<Sample>> submitted;  // per step, the new samples passed to Plan
//   std::map<uint64_t, int> trained;              // id -> times a plan put it in a micro-batch
//   test_support::ExpectTrainedExactlyOnce(submitted, steps_run, trained);
#ifndef SPARSEBALANCE_TESTS_SUPPORT_TRAINED_ONCE_H_
#define SPARSEBALANCE_TESTS_SUPPORT_TRAINED_ONCE_H_

#include <cstdint>
#include <map>
#include <vector>

#include "gtest/gtest.h"
#include "planner/types.h"

namespace sparsebalance::test_support {

inline void ExpectTrainedExactlyOnce(const std::vector<std::vector<Sample>>& submitted, int steps,
                                     const std::map<uint64_t, int>& trained) {
  size_t count = 0;
  for (int step = 0; step < steps; ++step) {
    count += submitted[step].size();
    for (const Sample& s : submitted[step]) {
      auto it = trained.find(s.id);
      EXPECT_TRUE(it != trained.end() && it->second == 1) << "document " << s.id;
    }
  }
  EXPECT_EQ(trained.size(), count);  // nothing trained that was not submitted
}

}  // namespace sparsebalance::test_support

#endif  // SPARSEBALANCE_TESTS_SUPPORT_TRAINED_ONCE_H_
