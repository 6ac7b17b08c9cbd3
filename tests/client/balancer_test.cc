// Balancer against a real sb-planner service on loopback, with its ranks as threads of this
// process and in-process collectives: the job created and joined (and resumed), one collective
// per step, prefetched plans equal to plans made on demand, deferred documents trained once with
// prefetch, the planner stopped mid-run (local plans on every rank, rate-limited warnings, the
// planner's metric counting the local steps, reports delivered by Finish), an unreachable planner
// at start, offline start, and Resume restoring carried samples.
#include "client/balancer.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "client/planner_client.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "planner/planner.h"
#include "proto/wire.h"
#include "server/job_registry.h"
#include "server/planner_service.h"
#include "tests/server/test_support.h"
#include "tests/support/loopback_client.h"
#include "tests/support/older_planner.h"
#include "tests/support/restartable_planner.h"
#include "tests/support/scripted_planner.h"
#include "tests/support/trained_once.h"

namespace sparsebalance {
namespace {

using Planner = test_support::RestartablePlanner;

double LocalPlanSteps(Planner& planner, const std::string& job_id) {
  return planner.Counter("sparsebalance_local_plan_steps_total", job_id);
}

// any_rank and share_job for ranks that are threads of this process: each call is a barrier of
// all `world` ranks. Counts the calls, to check that a step costs one collective.
class Ranks {
 public:
  explicit Ranks(int world) : world_(world), any_rank_calls_(world, 0) {}

  // `base` with this rank's rank, world and collectives.
  BalancerOptions Options(int rank, BalancerOptions base) {
    base.rank = rank;
    base.world = world_;
    base.any_rank = [this, rank](bool mine) { return AnyRank(rank, mine); };
    base.share_job = [this, rank](const JobHandle& job) { return ShareJob(rank, job); };
    return base;
  }
  int any_rank_calls(int rank) {
    absl::MutexLock lock(&mu_);
    return any_rank_calls_[rank];
  }

 private:
  bool AnyRank(int rank, bool mine) {
    absl::MutexLock lock(&mu_);
    ++any_rank_calls_[rank];
    any_ = any_ || mine;
    Arrive([this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      any_result_ = any_;
      any_ = false;
    });
    return any_result_;
  }
  JobHandle ShareJob(int rank, const JobHandle& job) {
    absl::MutexLock lock(&mu_);
    if (rank == 0) offered_ = job;
    Arrive([this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { shared_ = offered_; });
    return shared_;
  }
  // Waits for every rank; the last to arrive runs `last`. A result stays until every rank has
  // read it: the next round cannot end before they all arrive again.
  void Arrive(const std::function<void()>& last) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const int64_t generation = generation_;
    if (++arrived_ == world_) {
      last();
      arrived_ = 0;
      ++generation_;
      done_.SignalAll();
      return;
    }
    while (generation_ == generation) done_.Wait(&mu_);
  }

  const int world_;
  absl::Mutex mu_;
  absl::CondVar done_;
  int arrived_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
  bool any_ ABSL_GUARDED_BY(mu_) = false;
  bool any_result_ ABSL_GUARDED_BY(mu_) = false;
  JobHandle offered_ ABSL_GUARDED_BY(mu_);
  JobHandle shared_ ABSL_GUARDED_BY(mu_);
  std::vector<int> any_rank_calls_ ABSL_GUARDED_BY(mu_);
};

PlannerConfig Config(int ranks) {
  PlannerConfig c;
  c.ranks = ranks;
  c.micro_batches = 2;
  c.micro_batch_capacity = 65536;
  return c;
}

std::vector<Sample> Batch(uint64_t seed, int ranks, double fill = 0.6) {
  return test_support::PretrainBatch(seed, ranks, fill);
}

std::vector<MicroBatchTiming> Timings(const RankStepPlan& plan) {
  return test_support::TimingsOf(plan.micro_batches);
}

std::vector<uint64_t> Ids(const RankStepPlan& plan) {
  std::vector<uint64_t> ids;
  for (const MicroBatchPlan& mb : plan.micro_batches) {
    for (const PlannedSample& p : mb.samples) ids.push_back(p.id);
  }
  return ids;
}

// The ids and densities of a plan, to compare plans.
std::vector<std::pair<uint64_t, double>> Placement(const RankStepPlan& plan) {
  std::vector<std::pair<uint64_t, double>> out;
  for (const MicroBatchPlan& mb : plan.micro_batches) {
    for (const PlannedSample& p : mb.samples) out.emplace_back(p.id, p.density);
  }
  return out;
}

// What waits for the next step is the step's deferred samples, whether or not the background
// has planned the next step already.
void ExpectCarriesWhatItDeferred(const Balancer& balancer, const RankStepPlan& plan) {
  std::set<uint64_t> carried;
  for (const Sample& s : balancer.carried()) carried.insert(s.id);
  EXPECT_EQ(carried, std::set<uint64_t>(plan.deferred_ids.begin(), plan.deferred_ids.end()))
      << "rank " << plan.rank << " step " << plan.step;
}

// A scripted planner's job "job" of `config`: it joins every rank and takes every batch.
void ScriptJob(test_support::ScriptedPlanner* scripted, const PlannerConfig& config) {
  scripted->join_job = [config](const v1::JoinJobRequest&, v1::JoinJobResponse* response) {
    JobSettings settings;
    settings.planner = config;
    *response->mutable_config() = ConfigToProto(settings);
    return grpc::Status::OK;
  };
  scripted->submit_batch = [](const v1::SubmitBatchRequest&, v1::SubmitBatchResponse*) {
    return grpc::Status::OK;
  };
}

// `options` for that job on `scripted`.
BalancerOptions Scripted(BalancerOptions options, const test_support::ScriptedPlanner& scripted) {
  options.client.target = scripted.target();
  options.client.token = "token";
  options.job_id = "job";
  return options;
}

class BalancerTest : public ::testing::Test {
 protected:
  // Options for the planner of this test: a new job of Config(world) unless job_id is given.
  BalancerOptions Options(int world) {
    BalancerOptions options;
    options.client.target = planner_.target();
    options.client.call_timeout_seconds = 2;
    options.client.plan_timeout_seconds = 20;  // ranks wait for the coordinator under load
    options.world = world;
    options.config = Config(world);
    options.warn = [](const std::string&) {};
    return options;
  }
  // Runs `body(rank)` on `world` threads and waits for them.
  static void OnRanks(int world, const std::function<void(int)>& body) {
    std::vector<std::thread> threads;
    for (int r = 0; r < world; ++r) threads.emplace_back(body, r);
    for (std::thread& t : threads) t.join();
  }

  Planner planner_;
};

TEST_F(BalancerTest, CreatesTheJobJoinsItAndResumesIt) {
  constexpr int kSteps = 3;
  BalancerOptions options = Options(1);
  options.job_name = "create";
  absl::StatusOr<std::unique_ptr<Balancer>> balancer = Balancer::Start(options);
  ASSERT_TRUE(balancer.ok()) << balancer.status();
  Balancer& b = **balancer;
  const JobHandle job = b.job();
  EXPECT_FALSE(job.job_id.empty());
  EXPECT_FALSE(job.token.empty());
  EXPECT_EQ(b.config().ranks, 1);
  EXPECT_EQ(b.next_step(), 0);
  for (int64_t step = 0; step < kSteps; ++step) {
    absl::StatusOr<RankStepPlan> plan = b.Plan(step, Batch(10 + step, 1));
    ASSERT_TRUE(plan.ok()) << plan.status();
    EXPECT_FALSE(plan->local_fallback);
    EXPECT_EQ(plan->step, step);
    if (step + 1 < kSteps) b.Prefetch(step + 1, Batch(10 + step + 1, 1));
    b.Report(step, Timings(*plan), 0.0);
  }
  absl::Status finished = b.Finish(20);
  ASSERT_TRUE(finished.ok()) << finished;
  const Balancer::Stats stats = b.stats();
  EXPECT_EQ(stats.planned_steps, kSteps);
  EXPECT_EQ(stats.local_steps, 0);
  EXPECT_EQ(stats.buffered_reports, 0);
  EXPECT_EQ(stats.dropped_reports, 0);
  EXPECT_TRUE(stats.planner_reachable);
  absl::StatusOr<JobView> view = planner_.registry().GetJob(job.job_id);
  ASSERT_TRUE(view.ok());
  EXPECT_EQ(view->name, "create");
  EXPECT_EQ(view->next_step, kSteps);
  EXPECT_EQ(view->steps_folded, kSteps);  // every report reached the model

  // A restarted trainer joins the same job and resumes after the last reported step.
  BalancerOptions again = Options(1);
  again.job_id = job.job_id;
  again.client.token = job.token;
  absl::StatusOr<std::unique_ptr<Balancer>> resumed = Balancer::Start(again);
  ASSERT_TRUE(resumed.ok()) << resumed.status();
  EXPECT_EQ((*resumed)->job().job_id, job.job_id);
  EXPECT_EQ((*resumed)->next_step(), kSteps);
  absl::StatusOr<RankStepPlan> next = (*resumed)->Plan(kSteps, Batch(99, 1));
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_FALSE(next->local_fallback);
  // A wrong token is an error as the planner says it, not a fallback.
  BalancerOptions wrong = Options(1);
  wrong.job_id = job.job_id;
  wrong.client.token = "not-the-token";
  absl::StatusOr<std::unique_ptr<Balancer>> refused = Balancer::Start(wrong);
  EXPECT_TRUE(refused.status().code() == absl::StatusCode::kPermissionDenied ||
              refused.status().code() == absl::StatusCode::kUnauthenticated)
      << refused.status();
}

TEST_F(BalancerTest, RanksAsThreadsPlanEveryStepWithOneCollective) {
  constexpr int kRanks = 4;
  constexpr int kSteps = 4;
  Ranks ranks(kRanks);
  absl::Mutex mu;
  std::map<int64_t, std::multiset<uint64_t>> placed;
  std::vector<std::string> job_ids(kRanks);
  OnRanks(kRanks, [&](int r) {
    absl::StatusOr<std::unique_ptr<Balancer>> b = Balancer::Start(ranks.Options(r, Options(4)));
    ASSERT_TRUE(b.ok()) << b.status();
    job_ids[r] = (*b)->job().job_id;
    for (int64_t step = 0; step < kSteps; ++step) {
      if (step + 1 < kSteps) (*b)->Prefetch(step + 1, Batch(300 + step + 1, kRanks));
      absl::StatusOr<RankStepPlan> plan = (*b)->Plan(step, Batch(300 + step, kRanks));
      ASSERT_TRUE(plan.ok()) << plan.status();
      EXPECT_FALSE(plan->local_fallback);
      EXPECT_EQ(plan->rank, r);
      {
        absl::MutexLock lock(&mu);
        for (uint64_t id : Ids(*plan)) placed[step].insert(id);
      }
      (*b)->Report(step, Timings(*plan), 0.0);
    }
    absl::Status finished = (*b)->Finish(20);
    EXPECT_TRUE(finished.ok()) << finished;
    EXPECT_EQ((*b)->stats().planned_steps, kSteps);
  });
  for (int r = 0; r < kRanks; ++r) {
    EXPECT_EQ(job_ids[r], job_ids[0]);  // rank 0's job reached every rank
    // Three at Start (errors, unreachable, and the step to start at: one probe for a new
    // job), then one per step.
    EXPECT_EQ(ranks.any_rank_calls(r), 3 + kSteps) << "rank " << r;
  }
  for (int64_t step = 0; step < kSteps; ++step) {
    const std::vector<Sample> batch = Batch(300 + step, kRanks);
    ASSERT_EQ(placed[step].size(), batch.size()) << "step " << step;
    for (const Sample& s : batch) EXPECT_EQ(placed[step].count(s.id), 1u) << s.id;
  }
  absl::StatusOr<JobView> view = planner_.registry().GetJob(job_ids[0]);
  ASSERT_TRUE(view.ok());
  EXPECT_EQ(view->steps_folded, kSteps);
}

// Ranks that rejoin a job after one of them died with its last report undelivered start at
// one step, the least of the steps each had not reported (they each started at their own: the
// ranks then trained parts of different global batches in every step after, silently). The
// rank that had reported that step does not report it again: its first report stands, and
// Finish is clean.
TEST_F(BalancerTest, RanksThatRejoinAJobStartAtTheSameStep) {
  constexpr int kRanks = 2;
  Ranks first(kRanks);
  JobHandle job;
  OnRanks(kRanks, [&](int r) {
    absl::StatusOr<std::unique_ptr<Balancer>> b =
        Balancer::Start(first.Options(r, Options(kRanks)));
    ASSERT_TRUE(b.ok()) << b.status();
    if (r == 0) job = (*b)->job();
    for (int64_t step = 0; step < 3; ++step) {
      absl::StatusOr<RankStepPlan> plan = (*b)->Plan(step, Batch(500 + step, kRanks));
      ASSERT_TRUE(plan.ok()) << plan.status();
      // Rank 1 dies before its report of step 2 leaves.
      if (r == 0 || step < 2) (*b)->Report(step, Timings(*plan), 0.0);
    }
    EXPECT_TRUE((*b)->Finish(20).ok());
  });
  ASSERT_FALSE(job.job_id.empty());
  Ranks second(kRanks);
  std::vector<int64_t> started(kRanks, -1);
  OnRanks(kRanks, [&](int r) {
    BalancerOptions options = second.Options(r, Options(kRanks));
    if (r == 0) options.job_id = job.job_id;  // the others are given it by share_job
    options.client.token = job.token;
    absl::StatusOr<std::unique_ptr<Balancer>> b = Balancer::Start(options);
    ASSERT_TRUE(b.ok()) << b.status();
    started[r] = (*b)->next_step();
    for (int64_t step = started[r]; step < 4; ++step) {
      absl::StatusOr<RankStepPlan> plan = (*b)->Plan(step, Batch(500 + step, kRanks));
      ASSERT_TRUE(plan.ok()) << plan.status();
      EXPECT_FALSE(plan->local_fallback);
      (*b)->Report(step, Timings(*plan), 0.0);
    }
    absl::Status finished = (*b)->Finish(20);
    EXPECT_TRUE(finished.ok()) << "rank " << r << ": " << finished;
    EXPECT_EQ((*b)->stats().dropped_reports, 0) << "rank " << r;
  });
  EXPECT_EQ(started, (std::vector<int64_t>{2, 2}));
  absl::StatusOr<JobView> view = planner_.registry().GetJob(job.job_id);
  ASSERT_TRUE(view.ok()) << view.status();
  EXPECT_EQ(view->next_step, 4);
  EXPECT_EQ(view->steps_folded, 4);  // every step fully reported, each report once
}

// gather_reports, plan_group and scatter_plans for ranks that are threads of this process, in
// groups ("nodes") of `per_node` consecutive ranks led by the first: each call of a collective
// is a barrier of the node's ranks.
class NodeCollectives {
 public:
  NodeCollectives(int world, int per_node) : per_node_(per_node), nodes_(world / per_node) {}
  std::function<std::vector<std::string>(const std::string&)> Gather(int rank) {
    return [this, rank](const std::string& report) {
      std::vector<std::vector<std::string>> all = Exchange(rank, {report});
      std::vector<std::string> gathered;
      if (rank % per_node_ != 0) return gathered;
      for (std::vector<std::string>& one : all) gathered.push_back(std::move(one[0]));
      return gathered;
    };
  }
  std::function<std::string(const std::vector<std::string>&)> Scatter(int rank) {
    return [this, rank](const std::vector<std::string>& payloads) {
      return Exchange(rank, payloads)[0].at(rank % per_node_);
    };
  }
  std::vector<int> Group(int rank) const {
    std::vector<int> group(per_node_);
    for (int k = 0; k < per_node_; ++k) group[k] = rank / per_node_ * per_node_ + k;
    return group;
  }

 private:
  struct Node {
    std::vector<std::vector<std::string>> given;
    std::vector<std::vector<std::string>> last;  // the last round's, by rank in the node
    int arrived = 0;
    int64_t generation = 0;
  };
  // Every rank of the node passes `mine`; each gets what every rank passed.
  std::vector<std::vector<std::string>> Exchange(int rank, std::vector<std::string> mine) {
    absl::MutexLock lock(&mu_);
    Node& node = nodes_[rank / per_node_];
    const int64_t generation = node.generation;
    node.given.resize(per_node_);
    node.given[rank % per_node_] = std::move(mine);
    if (++node.arrived == per_node_) {
      node.last = std::move(node.given);
      node.given.clear();
      node.arrived = 0;
      ++node.generation;
      done_.SignalAll();
    }
    // A result stays until every rank has read it: the next round needs them all again.
    while (node.generation == generation) done_.Wait(&mu_);
    return node.last;
  }

  const int per_node_;
  absl::Mutex mu_;
  absl::CondVar done_;
  std::vector<Node> nodes_ ABSL_GUARDED_BY(mu_);
};

// With gather_reports each node's leader sends its node's reports in ReportStepBatch calls and
// no rank calls ReportStep: every report reaches the model. A leader handed bytes that are not a
// report says so and sends the rest; a member that skips a step's report lets the others' go.
TEST_F(BalancerTest, NodeLeadersSendTheirNodesReportsInBatches) {
  constexpr int kRanks = 4;
  constexpr int kSteps = 4;
  Ranks ranks(kRanks);
  NodeCollectives node(kRanks, 2);
  std::vector<std::string> job_ids(kRanks);
  std::vector<Balancer::Stats> stats(kRanks);
  absl::Mutex mu;
  std::vector<std::string> warnings;
  OnRanks(kRanks, [&](int r) {
    BalancerOptions options = ranks.Options(r, Options(kRanks));
    options.gather_reports = [&, r, inner = node.Gather(r)](const std::string& report) {
      std::vector<std::string> gathered = inner(report);
      if (r == 2 && !gathered.empty()) gathered.push_back("not a report");
      return gathered;
    };
    options.warn = [&](const std::string& line) {
      absl::MutexLock lock(&mu);
      warnings.push_back(line);
    };
    absl::StatusOr<std::unique_ptr<Balancer>> b = Balancer::Start(options);
    ASSERT_TRUE(b.ok()) << b.status();
    job_ids[r] = (*b)->job().job_id;
    for (int64_t step = 0; step < kSteps; ++step) {
      absl::StatusOr<RankStepPlan> plan = (*b)->Plan(step, Batch(700 + step, kRanks));
      ASSERT_TRUE(plan.ok()) << plan.status();
      EXPECT_FALSE(plan->local_fallback);
      if (r == 3 && step == kSteps - 1) {
        (*b)->SkipReport(step);
      } else {
        (*b)->Report(step, Timings(*plan), 0.01 * r);
      }
    }
    absl::Status finished = (*b)->Finish(20);
    EXPECT_TRUE(finished.ok()) << finished;
    stats[r] = (*b)->stats();
  });
  absl::StatusOr<JobView> view = planner_.registry().GetJob(job_ids[0]);
  ASSERT_TRUE(view.ok());
  // Every report of every step arrived: the last step lacks only rank 3's.
  EXPECT_EQ(view->steps_folded, kSteps - 1);
  absl::StatusOr<bool> rank2_again =
      planner_.registry().ReportStep(job_ids[0], kSteps - 1, 2, {}, 0.0);
  EXPECT_EQ(rank2_again.status().code(), absl::StatusCode::kAlreadyExists)
      << rank2_again.status();  // rank 2's report of the last step is there (and differs)
  // A lone report goes by ReportStep: at most node 1's of the last step (rank 3 skipped it),
  // unless its leader had an earlier step's still queued with it.
  EXPECT_LE(planner_.Calls("ReportStep"), 1);
  // One call per node and step, or fewer when a leader had several steps queued.
  EXPECT_GE(planner_.Calls("ReportStepBatch"), 2);
  EXPECT_LE(planner_.Calls("ReportStepBatch"), 2 * kSteps);
  for (int r = 0; r < kRanks; ++r) {
    EXPECT_EQ(stats[r].buffered_reports, 0) << "rank " << r;
    EXPECT_EQ(stats[r].dropped_reports, 0) << "rank " << r;
  }
  ASSERT_EQ(warnings.size(), static_cast<size_t>(kSteps));  // rank 2's extra bytes, each step
  EXPECT_NE(warnings[0].find("gather_reports: member 2's report of step 0 was dropped"),
            std::string::npos)
      << warnings[0];
}

// With plan_group and scatter_plans each node's leader fetches the node's plans in one
// GetRankPlans call (prefetched) and hands them over; no rank calls GetRankPlan. Every rank gets
// the plan GetRankPlan would give it, and the documents an overfull step deferred are carried on
// every rank and trained exactly once. The node's reports go by its leader too.
TEST_F(BalancerTest, NodeLeadersFetchTheirNodesPlansInOneCallAndHandThemOver) {
  constexpr int kRanks = 4;
  constexpr int kSteps = 5;
  Ranks ranks(kRanks);
  NodeCollectives node(kRanks, 2);
  std::vector<std::vector<Sample>> submitted;
  for (int step = 0; step < kSteps; ++step) {
    std::vector<Sample> batch = Batch(800 + step, kRanks, step < 2 ? 1.3 : 0.3);
    for (size_t i = 0; i < batch.size(); ++i) batch[i].id = 1000000 * (step + 1) + i;
    submitted.push_back(std::move(batch));
  }
  absl::Mutex mu;
  std::map<uint64_t, int> trained;
  std::map<std::pair<int64_t, int>, std::vector<std::pair<uint64_t, double>>> placements;
  std::vector<Balancer::Stats> stats(kRanks);
  JobHandle job;
  OnRanks(kRanks, [&](int r) {
    BalancerOptions options = Options(kRanks);
    options.config.overflow = OverflowPolicy::kDefer;
    options = ranks.Options(r, options);
    options.plan_group = node.Group(r);
    options.scatter_plans = node.Scatter(r);
    options.gather_reports = node.Gather(r);
    absl::StatusOr<std::unique_ptr<Balancer>> b = Balancer::Start(options);
    ASSERT_TRUE(b.ok()) << b.status();
    if (r == 0) job = (*b)->job();
    for (int64_t step = 0; step < kSteps; ++step) {
      absl::StatusOr<RankStepPlan> plan = (*b)->Plan(step, submitted[step]);
      ASSERT_TRUE(plan.ok()) << "rank " << r << " step " << step << ": " << plan.status();
      EXPECT_FALSE(plan->local_fallback);
      EXPECT_EQ(plan->rank, r);
      if (step + 1 < kSteps) (*b)->Prefetch(step + 1, submitted[step + 1]);
      ExpectCarriesWhatItDeferred(**b, *plan);
      {
        absl::MutexLock lock(&mu);
        for (uint64_t id : Ids(*plan)) ++trained[id];
        placements[{step, r}] = Placement(*plan);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));  // "trains"
      (*b)->Report(step, Timings(*plan), 0.0);
    }
    absl::Status finished = (*b)->Finish(20);
    EXPECT_TRUE(finished.ok()) << finished;
    stats[r] = (*b)->stats();
  });
  ASSERT_FALSE(job.job_id.empty());
  EXPECT_EQ(planner_.Calls("GetRankPlan"), 0);
  EXPECT_EQ(planner_.Calls("GetRankPlans"), 2 * kSteps);  // one per node and step
  EXPECT_EQ(planner_.Calls("ReportStep"), 0);
  test_support::ExpectTrainedExactlyOnce(submitted, kSteps, trained);
  EXPECT_GT(stats[0].prefetched_steps, 0);  // the leaders prefetched their nodes' plans
  for (int r = 0; r < kRanks; ++r) {
    // A member's plan counts as prefetched when its leader's prefetch fetched it.
    EXPECT_EQ(stats[r].prefetched_steps, stats[node.Group(r).front()].prefetched_steps)
        << "rank " << r;
    EXPECT_EQ(stats[r].planned_steps, kSteps) << "rank " << r;
    EXPECT_EQ(stats[r].local_steps, 0) << "rank " << r;
    EXPECT_EQ(stats[r].buffered_reports, 0) << "rank " << r;
  }
  absl::StatusOr<JobView> view = planner_.registry().GetJob(job.job_id);
  ASSERT_TRUE(view.ok());
  EXPECT_EQ(view->steps_folded, kSteps);
  // Each rank ran the plan GetRankPlan gives it.
  ClientOptions client;
  client.target = planner_.target();
  client.job_id = job.job_id;
  client.token = job.token;
  absl::StatusOr<std::unique_ptr<PlannerClient>> direct = PlannerClient::Connect(client);
  ASSERT_TRUE(direct.ok());
  for (int64_t step = 0; step < kSteps; ++step) {
    for (int r = 0; r < kRanks; ++r) {
      absl::StatusOr<RankStepPlan> plan = (*direct)->GetRankPlan(step, r);
      ASSERT_TRUE(plan.ok()) << plan.status();
      EXPECT_EQ(Placement(*plan), (placements[{step, r}])) << "rank " << r << " step " << step;
    }
  }
}

// The planner refuses rank 1's plan call for its own reason (RESOURCE_EXHAUSTED at
// --max_waiting_calls) while rank 0 gets the planner's plan: rank 1 plans locally, and the step's
// collective has rank 0 run the local plan too, so both run one plan. An error of rank 1's input
// (PERMISSION_DENIED) is then every rank's: rank 0 returns ABORTED instead of training the step
// alone and waiting for rank 1 in its next collective.
TEST_F(BalancerTest, APlannerErrorOnOneRankIsEveryRanksFallbackAndAnInputErrorEveryRanksError) {
  constexpr int kRanks = 2;
  const PlannerConfig config = Config(kRanks);
  auto batch = [](int64_t step) { return Batch(700 + step, kRanks); };
  test_support::ScriptedPlanner scripted;
  ScriptJob(&scripted, config);
  scripted.get_rank_plan = [&](const v1::GetRankPlanRequest& request,
                               v1::GetRankPlanResponse* response) {
    if (request.rank() == 1) {
      return request.step() == 0
                 ? grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                                "GetRankPlan: 2 calls are waiting for plans, this planner's limit")
                 : grpc::Status(grpc::StatusCode::PERMISSION_DENIED, "the job token is wrong");
    }
    absl::StatusOr<StepPlan> plan = PlanStepLocally(batch(request.step()), config);
    if (!plan.ok()) return grpc::Status(grpc::StatusCode::INTERNAL, "no plan");
    RankPlanToProto(*plan, request.step(), request.rank(), response->mutable_plan());
    response->mutable_plan()->set_planned_locally(false);  // the planner's, as far as rank 0 knows
    return grpc::Status::OK;
  };
  Ranks ranks(kRanks);
  std::vector<absl::StatusOr<RankStepPlan>> step0(kRanks, absl::UnknownError("not run"));
  std::vector<absl::Status> step1(kRanks);
  std::vector<std::string> last_errors(kRanks);
  OnRanks(kRanks, [&](int r) {
    const BalancerOptions options = Scripted(ranks.Options(r, Options(kRanks)), scripted);
    absl::StatusOr<std::unique_ptr<Balancer>> b = Balancer::Start(options);
    ASSERT_TRUE(b.ok()) << b.status();
    step0[r] = (*b)->Plan(0, batch(0));
    last_errors[r] = (*b)->stats().last_error;
    step1[r] = (*b)->Plan(1, batch(1)).status();
  });
  std::multiset<uint64_t> trained;
  for (int r = 0; r < kRanks; ++r) {
    ASSERT_TRUE(step0[r].ok()) << "rank " << r << ": " << step0[r].status();
    EXPECT_TRUE(step0[r]->local_fallback) << "rank " << r;
    for (uint64_t id : Ids(*step0[r])) trained.insert(id);
  }
  for (const Sample& s : batch(0)) EXPECT_EQ(trained.count(s.id), 1u) << s.id;
  EXPECT_EQ(trained.size(), batch(0).size());
  EXPECT_NE(last_errors[0].find("another rank could not get the planner's plan"), std::string::npos)
      << last_errors[0];
  EXPECT_NE(last_errors[1].find("RESOURCE_EXHAUSTED"), std::string::npos) << last_errors[1];
  EXPECT_EQ(step1[1].code(), absl::StatusCode::kPermissionDenied) << step1[1];
  EXPECT_EQ(step1[0].code(), absl::StatusCode::kAborted) << step1[0];
}

// The planner's record of a step is a local plan (the coordinator resubmitted it after a rank
// fell back), made with the job's config as it is now; rank 1, whose plan call the planner
// refused for its own reason, made its local plan with the config it joined with. Rank 0 kept
// the planner's copy, so after an UpdateJobConfig (here: policy sequential on the planner,
// sparsebalance on the trainers) the two ranks trained two different plans: documents twice
// and never. Every rank now makes its own local plan, and they run one.
TEST_F(BalancerTest, RanksRunTheirOwnLocalPlanNotThePlannersCopyOfOne) {
  constexpr int kRanks = 2;
  const PlannerConfig joined = Config(kRanks);  // sparsebalance
  PlannerConfig updated = joined;
  updated.policy = Policy::kSequential;
  const std::vector<Sample> batch = Batch(900, kRanks);
  absl::StatusOr<StepPlan> ours = PlanStepLocally(batch, joined);
  absl::StatusOr<StepPlan> theirs = PlanStepLocally(batch, updated);
  ASSERT_TRUE(ours.ok() && theirs.ok());
  ASSERT_NE(CanonicalPlanText(*ours), CanonicalPlanText(*theirs));  // the case is real
  test_support::ScriptedPlanner scripted;
  ScriptJob(&scripted, joined);
  scripted.get_rank_plan = [&](const v1::GetRankPlanRequest& request,
                               v1::GetRankPlanResponse* response) {
    if (request.rank() == 1) {
      return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, "GetRankPlan: at the limit");
    }
    RankPlanToProto(*theirs, request.step(), request.rank(), response->mutable_plan());
    response->mutable_plan()->set_planned_locally(true);
    return grpc::Status::OK;
  };
  Ranks ranks(kRanks);
  std::vector<absl::StatusOr<RankStepPlan>> plans(kRanks, absl::UnknownError("not run"));
  OnRanks(kRanks, [&](int r) {
    const BalancerOptions options = Scripted(ranks.Options(r, Options(kRanks)), scripted);
    absl::StatusOr<std::unique_ptr<Balancer>> b = Balancer::Start(options);
    ASSERT_TRUE(b.ok()) << b.status();
    plans[r] = (*b)->Plan(0, batch);
  });
  std::multiset<uint64_t> trained;
  for (int r = 0; r < kRanks; ++r) {
    ASSERT_TRUE(plans[r].ok()) << "rank " << r << ": " << plans[r].status();
    EXPECT_TRUE(plans[r]->local_fallback) << "rank " << r;
    std::vector<uint64_t> expected;
    for (const MicroBatchPlan& mb : ours->ranks[r].micro_batches) {
      for (const PlannedSample& p : mb.samples) expected.push_back(p.id);
    }
    EXPECT_EQ(Ids(*plans[r]), expected) << "rank " << r;
    for (uint64_t id : Ids(*plans[r])) trained.insert(id);
  }
  for (const Sample& s : batch) EXPECT_EQ(trained.count(s.id), 1u) << s.id;
}

// A trainer that runs documents whole (sparsebalance.torch: runs_shards false) on a job whose
// max_shards was raised to 2 by UpdateJobConfig after it joined: the planner's plans now hold
// shards. Each rank of a shard's group trained the whole document with a loss weight of its whole
// length; now the ranks holding a shard refuse the step, naming it and the sample, and the rank
// holding none returns ABORTED rather than go on into the next step's collective alone.
TEST_F(BalancerTest, ATrainerThatRunsDocumentsWholeRefusesAShardOnEveryRank) {
  constexpr int kRanks = 3;
  PlannerConfig joined = Config(kRanks);
  joined.micro_batches = 1;
  joined.micro_batch_capacity = 32768;
  PlannerConfig raised = joined;
  raised.max_shards = 2;
  // Document 1 fits a micro-batch but costs more than a rank's share: split over two ranks.
  std::vector<Sample> batch = {{1, 30000, 0.0, 0, {}}};
  for (uint64_t id = 2; id < 10; ++id) batch.push_back({id, 2000, 0.0, 0, {}});
  absl::StatusOr<StepPlan> theirs = PlanStepLocally(batch, raised);
  ASSERT_TRUE(theirs.ok()) << theirs.status();
  std::vector<bool> holds_shard(kRanks, false);
  for (int r = 0; r < kRanks; ++r) {
    for (const MicroBatchPlan& mb : theirs->ranks[r].micro_batches) {
      for (const PlannedSample& p : mb.samples) holds_shard[r] = holds_shard[r] || p.sharded();
    }
  }
  // The case is real: some ranks hold a shard of document 1, one holds none.
  ASSERT_EQ(std::count(holds_shard.begin(), holds_shard.end(), true), 2);
  test_support::ScriptedPlanner scripted;
  ScriptJob(&scripted, joined);
  scripted.get_rank_plan = [&](const v1::GetRankPlanRequest& request,
                               v1::GetRankPlanResponse* response) {
    RankPlanToProto(*theirs, request.step(), request.rank(), response->mutable_plan());
    response->mutable_plan()->set_planned_locally(false);
    return grpc::Status::OK;
  };
  for (bool runs_shards : {false, true}) {
    SCOPED_TRACE(runs_shards ? "runs shards" : "runs documents whole");
    Ranks ranks(kRanks);
    std::vector<absl::StatusOr<RankStepPlan>> plans(kRanks, absl::UnknownError("not run"));
    OnRanks(kRanks, [&](int r) {
      BalancerOptions options = Scripted(ranks.Options(r, Options(kRanks)), scripted);
      options.runs_shards = runs_shards;
      options.prefetch = false;
      absl::StatusOr<std::unique_ptr<Balancer>> b = Balancer::Start(options);
      ASSERT_TRUE(b.ok()) << b.status();
      plans[r] = (*b)->Plan(0, batch);
    });
    for (int r = 0; r < kRanks; ++r) {
      SCOPED_TRACE(absl::StrCat("rank ", r));
      if (runs_shards) {  // sb-worker: the shards are its to run
        EXPECT_TRUE(plans[r].ok()) << plans[r].status();
        continue;
      }
      const absl::Status status = plans[r].status();
      if (!holds_shard[r]) {
        EXPECT_EQ(status.code(), absl::StatusCode::kAborted) << status;
        continue;
      }
      EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition) << status;
      EXPECT_NE(status.message().find("step 0: sample 1 "), std::string::npos) << status;
      EXPECT_NE(status.message().find("max_shards was raised above 1"), std::string::npos)
          << status;
      EXPECT_NE(status.message().find("runs documents whole"), std::string::npos) << status;
    }
  }
}

// A plan group's leader that falls back (the planner stopped) has its members plan locally with
// it, saying whose fallback it was; a leader's error (a batch other than the one rank 0
// submitted) is its members' error too, with the leader's code, and the other node's ranks
// return ABORTED rather than run the step without them.
TEST_F(BalancerTest, APlanGroupFallsBackWithItsLeaderAndSharesItsError) {
  constexpr int kRanks = 4;
  Ranks ranks(kRanks);
  NodeCollectives node(kRanks, 2);
  Ranks step_barrier(kRanks);
  std::vector<std::vector<absl::Status>> results(kRanks);
  std::vector<std::vector<bool>> local(kRanks);
  std::vector<std::string> last_errors(kRanks);
  OnRanks(kRanks, [&](int r) {
    BalancerOptions options = ranks.Options(r, Options(kRanks));
    options.client.call_timeout_seconds = 0.5;
    options.plan_group = node.Group(r);
    options.scatter_plans = node.Scatter(r);
    absl::StatusOr<std::unique_ptr<Balancer>> b = Balancer::Start(options);
    ASSERT_TRUE(b.ok()) << b.status();
    auto sync = step_barrier.Options(r, {}).any_rank;
    for (int64_t step = 0; step < 3; ++step) {
      sync(false);
      if (r == 0 && step == 2) planner_.Stop();
      sync(false);
      // Step 1: rank 2, node 1's leader, passes another batch than rank 0 submitted.
      absl::StatusOr<RankStepPlan> plan =
          (*b)->Plan(step, Batch(r == 2 && step == 1 ? 999 : 850 + step, kRanks));
      results[r].push_back(plan.status());
      local[r].push_back(plan.ok() && plan->local_fallback);
      if (step == 2) last_errors[r] = (*b)->stats().last_error;
    }
  });
  for (int r = 0; r < kRanks; ++r) {
    EXPECT_TRUE(results[r][0].ok()) << "rank " << r << ": " << results[r][0];
    EXPECT_FALSE(local[r][0]) << "rank " << r;
    EXPECT_TRUE(results[r][2].ok()) << "rank " << r << ": " << results[r][2];
    EXPECT_TRUE(local[r][2]) << "rank " << r;  // the planner was away: every rank local
  }
  // Step 1: node 1 shares its leader's error; node 0 learns of it and runs nothing.
  EXPECT_EQ(results[2][1].code(), absl::StatusCode::kFailedPrecondition) << results[2][1];
  EXPECT_EQ(results[3][1].code(), absl::StatusCode::kFailedPrecondition) << results[3][1];
  EXPECT_NE(results[3][1].message().find("rank 2, which leads this rank's plan group, could not "
                                         "plan step 1: the planner's plan of step 1 does not fit"),
            std::string::npos)
      << results[3][1];
  for (int r : {0, 1}) {
    EXPECT_EQ(results[r][1].code(), absl::StatusCode::kAborted) << "rank " << r;
    EXPECT_NE(results[r][1].message().find("another rank could not plan step 1"), std::string::npos)
        << results[r][1];
  }
  // Step 2: the members say their leader fell back.
  for (int r : {1, 3}) {
    EXPECT_NE(last_errors[r].find(
                  absl::StrCat("rank ", r - 1, ", which leads this rank's plan group, fell back")),
              std::string::npos)
        << last_errors[r];
  }
}

// Against a planner older than GetRankPlans and ReportStepBatch (both UNIMPLEMENTED), ranks
// set up to plan and report by node still train on the planner's plans: the leader's first
// GetRankPlans tells it to fetch its own plan, and its members their own, from then on by
// GetRankPlan; reports go one call each. Every report reaches the model.
TEST_F(BalancerTest, AgainstAnOlderPlannerNodeRanksFetchTheirOwnPlans) {
  constexpr int kRanks = 4;
  constexpr int kSteps = 3;
  test_support::OlderPlanner older(planner_.target());
  Ranks ranks(kRanks);
  NodeCollectives node(kRanks, 2);
  absl::Mutex mu;
  std::map<int64_t, std::multiset<uint64_t>> placed;
  std::string job_id;
  OnRanks(kRanks, [&](int r) {
    BalancerOptions options = ranks.Options(r, Options(kRanks));
    options.client.target = older.target();
    options.plan_group = node.Group(r);
    options.scatter_plans = node.Scatter(r);
    options.gather_reports = node.Gather(r);
    absl::StatusOr<std::unique_ptr<Balancer>> b = Balancer::Start(options);
    ASSERT_TRUE(b.ok()) << b.status();
    if (r == 0) job_id = (*b)->job().job_id;
    for (int64_t step = 0; step < kSteps; ++step) {
      if (step + 1 < kSteps) (*b)->Prefetch(step + 1, Batch(870 + step + 1, kRanks));
      absl::StatusOr<RankStepPlan> plan = (*b)->Plan(step, Batch(870 + step, kRanks));
      ASSERT_TRUE(plan.ok()) << "rank " << r << " step " << step << ": " << plan.status();
      EXPECT_FALSE(plan->local_fallback) << "rank " << r << " step " << step;
      {
        absl::MutexLock lock(&mu);
        for (uint64_t id : Ids(*plan)) placed[step].insert(id);
      }
      (*b)->Report(step, Timings(*plan), 0.0);
    }
    absl::Status finished = (*b)->Finish(20);
    EXPECT_TRUE(finished.ok()) << "rank " << r << ": " << finished;
  });
  for (int64_t step = 0; step < kSteps; ++step) {
    const std::vector<Sample> batch = Batch(870 + step, kRanks);
    ASSERT_EQ(placed[step].size(), batch.size()) << "step " << step;
    for (const Sample& s : batch) EXPECT_EQ(placed[step].count(s.id), 1u) << s.id;
  }
  EXPECT_EQ(planner_.Calls("GetRankPlans"), 0);  // never reached the planner behind
  EXPECT_EQ(planner_.Calls("GetRankPlan"), kRanks * kSteps);
  EXPECT_EQ(planner_.Calls("ReportStep"), kRanks * kSteps);
  absl::StatusOr<JobView> view = planner_.registry().GetJob(job_id);
  ASSERT_TRUE(view.ok());
  EXPECT_EQ(view->steps_folded, kSteps);
}

TEST_F(BalancerTest, PrefetchOnAndOffGiveTheSamePlans) {
  constexpr int kRanks = 2;
  constexpr int kSteps = 4;
  // step -> rank -> placement, for one run (no reports: the model stays the prior, so the
  // plans depend on the batches only).
  using Plans = std::map<int64_t, std::map<int, std::vector<std::pair<uint64_t, double>>>>;
  auto run = [&](bool prefetch, int64_t* prefetched) {
    Plans plans;
    absl::Mutex mu;
    Ranks ranks(kRanks);
    OnRanks(kRanks, [&](int r) {
      BalancerOptions options = Options(kRanks);
      options.prefetch = prefetch;
      absl::StatusOr<std::unique_ptr<Balancer>> b = Balancer::Start(ranks.Options(r, options));
      ASSERT_TRUE(b.ok()) << b.status();
      for (int64_t step = 0; step < kSteps; ++step) {
        absl::StatusOr<RankStepPlan> plan = (*b)->Plan(step, Batch(400 + step, kRanks));
        ASSERT_TRUE(plan.ok()) << plan.status();
        if (step + 1 < kSteps) (*b)->Prefetch(step + 1, Batch(400 + step + 1, kRanks));
        std::this_thread::sleep_for(std::chrono::milliseconds(20));  // "trains"
        absl::MutexLock lock(&mu);
        plans[step][r] = Placement(*plan);
      }
      if (r == 0) *prefetched = (*b)->stats().prefetched_steps;
    });
    return plans;
  };
  int64_t prefetched_on = 0;
  int64_t prefetched_off = 0;
  const Plans on = run(true, &prefetched_on);
  const Plans off = run(false, &prefetched_off);
  ASSERT_EQ(on.size(), static_cast<size_t>(kSteps));
  EXPECT_EQ(on, off);
  EXPECT_GT(prefetched_on, 0);  // the background planned steps ahead
  EXPECT_EQ(prefetched_off, 0);
}

// Every rank passes the same new documents at each step of a job that defers what does not fit:
// three overfull steps, then small ones until nothing is carried; step N+1 is prefetched while
// step N "trains". Every document is trained by exactly one rank, once.
TEST_F(BalancerTest, DeferredDocumentsAreTrainedExactlyOnceWithPrefetch) {
  constexpr int kRanks = 2;
  constexpr int kOverfullSteps = 3;
  constexpr int kMaxSteps = 20;
  std::vector<std::vector<Sample>> new_samples;
  for (int step = 0; step < kMaxSteps; ++step) {
    std::vector<Sample> batch = Batch(500 + step, kRanks, step < kOverfullSteps ? 1.3 : 0.2);
    for (size_t i = 0; i < batch.size(); ++i) batch[i].id = 1000000 * (step + 1) + i;
    new_samples.push_back(std::move(batch));
  }
  Ranks ranks(kRanks);
  absl::Mutex mu;
  std::map<uint64_t, int> trained;
  std::vector<int> steps_run(kRanks, 0);
  OnRanks(kRanks, [&](int r) {
    BalancerOptions options = Options(kRanks);
    options.config.overflow = OverflowPolicy::kDefer;
    absl::StatusOr<std::unique_ptr<Balancer>> b = Balancer::Start(ranks.Options(r, options));
    ASSERT_TRUE(b.ok()) << b.status();
    for (int step = 0; step < kMaxSteps; ++step) {
      absl::StatusOr<RankStepPlan> plan = (*b)->Plan(step, new_samples[step]);
      ASSERT_TRUE(plan.ok()) << "rank " << r << " step " << step << ": " << plan.status();
      const bool more = step + 1 < kOverfullSteps || !(*b)->carried().empty();
      if (more && step + 1 < kMaxSteps) (*b)->Prefetch(step + 1, new_samples[step + 1]);
      ExpectCarriesWhatItDeferred(**b, *plan);
      {
        absl::MutexLock lock(&mu);
        for (uint64_t id : Ids(*plan)) ++trained[id];
        steps_run[r] = step + 1;
      }
      (*b)->Report(step, Timings(*plan), 0.0);
      if (!more) break;
    }
    EXPECT_TRUE((*b)->carried().empty()) << "rank " << r;
    absl::Status finished = (*b)->Finish(20);
    EXPECT_TRUE(finished.ok()) << finished;
  });
  EXPECT_EQ(steps_run[1], steps_run[0]);
  EXPECT_GT(steps_run[0], kOverfullSteps) << "the overfull steps deferred nothing";
  test_support::ExpectTrainedExactlyOnce(new_samples, steps_run[0], trained);
}

// The planner stops after step 1 and comes back before step 5. Both ranks run the same local
// plans meanwhile, warn at most once per interval (on a clock the test moves one second per
// step), say when the planner answers again, and Finish delivers every report; the planner
// counts the steps that ran on local plans.
TEST_F(BalancerTest, PlannerStoppedMidRunFallsBackLoudlyAndCatchesUp) {
  constexpr int kRanks = 2;
  constexpr double kInterval = 2.5;  // seconds of the test's clock: one warning per 3 steps
  const int port = planner_.port();
  Ranks ranks(kRanks);
  struct Warning {
    double at;
    std::string line;
  };
  absl::Mutex mu;
  std::vector<std::vector<Warning>> warnings(kRanks);
  std::vector<std::vector<bool>> local(kRanks);
  std::vector<std::atomic<double>> clock(kRanks);
  std::vector<Balancer::Stats> stats(kRanks);
  std::string job_id;
  // Every rank waits here for the test to stop or start the planner at a step.
  Ranks step_barrier(kRanks);
  OnRanks(kRanks, [&](int r) {
    BalancerOptions options = Options(kRanks);
    options.warn_interval_seconds = kInterval;
    options.now_seconds = [&clock, r] { return clock[r].load(); };
    options.warn = [&, r](const std::string& line) {
      absl::MutexLock lock(&mu);
      warnings[r].push_back({clock[r].load(), line});
    };
    absl::StatusOr<std::unique_ptr<Balancer>> started = Balancer::Start(ranks.Options(r, options));
    ASSERT_TRUE(started.ok()) << started.status();
    Balancer& b = **started;
    if (r == 0) job_id = b.job().job_id;
    auto sync = step_barrier.Options(r, {}).any_rank;
    bool back = false;
    for (int64_t step = 0; step < 7 || (!back && step < 20); ++step) {
      clock[r] = static_cast<double>(step);
      // Nothing in flight when the planner stops (a checkpoint's flush).
      if (step == 2) {
        EXPECT_TRUE(b.Finish(20).ok());
      }
      sync(false);  // every rank has finished the step before: the planner may change
      if (r == 0 && step == 2) planner_.Stop();
      if (r == 0 && step == 5) planner_.Start(port);
      sync(false);
      absl::StatusOr<RankStepPlan> plan = b.Plan(step, Batch(600 + step, kRanks));
      ASSERT_TRUE(plan.ok()) << "rank " << r << " step " << step << ": " << plan.status();
      // Prefetched, but not across the moments the planner stops or starts.
      if (step + 1 != 2 && step + 1 != 5) b.Prefetch(step + 1, Batch(600 + step + 1, kRanks));
      local[r].push_back(plan->local_fallback);
      back = step >= 5 && !plan->local_fallback;
      b.Report(step, Timings(*plan), 0.0);
    }
    absl::Status finished = b.Finish(30);
    EXPECT_TRUE(finished.ok()) << "rank " << r << ": " << finished;
    stats[r] = b.stats();
  });
  ASSERT_EQ(planner_.port(), port);
  ASSERT_EQ(local[1], local[0]);  // the ranks agreed on every step
  const std::vector<bool>& ran_local = local[0];
  int64_t local_steps = 0;
  for (size_t step = 0; step < ran_local.size(); ++step) {
    if (step < 5) {
      EXPECT_EQ(ran_local[step], step >= 2) << "step " << step;
    }
    local_steps += ran_local[step] ? 1 : 0;
  }
  ASSERT_FALSE(ran_local.back());  // back on the planner's plans
  for (int r = 0; r < kRanks; ++r) {
    EXPECT_EQ(stats[r].local_steps, local_steps);
    EXPECT_EQ(stats[r].planned_steps, static_cast<int64_t>(ran_local.size()));
    EXPECT_TRUE(stats[r].planner_reachable);
    EXPECT_EQ(stats[r].buffered_reports, 0);
    EXPECT_EQ(stats[r].dropped_reports, 0);
    EXPECT_FALSE(stats[r].last_error.empty());  // why step 2..4 fell back
    // Fallback warnings: the first local step's, then at most one per interval; each names the
    // planner and counts the local steps so far.
    std::vector<Warning> fallback;
    int back_lines = 0;
    for (const Warning& w : warnings[r]) {
      if (w.line.find("runs on the local plan") != std::string::npos) fallback.push_back(w);
      if (w.line.find("answers again") != std::string::npos) ++back_lines;
      EXPECT_NE(w.line.find(planner_.target()), std::string::npos) << w.line;
    }
    ASSERT_FALSE(fallback.empty()) << "rank " << r;
    EXPECT_EQ(fallback[0].at, 2.0);
    EXPECT_NE(fallback[0].line.find("(local-plan steps so far: 1)"), std::string::npos)
        << fallback[0].line;
    for (size_t i = 1; i < fallback.size(); ++i) {
      EXPECT_GE(fallback[i].at - fallback[i - 1].at, kInterval) << fallback[i].line;
    }
    EXPECT_LT(static_cast<int64_t>(fallback.size()), local_steps);
    EXPECT_GE(back_lines, 1);
    EXPECT_LE(back_lines, static_cast<int>(fallback.size()));
  }
  absl::StatusOr<JobView> view = planner_.registry().GetJob(job_id);
  ASSERT_TRUE(view.ok());
  EXPECT_EQ(view->steps_folded, static_cast<int64_t>(ran_local.size()));  // every report
  // The planner learned of every step the ranks ran on local plans.
  EXPECT_EQ(LocalPlanSteps(planner_, job_id), static_cast<double>(local_steps));
}

// When one rank fell back and rank 0 had the planner's plan, the step's first report may reach
// the planner before rank 0 resubmits the step: the report switches the step to the local plan,
// and the planner counts it then (once: the resubmission that follows is a repeat).
TEST_F(BalancerTest, AStepAReportSwitchedToTheLocalPlanIsCountedOnce) {
  std::unique_ptr<PlannerClient> admin = test_support::ConnectLoopback(planner_.port(), "", "", 5);
  const PlannerConfig config = Config(2);
  absl::StatusOr<JobHandle> job = admin->CreateJob("switch", config);
  ASSERT_TRUE(job.ok()) << job.status();
  std::vector<std::unique_ptr<PlannerClient>> ranks;
  for (int r = 0; r < 2; ++r) {
    ranks.push_back(test_support::ConnectLoopback(planner_.port(), job->job_id, job->token, 5));
    ASSERT_TRUE(ranks[r]->JoinJob(r).ok());
  }
  const std::vector<Sample> batch = Batch(900, 2);
  ASSERT_TRUE(ranks[0]->SubmitBatch(0, batch).ok());
  absl::StatusOr<StepPlan> local = PlanStepLocally(batch, config);
  ASSERT_TRUE(local.ok()) << local.status();
  EXPECT_EQ(LocalPlanSteps(planner_, job->job_id), 0);
  absl::StatusOr<bool> reported = ranks[1]->ReportStep(
      0, 1, test_support::TimingsOf(local->ranks[1].micro_batches), 0.0, /*planned_locally=*/true);
  ASSERT_TRUE(reported.ok()) << reported.status();
  EXPECT_EQ(LocalPlanSteps(planner_, job->job_id), 1);
  ASSERT_TRUE(ranks[0]->SubmitBatch(0, batch, /*planned_locally=*/true).ok());
  EXPECT_EQ(LocalPlanSteps(planner_, job->job_id), 1);
  absl::StatusOr<RankStepPlan> recorded = ranks[0]->GetRankPlan(0, 0);
  ASSERT_TRUE(recorded.ok()) << recorded.status();
  EXPECT_TRUE(recorded->local_fallback);
}

TEST_F(BalancerTest, AnUnreachablePlannerAtStartIsAnErrorThatNamesIt) {
  const std::string target = planner_.target();
  planner_.Stop();
  BalancerOptions options = Options(1);
  options.client.call_timeout_seconds = 0.5;
  absl::StatusOr<std::unique_ptr<Balancer>> b = Balancer::Start(options);
  ASSERT_EQ(b.status().code(), absl::StatusCode::kUnavailable) << b.status();
  EXPECT_NE(b.status().message().find(target), std::string::npos) << b.status();
  EXPECT_NE(b.status().message().find("allow offline start"), std::string::npos) << b.status();
  // Two ranks: every rank gets the error (none waits forever for the others).
  Ranks ranks(2);
  OnRanks(2, [&](int r) {
    absl::StatusOr<std::unique_ptr<Balancer>> rb = Balancer::Start(ranks.Options(r, options));
    EXPECT_EQ(rb.status().code(), absl::StatusCode::kUnavailable) << rb.status();
    EXPECT_NE(rb.status().message().find(target), std::string::npos) << rb.status();
  });
}

TEST_F(BalancerTest, OfflineStartRunsEveryStepOnTheLocalPlan) {
  const std::string target = planner_.target();
  planner_.Stop();
  BalancerOptions options = Options(1);
  options.client.call_timeout_seconds = 0.5;
  options.allow_offline_start = true;
  std::vector<std::string> warnings;
  options.warn = [&](const std::string& line) { warnings.push_back(line); };
  absl::StatusOr<std::unique_ptr<Balancer>> b = Balancer::Start(options);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_TRUE((*b)->job().job_id.empty());
  EXPECT_EQ((*b)->config().ranks, 1);
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_NE(warnings[0].find(target), std::string::npos) << warnings[0];
  for (int64_t step = 0; step < 3; ++step) {
    const std::vector<Sample> batch = Batch(700 + step, 1);
    (*b)->Prefetch(step, batch);
    absl::StatusOr<RankStepPlan> plan = (*b)->Plan(step, batch);
    ASSERT_TRUE(plan.ok()) << plan.status();
    EXPECT_TRUE(plan->local_fallback);
    EXPECT_EQ(Ids(*plan).size(), batch.size());
    (*b)->Report(step, Timings(*plan), 0.0);
  }
  const Balancer::Stats stats = (*b)->stats();
  EXPECT_EQ(stats.local_steps, 3);
  EXPECT_FALSE(stats.planner_reachable);
  EXPECT_NE(stats.last_error.find("offline"), std::string::npos) << stats.last_error;
  EXPECT_EQ(warnings.size(), 2u);  // the start's, and the first local step's (60 s interval)
  EXPECT_TRUE((*b)->Finish(1).ok());
}

// A trainer checkpoints after an overfull step (next step and carried samples), restarts, and
// resumes: the carried documents go ahead of the next step's batch instead of being lost.
TEST_F(BalancerTest, ResumeRestoresTheCarriedSamples) {
  BalancerOptions options = Options(1);
  options.config.overflow = OverflowPolicy::kDefer;
  std::vector<Sample> carried;
  JobHandle job;
  {
    absl::StatusOr<std::unique_ptr<Balancer>> b = Balancer::Start(options);
    ASSERT_TRUE(b.ok()) << b.status();
    job = (*b)->job();
    absl::StatusOr<RankStepPlan> plan = (*b)->Plan(0, Batch(800, 1, /*fill=*/1.5));
    ASSERT_TRUE(plan.ok()) << plan.status();
    ASSERT_FALSE(plan->deferred_ids.empty());
    (*b)->Report(0, Timings(*plan), 0.0);
    ASSERT_TRUE((*b)->Finish(20).ok());
    carried = (*b)->carried();  // the checkpoint: next step 1 and these
    ASSERT_EQ(carried.size(), plan->deferred_ids.size());
  }
  options.job_id = job.job_id;
  options.client.token = job.token;
  absl::StatusOr<std::unique_ptr<Balancer>> b = Balancer::Start(options);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ((*b)->next_step(), 1);
  EXPECT_TRUE((*b)->carried().empty());  // a new process knows nothing of them
  (*b)->Resume(1, carried);
  EXPECT_EQ((*b)->carried().size(), carried.size());
  std::vector<Sample> fresh = Batch(801, 1, /*fill=*/0.1);
  for (size_t i = 0; i < fresh.size(); ++i) fresh[i].id = 9000000 + i;
  absl::StatusOr<RankStepPlan> plan = (*b)->Plan(1, fresh);
  ASSERT_TRUE(plan.ok()) << plan.status();
  std::multiset<uint64_t> planned;
  for (uint64_t id : Ids(*plan)) planned.insert(id);
  for (uint64_t id : plan->deferred_ids) planned.insert(id);
  for (const Sample& s : carried) EXPECT_EQ(planned.count(s.id), 1u) << "carried " << s.id;
  for (const Sample& s : fresh) EXPECT_EQ(planned.count(s.id), 1u) << "new " << s.id;
  EXPECT_EQ(planned.size(), carried.size() + fresh.size());
}

TEST_F(BalancerTest, BadOptionsAreErrorsThatNameTheField) {
  BalancerOptions options = Options(2);
  options.rank = 2;
  EXPECT_EQ(Balancer::Start(options).status().code(), absl::StatusCode::kInvalidArgument);
  options.rank = 1;  // world 2 without collectives
  absl::Status status = Balancer::Start(options).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("any_rank"), std::string::npos) << status;
  // Plans through a group leader: the group and the collective, both or neither; a group of
  // this rank and the job's distinct ranks; rank 0, which submits, leads its group.
  options = Ranks(4).Options(1, Options(4));
  auto refused = [&](std::vector<int> group, bool scatter, const std::string& says) {
    BalancerOptions o = options;
    o.plan_group = std::move(group);
    if (scatter) o.scatter_plans = [](const std::vector<std::string>&) { return std::string(); };
    absl::Status s = Balancer::Start(o).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find(says), std::string::npos) << s;
  };
  refused({0, 1}, false, "scatter_plans: unset, but plan_group is given");
  refused({}, true, "plan_group: 0 ranks; 1 to 1024");
  refused({0, 4}, true, "plan_group[1]: 4 is outside [0, world=4)");
  refused({1, 2, 1}, true, "plan_group[2]: rank 1 is in the group twice");
  refused({2, 3}, true, "plan_group: it does not hold this rank (1)");
  refused({1, 0}, true, "plan_group: rank 0 must lead its group");
}

}  // namespace
}  // namespace sparsebalance
