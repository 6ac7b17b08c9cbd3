// A step's reports, one slot per rank of its job: whether the rank reported, its micro-batches'
// timings and the seconds it waited for its plan. Ranks are a job's 0..world-1, so a slot per
// rank replaces the maps by rank that cost a tree node per report (two, with the waits), a
// tree walk per report and a pointer chase per rank in each of the fold's walks.
//
//   StepReports reports;
//   reports.Put(rank, std::move(timings), wait_seconds);
//   for (int rank = 0; rank < reports.slots(); ++rank) {
//     if (reports.has(rank)) Use(reports.timings(rank), reports.wait_seconds(rank));
//   }
#ifndef SPARSEBALANCE_SERVER_STEP_REPORTS_H_
#define SPARSEBALANCE_SERVER_STEP_REPORTS_H_

#include <cstddef>
#include <utility>
#include <vector>

#include "planner/types.h"

namespace sparsebalance {

class StepReports {
 public:
  // Whether `rank` reported (false for any rank outside the slots, negative ones included).
  bool has(int rank) const {
    return rank >= 0 && static_cast<size_t>(rank) < present_.size() && present_[rank] != 0;
  }
  int count() const { return count_; }  // ranks that reported
  bool empty() const { return count_ == 0; }
  // One past the highest rank that can have reported: walk [0, slots()) and ask has().
  int slots() const { return static_cast<int>(present_.size()); }
  // Makes room for ranks [0, ranks) at once (a job's world), so that Put does not grow the
  // slots report by report.
  void Reserve(int ranks) {
    if (ranks <= slots()) return;
    present_.resize(ranks, 0);
    timings_.resize(ranks);
    waits_.resize(ranks, 0.0);
  }
  // Rank's report (rank >= 0), replacing one it had; the slots grow to hold it.
  void Put(int rank, std::vector<MicroBatchTiming> timings, double wait_seconds) {
    if (rank >= slots()) Reserve(rank + 1);
    const size_t r = static_cast<size_t>(rank);
    if (present_[r] == 0) ++count_;
    present_[r] = 1;
    timings_[r] = std::move(timings);
    waits_[r] = wait_seconds;
  }
  // A rank that reported (has(rank)): its timings and its wait.
  const std::vector<MicroBatchTiming>& timings(int rank) const { return timings_[rank]; }
  std::vector<MicroBatchTiming>& timings(int rank) { return timings_[rank]; }
  double wait_seconds(int rank) const { return waits_[rank]; }
  // Drops every report and frees the slots.
  void Clear() { *this = StepReports(); }

 private:
  std::vector<char> present_;  // by rank: 1 when it reported
  std::vector<std::vector<MicroBatchTiming>> timings_;
  std::vector<double> waits_;
  int count_ = 0;
};

}  // namespace sparsebalance

#endif  // SPARSEBALANCE_SERVER_STEP_REPORTS_H_
