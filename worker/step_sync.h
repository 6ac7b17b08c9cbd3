// The per-step synchronisation of CPU workers: what the gradient all-reduce is on GPUs (NCCL),
// so that a fast rank really waits for the slowest and its waiting time is real. A hub (run
// by sb-run, like torchrun's rendezvous store) and one client per rank, over TCP with one text
// line per message:
//
//   rank -> hub   HELLO <rank>                      (on every connect; replaces an old one)
//   rank -> hub   ARRIVE <step> <phase> <value>
//   hub  -> rank  RELEASE <step> <phase> <max value over ranks>
//
// A (step, phase) is released when every rank has arrived; arriving again (a restarted rank)
// is harmless and, once released, answered at once. Phases: kPlanPhase (all-reduce of "I fell
// back to the local plan") and kGradientPhase (the step's end).
//
// The hub is also the address book of the ranks' shard exchange (worker/shard_exchange.h), on
// connections of their own (no HELLO, so they never replace a rank's step-sync connection):
//
//   rank -> hub   ADDRESS <rank> <host:port>        (registers; a restarted rank replaces it)
//   hub  -> rank  OK
//   rank -> hub   WHERE <rank>
//   hub  -> rank  AT <rank> <host:port>  or  AT <rank> -   (not registered yet)
//
//   StepSyncHub hub(/*ranks=*/4);          // in the launcher
//   auto sync = StepSyncClient::Connect(hub.address(), rank);
//   absl::StatusOr<double> any = sync->AllReduceMax(step, kPlanPhase, fell_back ? 1 : 0);
#ifndef SPARSEBALANCE_WORKER_STEP_SYNC_H_
#define SPARSEBALANCE_WORKER_STEP_SYNC_H_

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>

#include "absl/status/statusor.h"

namespace sparsebalance {

inline constexpr int kPlanPhase = 0;
inline constexpr int kGradientPhase = 1;

class StepSyncHub {
 public:
  // Listens on 127.0.0.1 (a free port unless `port` is given) and serves until destroyed.
  static absl::StatusOr<std::unique_ptr<StepSyncHub>> Start(int ranks, int port = 0);
  ~StepSyncHub();
  std::string address() const;  // host:port

 private:
  StepSyncHub(int ranks, int listen_fd, int port);
  void Serve();

  const int ranks_;
  const int listen_fd_;
  const int port_;
  int wake_fds_[2] = {-1, -1};  // a pipe that ends Serve()
  std::thread thread_;
};

// Registers `rank`'s shard-exchange listen address with the hub at `hub_address`.
absl::Status RegisterRankAddress(const std::string& hub_address, int rank,
                                 const std::string& address, double timeout_seconds = 60);
// The address `rank` registered, asking again until it has or `timeout_seconds` passed
// (DEADLINE_EXCEEDED naming the rank).
absl::StatusOr<std::string> LookupRankAddress(const std::string& hub_address, int rank,
                                              double timeout_seconds = 60);

class StepSyncClient {
 public:
  static absl::StatusOr<std::unique_ptr<StepSyncClient>> Connect(const std::string& address,
                                                                 int rank,
                                                                 double timeout_seconds = 60);
  ~StepSyncClient();
  // Blocks until every rank has arrived at (step, phase); returns the largest value. Reconnects
  // once if the hub connection broke. DEADLINE_EXCEEDED after `timeout_seconds`.
  absl::StatusOr<double> AllReduceMax(int64_t step, int phase, double value,
                                      double timeout_seconds = 600);

 private:
  StepSyncClient(std::string address, int rank, int fd)
      : address_(std::move(address)), rank_(rank), fd_(fd) {}
  absl::StatusOr<double> Exchange(int64_t step, int phase, double value, double timeout_seconds);

  std::string address_;
  int rank_;
  int fd_;
  std::string buffer_;  // bytes read past the last line
};

}  // namespace sparsebalance

#endif  // SPARSEBALANCE_WORKER_STEP_SYNC_H_
