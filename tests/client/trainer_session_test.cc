// TrainerSession (through PlannerClient) against a real sb-planner service on loopback: a
// training loop of 4 ranks, the local fallback when the planner is down (every rank agrees,
// every sample placed once), and reports kept while it is away and delivered when it is back.
#include "client/trainer_session.h"

#include <atomic>
#include <chrono>
#include <limits>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "client/planner_client.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "planner/planner.h"
#include "planner/traces.h"
#include "proto/wire.h"
#include "server/job_registry.h"
#include "server/planner_service.h"
#include "tests/server/test_support.h"
#include "tests/support/loopback_client.h"
#include "tests/support/restartable_planner.h"
#include "tests/support/scripted_planner.h"
#include "tests/support/trained_once.h"

namespace sparsebalance {
namespace {

std::vector<Sample> Batch(uint64_t seed, int ranks) {
  return test_support::PretrainBatch(seed, ranks);
}
std::vector<MicroBatchTiming> Timings(const RankStepPlan& plan) {
  return test_support::TimingsOf(plan.micro_batches);
}

using Planner = test_support::RestartablePlanner;

PlannerConfig Config(int ranks) {
  PlannerConfig c;
  c.ranks = ranks;
  c.micro_batches = 2;
  c.micro_batch_capacity = 65536;
  return c;
}

std::unique_ptr<PlannerClient> Connect(int port, const std::string& job = "",
                                       const std::string& token = "", bool report_stream = false) {
  // Ranks wait for the coordinator under load.
  return test_support::ConnectLoopback(port, job, token, /*call_timeout_seconds=*/2,
                                       /*plan_timeout_seconds=*/20, report_stream);
}

// Every test runs against a planner of its own.
class TrainerSessionTest : public ::testing::Test {
 protected:
  // A job of `ranks` ranks (Config) created on the planner.
  absl::StatusOr<JobHandle> CreateJob(const std::string& name, int ranks) {
    return Connect(planner_.port())->CreateJob(name, Config(ranks));
  }
  // A rank reports step 0 while the planner is away and step 1 once it is back (reporting on a
  // ReportSteps stream with `report_stream`): the first report is kept and delivered first.
  void ReportThroughAnOutage(bool report_stream);

  Planner planner_;
};
using PlannerClientTest = TrainerSessionTest;

TEST_F(TrainerSessionTest, FourRanksTrainThroughThePlanner) {
  constexpr int kRanks = 4;
  absl::StatusOr<JobHandle> job = CreateJob("train", kRanks);
  ASSERT_TRUE(job.ok()) << job.status();
  std::vector<std::thread> ranks;
  std::atomic<int> failures{0};
  for (int r = 0; r < kRanks; ++r) {
    ranks.emplace_back([&, r] {
      std::unique_ptr<PlannerClient> client = Connect(planner_.port(), job->job_id, job->token);
      absl::StatusOr<std::pair<PlannerConfig, int64_t>> joined = client->JoinJob(r);
      if (!joined.ok()) {
        ++failures;
        return;
      }
      TrainerSession session(client.get(), r, /*coordinator=*/r == 0, joined->first);
      for (int64_t step = 0; step < 5; ++step) {
        absl::StatusOr<RankStepPlan> plan = session.Plan(step, Batch(100 + step, kRanks));
        if (!plan.ok() || plan->local_fallback || plan->rank != r || plan->step != step) {
          ++failures;
          return;
        }
        if (!session.Report(step, Timings(*plan), 0.0).ok()) ++failures;
      }
    });
  }
  for (std::thread& t : ranks) t.join();
  EXPECT_EQ(failures.load(), 0);
  absl::StatusOr<JobView> view = planner_.registry().GetJob(job->job_id);
  ASSERT_TRUE(view.ok());
  EXPECT_EQ(view->next_step, 5);
}

// A node leader's session sends its node's reports in one ReportStepBatch call. A report the
// planner refuses in a batch costs only itself: the session sends the batch's reports one by
// one, drops the refused one and says so, and keeps none of the others from the planner.
TEST_F(TrainerSessionTest, ANodesReportsGoInOneBatchAndARefusedOneCostsOnlyItself) {
  constexpr int kRanks = 3;
  absl::StatusOr<JobHandle> job = CreateJob("node", kRanks);
  ASSERT_TRUE(job.ok()) << job.status();
  std::vector<std::unique_ptr<PlannerClient>> clients;
  std::vector<std::vector<MicroBatchTiming>> timings(kRanks);
  std::unique_ptr<TrainerSession> leader;
  for (int64_t step = 0; step < 2; ++step) {
    for (int r = 0; r < kRanks; ++r) {
      if (step == 0) {
        clients.push_back(Connect(planner_.port(), job->job_id, job->token));
        ASSERT_TRUE(clients[r]->JoinJob(r).ok());
      }
      // Every rank's plan of the step; rank 0's session is the leader's.
      TrainerSession session(clients[r].get(), r, /*coordinator=*/r == 0, Config(kRanks));
      absl::StatusOr<RankStepPlan> plan = session.Plan(step, Batch(900 + step, kRanks));
      ASSERT_TRUE(plan.ok()) << plan.status();
      ASSERT_FALSE(plan->local_fallback);
      timings[r] = Timings(*plan);
      if (r == 0) {
        leader = std::make_unique<TrainerSession>(clients[0].get(), 0, true, Config(kRanks));
        ASSERT_TRUE(leader->Plan(step, Batch(900 + step, kRanks)).ok());
      }
    }
    std::vector<RankStepReport> node(kRanks);
    for (int r = 0; r < kRanks; ++r) {
      node[r].step = step;
      node[r].rank = r;
      node[r].micro_batches = timings[r];
    }
    if (step == 1) node[1].micro_batches.back().micro_batch = 7;  // no such micro-batch
    const double batches = planner_.Calls("ReportStepBatch");
    const double refused = planner_.Calls("ReportStepBatch", "INVALID_ARGUMENT");
    const absl::Status reported = leader->Report(node);
    if (step == 0) {
      ASSERT_TRUE(reported.ok()) << reported;
      EXPECT_EQ(planner_.Calls("ReportStepBatch"), batches + 1);  // the whole node in one call
    } else {
      EXPECT_EQ(reported.code(), absl::StatusCode::kInvalidArgument) << reported;
      EXPECT_NE(reported.message().find("rank 1's report of step 1 dropped"), std::string::npos)
          << reported;
      EXPECT_EQ(planner_.Calls("ReportStepBatch", "INVALID_ARGUMENT"), refused + 1);
    }
  }
  EXPECT_EQ(leader->dropped_reports(), 1);
  EXPECT_EQ(leader->buffered_reports(), 0u);
  absl::StatusOr<JobView> view = planner_.registry().GetJob(job->job_id);
  ASSERT_TRUE(view.ok());
  EXPECT_EQ(view->steps_folded, 1);  // step 1 lacks rank 1's report, and has the others'
  for (int r : {0, 2}) {
    absl::StatusOr<bool> again = planner_.registry().ReportStep(job->job_id, 1, r, timings[r], 0.0);
    ASSERT_TRUE(again.ok()) << again.status();
    EXPECT_TRUE(*again) << "rank " << r;  // accepted before
  }
}

// A node's leader fetches the node's plans of a step in one GetRankPlans call and hands each
// rank its own bytes; each rank's session adopts them as it would take the planner's answer:
// the same plan GetRankPlan gives it, and the samples the step deferred carried into the next
// step's batch (without them the next step's plan would not fit that rank's batch).
TEST_F(TrainerSessionTest, ANodesPlansComeInOneCallAndEachRankAdoptsItsOwn) {
  constexpr int kRanks = 3;
  PlannerConfig config = Config(kRanks);
  config.overflow = OverflowPolicy::kDefer;
  absl::StatusOr<JobHandle> job = Connect(planner_.port())->CreateJob("node plans", config);
  ASSERT_TRUE(job.ok()) << job.status();
  std::vector<std::unique_ptr<PlannerClient>> clients;
  std::vector<std::unique_ptr<TrainerSession>> sessions;
  for (int r = 0; r < kRanks; ++r) {
    clients.push_back(Connect(planner_.port(), job->job_id, job->token));
    ASSERT_TRUE(clients[r]->JoinJob(r).ok());
    sessions.push_back(std::make_unique<TrainerSession>(clients[r].get(), r, r == 0, config));
  }
  auto placement = [](const RankStepPlan& plan) {
    std::vector<std::tuple<uint64_t, int64_t, double>> out;
    for (const MicroBatchPlan& mb : plan.micro_batches) {
      for (const PlannedSample& p : mb.samples) out.emplace_back(p.id, p.length, p.density);
    }
    return out;
  };
  std::vector<std::string> encoded;
  for (int64_t step = 0; step < 3; ++step) {
    // Step 0 overflows: its deferred samples go ahead of step 1's.
    const std::vector<Sample> batch =
        test_support::PretrainBatch(950 + step, kRanks, step == 0 ? 1.4 : 0.4);
    const double groups = planner_.Calls("GetRankPlans");
    const double singles = planner_.Calls("GetRankPlan");
    absl::StatusOr<RankStepPlan> own = sessions[0]->Plan(step, batch, {0, 1, 2}, &encoded);
    ASSERT_TRUE(own.ok()) << own.status();
    ASSERT_FALSE(own->local_fallback);
    ASSERT_EQ(encoded.size(), 3u);
    EXPECT_EQ(planner_.Calls("GetRankPlans"), groups + 1);
    EXPECT_EQ(planner_.Calls("GetRankPlan"), singles);
    EXPECT_EQ(own->deferred_ids.empty(), step != 0) << "step " << step;
    for (int r = 0; r < kRanks; ++r) {
      absl::StatusOr<RankStepPlan> plan =
          r == 0 ? own : sessions[r]->Adopt(step, batch, encoded[r]);
      ASSERT_TRUE(plan.ok()) << "rank " << r << " step " << step << ": " << plan.status();
      EXPECT_EQ(plan->rank, r);
      EXPECT_EQ(plan->deferred_ids, own->deferred_ids);
      absl::StatusOr<RankStepPlan> direct = clients[r]->GetRankPlan(step, r);
      ASSERT_TRUE(direct.ok()) << direct.status();
      EXPECT_EQ(placement(*plan), placement(*direct)) << "rank " << r << " step " << step;
      std::set<uint64_t> carried;
      for (const Sample& s : sessions[r]->carried()) carried.insert(s.id);
      EXPECT_EQ(carried, std::set<uint64_t>(own->deferred_ids.begin(), own->deferred_ids.end()))
          << "rank " << r << " step " << step;
    }
  }
  // Bytes that are not this rank's plan of the step, and a group without this rank.
  const std::vector<Sample> batch = test_support::PretrainBatch(952, kRanks, 0.4);
  absl::StatusOr<RankStepPlan> other = sessions[1]->Adopt(2, batch, encoded[2]);
  EXPECT_EQ(other.status().code(), absl::StatusCode::kInvalidArgument) << other.status();
  EXPECT_NE(other.status().message().find("it is step 2 of rank 2, not step 2 of rank 1"),
            std::string::npos)
      << other.status();
  absl::StatusOr<RankStepPlan> earlier = sessions[1]->Adopt(3, batch, encoded[1]);
  EXPECT_EQ(earlier.status().code(), absl::StatusCode::kInvalidArgument) << earlier.status();
  absl::StatusOr<RankStepPlan> garbage = sessions[1]->Adopt(3, batch, "\xff\xff not a plan");
  EXPECT_EQ(garbage.status().code(), absl::StatusCode::kInvalidArgument) << garbage.status();
  absl::StatusOr<RankStepPlan> outside = sessions[0]->Plan(3, batch, {1, 2}, &encoded);
  EXPECT_EQ(outside.status().code(), absl::StatusCode::kInvalidArgument) << outside.status();
  EXPECT_TRUE(encoded.empty());
}

TEST_F(TrainerSessionTest, ManyRanksManyStepsEveryPlanRightNoReportLost) {
  constexpr int kRanks = 256;
  constexpr int kSteps = 50;
  std::unique_ptr<PlannerClient> admin = Connect(planner_.port());
  PlannerConfig config = Config(kRanks);
  config.micro_batch_capacity = 4096;
  absl::StatusOr<JobHandle> job = admin->CreateJob("many", config, /*history_steps=*/8);
  ASSERT_TRUE(job.ok()) << job.status();
  // Every rank passes the same global batch: two short documents per rank.
  auto batch_of = [&](int64_t step) {
    std::vector<Sample> batch;
    for (int i = 0; i < 2 * kRanks; ++i) {
      batch.push_back(
          {static_cast<uint64_t>(step * 10000 + i), 256 + (i * 37 + step) % 1500, 0.0, 0, {}});
    }
    return batch;
  };
  std::atomic<int> wrong{0};
  std::atomic<int> fallbacks{0};
  std::vector<std::thread> ranks;
  for (int r = 0; r < kRanks; ++r) {
    ranks.emplace_back([&, r] {
      std::unique_ptr<PlannerClient> client = Connect(planner_.port(), job->job_id, job->token);
      if (!client->JoinJob(r).ok()) {
        ++wrong;
        return;
      }
      TrainerSession session(client.get(), r, r == 0, config);
      for (int64_t step = 0; step < kSteps; ++step) {
        absl::StatusOr<RankStepPlan> plan = session.Plan(step, batch_of(step));
        if (!plan.ok()) {
          ++wrong;
          return;
        }
        if (plan->local_fallback) ++fallbacks;
        // The plan is the planner's plan of this rank.
        bool ready = false;
        absl::StatusOr<std::shared_ptr<const StepPlan>> truth =
            planner_.registry().GetPlan(job->job_id, step, r, &ready);
        if (!truth.ok() || !ready) {
          ++wrong;
          return;
        }
        const std::vector<MicroBatchPlan>& want = (*truth)->ranks[r].micro_batches;
        for (size_t m = 0; m < want.size(); ++m) {
          // Every planned sample whole: id, length, segments, density.
          if (plan->micro_batches[m].samples != want[m].samples) ++wrong;
        }
        if (!session.Report(step, Timings(*plan), 0.0).ok()) ++wrong;
      }
    });
  }
  for (std::thread& t : ranks) t.join();
  EXPECT_EQ(wrong.load(), 0);
  EXPECT_EQ(fallbacks.load(), 0);
  absl::StatusOr<JobView> view = planner_.registry().GetJob(job->job_id);
  ASSERT_TRUE(view.ok());
  EXPECT_EQ(view->next_step, kSteps);
  EXPECT_EQ(view->steps_folded, kSteps);  // every step's 256 reports arrived and were learned
}

TEST_F(TrainerSessionTest, WithThePlannerDownEveryRankAgreesOnTheLocalPlan) {
  constexpr int kRanks = 4;
  const int port = planner_.port();
  planner_.Stop();
  const std::vector<Sample> batch = Batch(7, kRanks);
  std::multiset<uint64_t> placed;
  for (int r = 0; r < kRanks; ++r) {
    std::unique_ptr<PlannerClient> client = Connect(port, "job", "token");
    TrainerSession session(client.get(), r, r == 0, Config(kRanks));
    absl::StatusOr<RankStepPlan> plan = session.Plan(0, batch);
    ASSERT_TRUE(plan.ok()) << plan.status();
    EXPECT_TRUE(plan->local_fallback);
    for (const MicroBatchPlan& mb : plan->micro_batches) {
      for (const PlannedSample& p : mb.samples) placed.insert(p.id);
    }
    // The same as what any other rank computes for this batch.
    EXPECT_EQ(plan->predicted_makespan_seconds,
              session.LocalPlan(0, batch)->predicted_makespan_seconds);
  }
  ASSERT_EQ(placed.size(), batch.size());
  for (const Sample& s : batch) EXPECT_EQ(placed.count(s.id), 1u) << s.id;
}

void TrainerSessionTest::ReportThroughAnOutage(bool report_stream) {
  constexpr int kRanks = 1;
  const int port = planner_.port();
  absl::StatusOr<JobHandle> job = CreateJob("away", kRanks);
  ASSERT_TRUE(job.ok());
  std::unique_ptr<PlannerClient> client = Connect(port, job->job_id, job->token, report_stream);
  ASSERT_TRUE(client->JoinJob(0).ok());
  TrainerSession session(client.get(), 0, true, Config(kRanks));
  absl::StatusOr<RankStepPlan> plan = session.Plan(0, Batch(3, kRanks));
  ASSERT_TRUE(plan.ok());
  ASSERT_FALSE(plan->local_fallback);
  planner_.Stop();
  EXPECT_TRUE(session.Report(0, Timings(*plan), 0.0).ok());  // kept, not an error
  EXPECT_EQ(session.buffered_reports(), 1u);
  planner_.Start(port);
  ASSERT_EQ(planner_.port(), port);
  // Once the client has reconnected (under load its channel may still be backing off, and
  // step 1 would then run on a local plan, whose reports wait for its resubmission), the next
  // report flushes the buffered one first; step 0 is then known to the planner.
  absl::Status joined;
  for (int i = 0; i < 100 && !(joined = client->JoinJob(0).status()).ok(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  ASSERT_TRUE(joined.ok()) << joined;
  absl::StatusOr<RankStepPlan> next = session.Plan(1, Batch(4, kRanks));
  ASSERT_TRUE(next.ok()) << next.status();
  ASSERT_FALSE(next->local_fallback);
  EXPECT_TRUE(session.Report(1, Timings(*next), 0.0).ok());
  EXPECT_EQ(session.buffered_reports(), 0u);
  if (report_stream) {
    // Past the 1 s the client waits after a failed stream before it opens another.
    std::this_thread::sleep_for(std::chrono::milliseconds(1100));
  }
  absl::StatusOr<bool> repeat = client->ReportStep(0, 0, Timings(*plan), 0.0);
  ASSERT_TRUE(repeat.ok());
  EXPECT_TRUE(*repeat);  // the planner has it
  if (report_stream) {   // and that answer came on a new stream, still open
    EXPECT_EQ(test_support::Settled(1, [&] { return planner_.service().report_streams(); }), 1);
  }
}

TEST_F(TrainerSessionTest, ReportsMadeWhileThePlannerIsAwayAreDeliveredWhenItIsBack) {
  ReportThroughAnOutage(/*report_stream=*/false);
}

// The same on a report stream: the stream to the stopped planner fails, the report is kept,
// and a new stream to the restarted one delivers it.
TEST_F(TrainerSessionTest, ReportsOnAStreamSurviveThePlannerGoingAway) {
  ReportThroughAnOutage(/*report_stream=*/true);
}

// The planner goes away for three steps and comes back: the ranks run local plans, the
// coordinator then tells the planner which plans they ran, and every report made meanwhile
// reaches the planner's model; the job goes on in order.
TEST_F(TrainerSessionTest, AfterStepsOnLocalPlansTheJobCatchesUpAndLosesNoReport) {
  constexpr int kRanks = 2;
  const int port = planner_.port();
  absl::StatusOr<JobHandle> job = CreateJob("resync", kRanks);
  ASSERT_TRUE(job.ok());
  std::vector<std::unique_ptr<PlannerClient>> clients;
  std::vector<std::unique_ptr<TrainerSession>> sessions;
  for (int r = 0; r < kRanks; ++r) {
    clients.push_back(Connect(port, job->job_id, job->token));
    ASSERT_TRUE(clients[r]->JoinJob(r).ok());
    sessions.push_back(
        std::make_unique<TrainerSession>(clients[r].get(), r, r == 0, Config(kRanks)));
  }
  std::map<int64_t, std::vector<std::vector<uint64_t>>> ran;  // step -> rank -> sample ids
  // Until the ranks are back on the planner's plans (the channel reconnects within a second).
  int64_t steps = 0;
  bool back = false;
  for (int64_t step = 0; step < 7 || (!back && step < 20); ++step, ++steps) {
    if (step == 2) planner_.Stop();
    if (step == 5) {
      planner_.Start(port);
      ASSERT_EQ(planner_.port(), port);
    }
    const std::vector<Sample> batch = Batch(200 + step, kRanks);
    for (int r = 0; r < kRanks; ++r) {
      absl::StatusOr<RankStepPlan> plan = sessions[r]->Plan(step, batch);
      ASSERT_TRUE(plan.ok()) << plan.status();
      if (step < 2 || (step >= 2 && step < 5)) {
        EXPECT_EQ(plan->local_fallback, step >= 2) << "step " << step;
      }
      back = step >= 5 && !plan->local_fallback;
      std::vector<uint64_t> ids;
      for (const MicroBatchPlan& mb : plan->micro_batches) {
        for (const PlannedSample& p : mb.samples) ids.push_back(p.id);
      }
      ran[step].push_back(ids);
      absl::Status reported = sessions[r]->Report(step, Timings(*plan), 0.0);
      ASSERT_TRUE(reported.ok()) << "step " << step << ": " << reported;
    }
  }
  for (int r = 0; r < kRanks; ++r) {
    EXPECT_EQ(sessions[r]->buffered_reports(), 0u);
    EXPECT_EQ(sessions[r]->dropped_reports(), 0);
    EXPECT_EQ(sessions[r]->unsent_local_steps(), 0u);
  }
  absl::StatusOr<JobView> view = planner_.registry().GetJob(job->job_id);
  ASSERT_TRUE(view.ok());
  ASSERT_TRUE(back);
  EXPECT_EQ(view->next_step, steps);
  EXPECT_EQ(view->steps_folded, steps);  // every step's reports reached the model
  // The planner's record of a locally planned step is what the ranks ran.
  for (int r = 0; r < kRanks; ++r) {
    absl::StatusOr<RankStepPlan> recorded = clients[r]->GetRankPlan(3, r);
    ASSERT_TRUE(recorded.ok()) << recorded.status();
    EXPECT_TRUE(recorded->local_fallback);
    std::vector<uint64_t> ids;
    for (const MicroBatchPlan& mb : recorded->micro_batches) {
      for (const PlannedSample& p : mb.samples) ids.push_back(p.id);
    }
    EXPECT_EQ(ids, ran[3][r]);
  }
}

// Runs `ranks` rank threads through steps of a job whose config defers what does not fit:
// three overfull steps (130% of capacity), then small ones until nothing is carried. Returns
// Expects every document passed to Plan to be trained by exactly one rank, once, and nothing
// left carried.
void ExpectDeferredTrainedOnce(int port, const std::string& job_id, const std::string& token,
                               int ranks) {
  PlannerConfig config = Config(ranks);
  config.overflow = OverflowPolicy::kDefer;
  constexpr int kOverfullSteps = 3;
  constexpr int kMaxSteps = 20;
  // Every rank passes the same new documents at each step; ids unique over the run.
  std::vector<std::vector<Sample>> new_samples;
  for (int step = 0; step < kMaxSteps; ++step) {
    std::vector<Sample> batch =
        test_support::PretrainBatch(500 + step, ranks, /*fill=*/step < kOverfullSteps ? 1.3 : 0.2);
    for (size_t i = 0; i < batch.size(); ++i) batch[i].id = 1000000 * (step + 1) + i;
    new_samples.push_back(std::move(batch));
  }
  absl::Mutex mu;
  std::map<uint64_t, int> trained;
  std::vector<int> steps_run(ranks, 0);
  std::vector<std::thread> threads;
  std::atomic<int> failed{0};
  for (int r = 0; r < ranks; ++r) {
    threads.emplace_back([&, r] {
      std::unique_ptr<PlannerClient> client = Connect(port, job_id, token);
      client->JoinJob(r).IgnoreError();  // fails while the planner is down: local plans then
      TrainerSession session(client.get(), r, /*coordinator=*/r == 0, config);
      for (int step = 0; step < kMaxSteps; ++step) {
        if (step >= kOverfullSteps && session.carried().empty()) break;
        absl::StatusOr<RankStepPlan> plan = session.Plan(step, new_samples[step]);
        if (!plan.ok()) {
          ADD_FAILURE() << "rank " << r << " step " << step << ": " << plan.status();
          ++failed;
          return;
        }
        absl::MutexLock lock(&mu);
        for (const MicroBatchPlan& mb : plan->micro_batches) {
          for (const PlannedSample& p : mb.samples) ++trained[p.id];
        }
        steps_run[r] = step + 1;
        if (absl::Status s = session.Report(step, Timings(*plan), 0.0); !s.ok()) {
          ADD_FAILURE() << "rank " << r << " report of step " << step << ": " << s;
          ++failed;
        }
      }
      if (!session.carried().empty()) {
        ADD_FAILURE() << "rank " << r << " still carries " << session.carried().size();
        ++failed;
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(failed.load(), 0);
  for (int r = 0; r < ranks; ++r) {
    EXPECT_EQ(steps_run[r], steps_run[0]) << "rank " << r << " ran another number of steps";
  }
  EXPECT_GT(steps_run[0], kOverfullSteps) << "the overfull steps deferred nothing";
  test_support::ExpectTrainedExactlyOnce(new_samples, steps_run[0], trained);
}

TEST_F(TrainerSessionTest, DeferredDocumentsAreCarriedAndTrainedExactlyOnce) {
  constexpr int kRanks = 4;
  std::unique_ptr<PlannerClient> admin = Connect(planner_.port());
  PlannerConfig config = Config(kRanks);
  config.overflow = OverflowPolicy::kDefer;
  absl::StatusOr<JobHandle> job = admin->CreateJob("defer", config);
  ASSERT_TRUE(job.ok()) << job.status();
  ExpectDeferredTrainedOnce(planner_.port(), job->job_id, job->token, kRanks);
}

TEST_F(TrainerSessionTest, DeferredDocumentsAreCarriedOnLocalPlansToo) {
  constexpr int kRanks = 2;
  const int port = planner_.port();
  planner_.Stop();  // every step on the local plan: every rank must carry the same documents
  ExpectDeferredTrainedOnce(port, "job", "token", kRanks);
}

TEST_F(TrainerSessionTest, ASampleTheTrainerPassesAgainIsNotPlannedTwice) {
  const int port = planner_.port();
  planner_.Stop();
  PlannerConfig config = Config(1);
  config.overflow = OverflowPolicy::kDefer;
  std::unique_ptr<PlannerClient> client = Connect(port, "job", "token");
  TrainerSession session(client.get(), 0, /*coordinator=*/true, config);
  std::vector<Sample> batch = test_support::PretrainBatch(9, 1, /*fill=*/1.5);
  absl::StatusOr<RankStepPlan> first = session.Plan(0, batch);
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_FALSE(first->deferred_ids.empty());
  ASSERT_EQ(session.carried().size(), first->deferred_ids.size());
  // An older trainer re-adds what was deferred: each document is still planned once.
  std::vector<Sample> again = session.carried();
  absl::StatusOr<RankStepPlan> second = session.Plan(1, again);
  ASSERT_TRUE(second.ok()) << second.status();
  std::multiset<uint64_t> planned;
  for (const MicroBatchPlan& mb : second->micro_batches) {
    for (const PlannedSample& p : mb.samples) planned.insert(p.id);
  }
  for (uint64_t id : second->deferred_ids) planned.insert(id);
  ASSERT_EQ(planned.size(), again.size());
  for (const Sample& s : again) EXPECT_EQ(planned.count(s.id), 1u) << s.id;
}

TEST_F(TrainerSessionTest, ABadBatchIsAnErrorNotAFallback) {
  std::unique_ptr<PlannerClient> admin = Connect(planner_.port());
  absl::StatusOr<JobHandle> job = admin->CreateJob("bad", Config(2));
  ASSERT_TRUE(job.ok());
  TrainerSession session(admin.get(), 0, true, Config(2));
  std::vector<Sample> batch = Batch(5, 2);
  batch[1].id = batch[0].id;
  absl::StatusOr<RankStepPlan> plan = session.Plan(0, batch);
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(plan.status().message().find("samples[1].id"), absl::string_view::npos);
}

TEST_F(PlannerClientTest, PlansCarryEachSamplesLengthAndSegments) {
  // One job of two ranks; the coordinator submits a batch with packed samples.
  std::unique_ptr<PlannerClient> admin = Connect(planner_.port());
  absl::StatusOr<JobHandle> job = admin->CreateJob("packed", Config(2));
  ASSERT_TRUE(job.ok());
  std::vector<Sample> batch = Batch(9, 2);
  for (size_t i = 0; i < batch.size(); ++i) {  // three in four packed
    if (i % 4 != 3 && batch[i].length >= 3) batch[i].segments = {2, batch[i].length - 2};
  }
  std::map<uint64_t, const Sample*> by_id;
  for (const Sample& s : batch) by_id[s.id] = &s;
  std::unique_ptr<PlannerClient> client = Connect(planner_.port(), job->job_id, job->token);
  TrainerSession coordinator(client.get(), 0, true, Config(2));
  TrainerSession other(client.get(), 1, false, Config(2));
  size_t placed = 0;
  for (TrainerSession* session : {&coordinator, &other}) {
    absl::StatusOr<RankStepPlan> plan = session->Plan(0, batch);
    ASSERT_TRUE(plan.ok()) << plan.status();
    ASSERT_FALSE(plan->local_fallback);
    for (const MicroBatchPlan& mb : plan->micro_batches) {
      for (const PlannedSample& p : mb.samples) {
        ASSERT_EQ(by_id.count(p.id), 1u);
        EXPECT_EQ(p.length, by_id[p.id]->length);
        EXPECT_EQ(p.segments, by_id[p.id]->segments);
        ++placed;
      }
    }
  }
  EXPECT_EQ(placed, batch.size());
  // A rank whose batch is not the one planned learns it instead of running other samples.
  TrainerSession stray(client.get(), 1, false, Config(2));
  std::vector<Sample> other_batch = batch;
  for (Sample& s : other_batch) s.segments.clear();
  absl::StatusOr<RankStepPlan> plan = stray.Plan(0, other_batch);
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kFailedPrecondition) << plan.status();
  EXPECT_NE(plan.status().message().find("segments"), absl::string_view::npos);
}

// Clients of a planner whose answers each test writes (ScriptedPlanner): what a real planner
// should never send, and errors it sends only under load.
class ScriptedPlannerTest : public ::testing::Test {
 protected:
  using Scripted = test_support::ScriptedPlanner;
  std::unique_ptr<PlannerClient> Connect() {
    return test_support::ConnectLoopback(planner_.port(), "job", "token",
                                         /*call_timeout_seconds=*/5, /*plan_timeout_seconds=*/5);
  }
  // Answers every GetRankPlan with `text` (a GetRankPlanResponse in text format).
  void AnswerPlans(const std::string& text) {
    planner_.get_rank_plan =
        Scripted::Always<v1::GetRankPlanRequest, v1::GetRankPlanResponse>(text);
  }

  Scripted planner_;
};

// Two micro-batches of rank `rank`'s plan of `step`, samples 1-3 of 100 tokens.
std::string RankPlanText(int64_t step, int rank) {
  return absl::StrCat("step: ", step, " rank: ", rank,
                      " micro_batches { samples { id: 1 length: 100 density: 0.5 }"
                      " samples { id: 2 length: 100 density: 0.5 } }"
                      " micro_batches { samples { id: 3 length: 100 density: 0.5 } }");
}

// A planner that answers with the plan of another rank or step, or with no plan at all, would
// have the rank train samples another rank trains (or none): the client refuses the answer,
// INTERNAL naming what was asked and what came.
TEST_F(ScriptedPlannerTest, APlanOfAnotherRankOrStepOrNoPlanIsRefused) {
  std::unique_ptr<PlannerClient> client = Connect();
  AnswerPlans(absl::StrCat("plan { ", RankPlanText(0, 1), " }"));
  absl::StatusOr<RankStepPlan> plan = client->GetRankPlan(0, 1);
  ASSERT_TRUE(plan.ok()) << plan.status();  // the plan asked for
  EXPECT_EQ(plan->rank, 1);
  EXPECT_EQ(plan->micro_batches.size(), 2u);

  AnswerPlans(absl::StrCat("plan { ", RankPlanText(0, 0), " }"));
  plan = client->GetRankPlan(0, 1);
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kInternal) << plan.status();
  EXPECT_NE(plan.status().message().find("plan of step 0 of rank 0; asked for step 0 of rank 1"),
            absl::string_view::npos)
      << plan.status();

  AnswerPlans(absl::StrCat("plan { ", RankPlanText(7, 1), " }"));
  plan = client->GetRankPlan(0, 1);
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kInternal) << plan.status();
  EXPECT_NE(plan.status().message().find("plan of step 7 of rank 1"), absl::string_view::npos)
      << plan.status();

  AnswerPlans("");
  plan = client->GetRankPlan(0, 1);
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kInternal) << plan.status();
  EXPECT_NE(plan.status().message().find("holds no plan"), absl::string_view::npos)
      << plan.status();

  // GetRankPlans: each plan is checked against its rank and the step.
  planner_.get_rank_plans = Scripted::Always<v1::GetRankPlansRequest, v1::GetRankPlansResponse>(
      absl::StrCat("plans { ", RankPlanText(0, 0), " } plans { ", RankPlanText(3, 1), " }"));
  absl::StatusOr<std::vector<RankStepPlan>> plans = client->GetRankPlans(0, {0, 1});
  EXPECT_EQ(plans.status().code(), absl::StatusCode::kInternal) << plans.status();
  EXPECT_NE(plans.status().message().find("GetRankPlans: plans[1]: the planner answered with the "
                                          "plan of step 3 of rank 1; asked for step 0 of rank 1"),
            absl::string_view::npos)
      << plans.status();
}

// A plan that breaks the batch or the job's config is refused before the rank trains it:
// FAILED_PRECONDITION naming the micro-batch and the sample, and nothing of it is carried. What
// a real planner sends (a shard of a split document among whole samples) passes.
TEST_F(ScriptedPlannerTest, APlanThatBreaksTheBatchOrTheConfigIsRefused) {
  PlannerConfig config = Config(2);  // two micro-batches a rank
  config.micro_batch_capacity = 250;
  config.shape.layers = 4;
  config.overflow = OverflowPolicy::kDefer;
  std::vector<Sample> batch(6);
  for (uint64_t id = 1; id <= 6; ++id) {
    batch[id - 1].id = id;
    batch[id - 1].length = id == 6 ? 200 : 100;
  }
  std::unique_ptr<PlannerClient> client = Connect();
  auto sample = [](uint64_t id, const std::string& more = "") {
    return absl::StrCat("samples { id: ", id, " length: ", id == 6 ? 200 : 100, " density: 0.5 ",
                        more, " }");
  };
  auto micro_batch = [](const std::string& samples) {
    return absl::StrCat("micro_batches { ", samples, " } ");
  };
  // Rank 1's plan of step 0 with these micro-batches and deferred ids.
  auto plan_text = [](const std::string& micro_batches, const std::string& deferred = "") {
    return absl::StrCat("plan { step: 0 rank: 1 ", micro_batches, "} ", deferred);
  };
  // Rank 1 runs shard 1 of sample 6 (tokens [128, 200), shard 0 on rank 0) with samples 1 and 2.
  const std::string shard = sample(6, "shard { begin: 128 end: 200 index: 1 group: 0 group: 1 }");
  {
    // With the micro-batch's query tokens stated (72 of the shard and 100), as a planner does.
    AnswerPlans(plan_text(absl::StrCat("micro_batches { ", shard, sample(1), " tokens: 172 } ",
                                       micro_batch(sample(2))),
                          "deferred_ids: 5"));
    TrainerSession session(client.get(), 1, /*coordinator=*/false, config);
    absl::StatusOr<RankStepPlan> plan = session.Plan(0, batch);
    ASSERT_TRUE(plan.ok()) << plan.status();
    EXPECT_FALSE(plan->local_fallback);
    ASSERT_EQ(session.carried().size(), 1u);
    EXPECT_EQ(session.carried()[0].id, 5u);
  }
  const std::vector<std::pair<std::string, std::string>> refused = {
      {plan_text(micro_batch(sample(1) + sample(1)) + micro_batch(sample(2))),
       "micro_batches[0]: sample id 1 is planned on this rank again (first in micro_batches[0])"},
      {plan_text(micro_batch(sample(1)) + micro_batch(sample(2) + sample(1))),
       "micro_batches[1]: sample id 1 is planned on this rank again (first in micro_batches[0])"},
      {plan_text(micro_batch(shard) + micro_batch(sample(6))),
       "micro_batches[1]: sample id 6 is planned on this rank again (first in micro_batches[0])"},
      {plan_text(micro_batch(sample(1)) + micro_batch(sample(2)), "deferred_ids: 2"),
       "deferred_ids: sample id 2 is deferred and planned in micro_batches[1]"},
      {plan_text(micro_batch(sample(1)) + micro_batch(sample(2)), "deferred_ids: 999"),
       "deferred_ids: sample id 999 is not in the batch"},
      {plan_text(""), "micro_batches: 0 micro-batches; the job has 2"},
      {plan_text(micro_batch(sample(1)) + micro_batch(sample(2)) + micro_batch(sample(3))),
       "micro_batches: 3 micro-batches; the job has 2"},
      {plan_text(micro_batch(sample(1) + sample(2) + sample(3)) + micro_batch(sample(4))),
       "micro_batches[0]: sample id 3 brings its query tokens to 300, above "
       "micro_batch_capacity 250"},
      {plan_text(micro_batch(sample(1, "layer_densities: 0.5")) + micro_batch(sample(2))),
       "micro_batches[0]: sample id 1 has 1 layer densities; the model has 4 layers"},
      {plan_text(
           absl::StrCat("micro_batches { ", sample(1), " tokens: 150 } ", micro_batch(sample(2)))),
       "micro_batches[0]: tokens: 150 but its samples' query tokens add up to 100"},
  };
  for (const auto& [text, why] : refused) {
    AnswerPlans(text);
    TrainerSession session(client.get(), 1, /*coordinator=*/false, config);
    absl::StatusOr<RankStepPlan> plan = session.Plan(0, batch);
    EXPECT_EQ(plan.status().code(), absl::StatusCode::kFailedPrecondition)
        << text << ": " << plan.status();
    EXPECT_NE(plan.status().message().find(why), absl::string_view::npos)
        << text << ": " << plan.status();
    EXPECT_TRUE(session.carried().empty()) << text;
    // A plan another rank fetched (Adopt) is checked alike.
    const std::string encoded = Scripted::Parse<v1::GetRankPlanResponse>(text).SerializeAsString();
    plan = session.Adopt(0, batch, encoded);
    EXPECT_EQ(plan.status().code(), absl::StatusCode::kFailedPrecondition)
        << text << ": " << plan.status();
    EXPECT_NE(plan.status().message().find(why), absl::string_view::npos)
        << text << ": " << plan.status();
  }
}

// A plan call that fails for the planner's own reasons (busy at --max_waiting_calls, failing
// inside, without a plan of the step, or a plan that fails the client's checks) makes the rank
// plan locally, like an unreachable planner: a rank that returned the error while the others
// fell back would miss the step they run. Errors of the trainer's input are returned.
TEST_F(ScriptedPlannerTest, ThePlannersOwnErrorsFallBackAndTheTrainersInputErrorsAreReturned) {
  const PlannerConfig config = Config(2);
  const std::vector<Sample> batch = Batch(5, 2);
  std::unique_ptr<PlannerClient> client = Connect();
  for (grpc::StatusCode code :
       {grpc::StatusCode::RESOURCE_EXHAUSTED, grpc::StatusCode::INTERNAL, grpc::StatusCode::UNKNOWN,
        grpc::StatusCode::ABORTED, grpc::StatusCode::CANCELLED, grpc::StatusCode::DATA_LOSS,
        grpc::StatusCode::FAILED_PRECONDITION}) {
    planner_.get_rank_plan = Scripted::Refuse<v1::GetRankPlanRequest, v1::GetRankPlanResponse>(
        code, "GetRankPlan: 2 calls are waiting for plans, this planner's limit");
    TrainerSession session(client.get(), 1, /*coordinator=*/false, config);
    absl::StatusOr<RankStepPlan> plan = session.Plan(0, batch);
    ASSERT_TRUE(plan.ok()) << code << ": " << plan.status();
    EXPECT_TRUE(plan->local_fallback) << code;
    EXPECT_EQ(static_cast<int>(session.fallback_reason().code()), static_cast<int>(code));
  }
  // The plan of another rank (INTERNAL, from the client's own check) is the planner's failing too.
  AnswerPlans(absl::StrCat("plan { ", RankPlanText(0, 0), " }"));
  {
    TrainerSession session(client.get(), 1, /*coordinator=*/false, config);
    absl::StatusOr<RankStepPlan> plan = session.Plan(0, batch);
    ASSERT_TRUE(plan.ok()) << plan.status();
    EXPECT_TRUE(plan->local_fallback);
    EXPECT_EQ(session.fallback_reason().code(), absl::StatusCode::kInternal);
  }
  for (grpc::StatusCode code :
       {grpc::StatusCode::INVALID_ARGUMENT, grpc::StatusCode::NOT_FOUND,
        grpc::StatusCode::ALREADY_EXISTS, grpc::StatusCode::PERMISSION_DENIED,
        grpc::StatusCode::UNAUTHENTICATED}) {
    planner_.get_rank_plan =
        Scripted::Refuse<v1::GetRankPlanRequest, v1::GetRankPlanResponse>(code, "refused");
    TrainerSession session(client.get(), 1, /*coordinator=*/false, config);
    absl::StatusOr<RankStepPlan> plan = session.Plan(0, batch);
    EXPECT_EQ(static_cast<int>(plan.status().code()), static_cast<int>(code)) << plan.status();
  }
  // The coordinator's SubmitBatch alike: it plans locally and keeps the batch for the planner.
  planner_.submit_batch = Scripted::Refuse<v1::SubmitBatchRequest, v1::SubmitBatchResponse>(
      grpc::StatusCode::RESOURCE_EXHAUSTED, "SubmitBatch: the planner ran out of memory");
  TrainerSession coordinator(client.get(), 0, /*coordinator=*/true, config);
  absl::StatusOr<RankStepPlan> plan = coordinator.Plan(0, batch);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_TRUE(plan->local_fallback);
  EXPECT_EQ(coordinator.unsent_local_steps(), 1u);
}

// The batch of a locally planned step that the planner refuses for a reason of its own when the
// coordinator resubmits it (busy, failing inside) stays queued and goes at the next try, in
// order: it was dropped, and the planner never learned what the ranks ran in that step.
TEST_F(ScriptedPlannerTest, ALocalStepsBatchRefusedForNowIsSubmittedAgain) {
  const PlannerConfig config = Config(2);
  const std::vector<Sample> batch = Batch(5, 2);
  std::unique_ptr<PlannerClient> client = Connect();
  absl::Mutex mu;
  bool busy = true;
  std::vector<int64_t> delivered;  // the local steps the planner took, in order
  planner_.submit_batch = [&](const v1::SubmitBatchRequest& request, v1::SubmitBatchResponse*) {
    absl::MutexLock lock(&mu);
    if (busy) {
      return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                          "SubmitBatch: the planner ran out of memory for this call");
    }
    if (request.planned_locally()) delivered.push_back(request.step());
    return grpc::Status::OK;
  };
  TrainerSession coordinator(client.get(), 0, /*coordinator=*/true, config);
  for (int64_t step : {0, 1}) {
    absl::StatusOr<RankStepPlan> plan = coordinator.Plan(step, batch);
    ASSERT_TRUE(plan.ok()) << plan.status();
    EXPECT_TRUE(plan->local_fallback) << step;
  }
  // Step 1's try to resubmit step 0 was refused too: both wait.
  EXPECT_EQ(coordinator.unsent_local_steps(), 2u);
  {
    absl::MutexLock lock(&mu);
    busy = false;
  }
  absl::Status flushed = coordinator.Flush();
  EXPECT_TRUE(flushed.ok()) << flushed;
  EXPECT_EQ(coordinator.unsent_local_steps(), 0u);
  absl::MutexLock lock(&mu);
  EXPECT_EQ(delivered, (std::vector<int64_t>{0, 1}));
}

// A report the planner refuses for a reason of its own (busy, failing inside) is kept and sent
// again before the next one, in order, as while the planner is away; one it refuses for its
// content is dropped and said.
TEST_F(ScriptedPlannerTest, AReportRefusedForNowIsKeptAndOneRefusedForGoodIsDropped) {
  std::unique_ptr<PlannerClient> client = Connect();
  for (grpc::StatusCode code :
       {grpc::StatusCode::RESOURCE_EXHAUSTED, grpc::StatusCode::INTERNAL, grpc::StatusCode::UNKNOWN,
        grpc::StatusCode::ABORTED, grpc::StatusCode::CANCELLED}) {
    absl::Mutex mu;
    std::vector<int64_t> delivered;  // steps, in the order the planner took them
    bool refused_once = false;
    planner_.report_step = [&](const v1::ReportStepRequest& request, v1::ReportStepResponse*) {
      absl::MutexLock lock(&mu);
      if (!refused_once) {
        refused_once = true;
        return grpc::Status(code, "ReportStep: the planner ran out of memory for this call");
      }
      delivered.push_back(request.step());
      return grpc::Status::OK;
    };
    TrainerSession session(client.get(), 1, /*coordinator=*/false, Config(2));
    const std::vector<MicroBatchTiming> timings(1);
    absl::Status reported = session.Report(0, timings, 0.0);
    EXPECT_TRUE(reported.ok()) << code << ": " << reported;
    EXPECT_EQ(session.buffered_reports(), 1u) << code;
    reported = session.Report(1, timings, 0.0);
    EXPECT_TRUE(reported.ok()) << code << ": " << reported;
    EXPECT_EQ(session.buffered_reports(), 0u) << code;
    EXPECT_EQ(session.dropped_reports(), 0) << code;
    absl::MutexLock lock(&mu);
    EXPECT_EQ(delivered, (std::vector<int64_t>{0, 1})) << code;
  }
  planner_.report_step = Scripted::Refuse<v1::ReportStepRequest, v1::ReportStepResponse>(
      grpc::StatusCode::INVALID_ARGUMENT, "micro_batches[0].micro_batch: 7 is not planned");
  TrainerSession session(client.get(), 1, /*coordinator=*/false, Config(2));
  absl::Status reported = session.Report(0, std::vector<MicroBatchTiming>(1), 0.0);
  EXPECT_EQ(reported.code(), absl::StatusCode::kInvalidArgument) << reported;
  EXPECT_NE(reported.message().find("report of step 0 dropped"), absl::string_view::npos)
      << reported;
  EXPECT_EQ(session.buffered_reports(), 0u);
  EXPECT_EQ(session.dropped_reports(), 1);
}

// A refusal at the job's bound in the planner's state directory (RESOURCE_EXHAUSTED with the
// reason JOB_STATE_QUOTA) does not pass by itself as the planner being busy does, so it is not
// retried: the coordinator plans locally with one refused call a step (taken for busy, every
// local step's batch stayed queued and went again before each new step's own, for ever), and a
// report so refused is dropped and said (it stayed at the head of the queue and was sent again
// before every later report, none of which got through).
TEST_F(ScriptedPlannerTest, ARefusalAtTheJobsStateBoundIsNotSentAgain) {
  const grpc::Status quota = ToGrpcStatus(WithErrorReason(
      absl::ResourceExhaustedError("job \"job\" keeps 1048000 bytes in the state directory; step "
                                   "4's record would take it past its bound of 1048576 bytes "
                                   "(--max_job_state_mb=1)"),
      kReasonJobStateQuota));
  EXPECT_TRUE(IsJobStateQuota(FromGrpcStatus(quota)));
  EXPECT_FALSE(IsTransient(FromGrpcStatus(quota)));
  planner_.submit_batch = [quota](const v1::SubmitBatchRequest&, v1::SubmitBatchResponse*) {
    return quota;
  };
  planner_.report_step = [quota](const v1::ReportStepRequest&, v1::ReportStepResponse*) {
    return quota;
  };
  std::unique_ptr<PlannerClient> client = Connect();
  const PlannerConfig config = Config(2);
  TrainerSession coordinator(client.get(), 0, /*coordinator=*/true, config);
  for (int64_t step = 0; step < 4; ++step) {
    absl::StatusOr<RankStepPlan> plan = coordinator.Plan(step, Batch(5 + step, 2));
    ASSERT_TRUE(plan.ok()) << plan.status();
    EXPECT_TRUE(plan->local_fallback) << step;
    EXPECT_TRUE(IsJobStateQuota(coordinator.fallback_reason())) << coordinator.fallback_reason();
    EXPECT_EQ(planner_.Calls("SubmitBatch"), step + 1);
    // Only this step's batch waits, for the planner once it has room (a planned_locally submit
    // of it moves the planner past the steps it never saw).
    EXPECT_EQ(coordinator.unsent_local_steps(), 1u) << step;
  }
  TrainerSession rank(client.get(), 1, /*coordinator=*/false, config);
  for (int64_t step = 0; step < 3; ++step) {
    const absl::Status reported = rank.Report(step, std::vector<MicroBatchTiming>(1), 0.0);
    EXPECT_TRUE(IsJobStateQuota(reported)) << reported;
    EXPECT_NE(reported.message().find(absl::StrCat("report of step ", step, " dropped")),
              absl::string_view::npos)
        << reported;
    EXPECT_EQ(rank.buffered_reports(), 0u);
    EXPECT_EQ(rank.dropped_reports(), step + 1);
    EXPECT_EQ(planner_.Calls("ReportStep"), step + 1);
  }
  // Flush tries the waiting batch once and ends: nothing is left to send again.
  const absl::Status flushed = coordinator.Flush();
  EXPECT_TRUE(IsJobStateQuota(flushed)) << flushed;
  EXPECT_EQ(coordinator.unsent_local_steps(), 0u);
  EXPECT_EQ(planner_.Calls("SubmitBatch"), 5);
  EXPECT_TRUE(coordinator.Flush().ok());
  EXPECT_EQ(planner_.Calls("SubmitBatch"), 5);
}

// A session made without a client says so on every call that needs it (it dereferenced the
// null pointer: a crash, e.g. TrainerSession(None, ...) from Python).
TEST(TrainerSessionWithoutClientTest, ItsCallsAreErrorsNotACrash) {
  TrainerSession session(/*client=*/nullptr, 0, /*coordinator=*/true, Config(2));
  const absl::StatusOr<RankStepPlan> plan = session.Plan(0, Batch(3, 2));
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument) << plan.status();
  EXPECT_NE(plan.status().message().find("client: null"), absl::string_view::npos) << plan.status();
  EXPECT_EQ(session.Report(0, std::vector<MicroBatchTiming>(1), 0.0).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(session.Flush().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(session.buffered_reports(), 0u);
}

// A timeout that cannot be a deadline (infinite, NaN, <= 0) is refused at Connect, naming the
// option; a huge finite one waits as long as a call can (it made every call fail at once: its
// milliseconds overflowed on the way to a deadline).
TEST_F(ScriptedPlannerTest, TimeoutsAreFiniteAndAHugeOneIsNoDeadlineInThePast) {
  for (const char* name : {"call_timeout_seconds", "plan_timeout_seconds"}) {
    for (double seconds : {std::numeric_limits<double>::infinity(),
                           std::numeric_limits<double>::quiet_NaN(), 0.0, -1.0}) {
      ClientOptions options;
      options.target = planner_.target();
      (std::string(name) == "call_timeout_seconds" ? options.call_timeout_seconds
                                                   : options.plan_timeout_seconds) = seconds;
      absl::StatusOr<std::unique_ptr<PlannerClient>> client = PlannerClient::Connect(options);
      EXPECT_EQ(client.status().code(), absl::StatusCode::kInvalidArgument) << name << seconds;
      EXPECT_EQ(client.status().message().find(name), 0u) << client.status();
    }
  }
  AnswerPlans(absl::StrCat("plan { ", RankPlanText(0, 1), " }"));
  for (double seconds : {1e12, 1e300}) {
    std::unique_ptr<PlannerClient> client =
        test_support::ConnectLoopback(planner_.port(), "job", "token", seconds, seconds);
    ASSERT_NE(client, nullptr);
    absl::StatusOr<RankStepPlan> plan = client->GetRankPlan(0, 1);
    EXPECT_TRUE(plan.ok()) << seconds << ": " << plan.status();
  }
}

// PlannerClient is thread-safe, CreateJob included: while one thread creates jobs, calls made
// on other threads each name one job with that job's token (the old one or the new one), and
// options() shows one job with its token. CreateJob wrote the client's job and token while
// other calls read them: a data race (scripts/tsan.sh reports it) that could also send one
// job's id with another's token.
TEST_F(ScriptedPlannerTest, CreateJobOnOneThreadAndCallsOnOthersNameOneJobWithItsToken) {
  constexpr int kJobs = 200;
  std::atomic<int> created{0};
  JobSettings settings;
  settings.planner = Config(2);
  const v1::JobConfig config = ConfigToProto(settings);
  planner_.create_job = [&](const v1::CreateJobRequest&, v1::CreateJobResponse* response) {
    const int n = ++created;
    response->set_job_id(absl::StrCat("job-", n));
    response->set_job_token(absl::StrCat("token-", n));
    *response->mutable_config() = config;
    return grpc::Status::OK;
  };
  planner_.join_job = [&](const v1::JoinJobRequest&, v1::JoinJobResponse* response) {
    *response->mutable_config() = config;
    return grpc::Status::OK;
  };
  absl::Mutex mu;
  std::vector<std::pair<std::string, std::string>> seen;  // (job id, token) of each JoinJob
  planner_.observe = [&](const std::string& method, const std::string& bearer,
                         const google::protobuf::Message& request) {
    if (method != "JoinJob") return;
    absl::MutexLock lock(&mu);
    seen.emplace_back(static_cast<const v1::JoinJobRequest&>(request).job_id(), bearer);
  };
  std::unique_ptr<PlannerClient> client =
      test_support::ConnectLoopback(planner_.port(), "job-0", "token-0", 5);
  // Whether `id` and `token` are one job's: "job-N" and "token-N".
  auto same_job = [](const std::string& id, const std::string& token) {
    return id.substr(4) == token.substr(6) && absl::StartsWith(id, "job-") &&
           absl::StartsWith(token, "token-");
  };
  std::atomic<bool> done{false};
  std::atomic<int> torn{0};
  std::vector<std::thread> callers;
  for (int t = 0; t < 2; ++t) {
    callers.emplace_back([&] {
      while (!done) {
        EXPECT_TRUE(client->JoinJob(0).ok());
        const ClientOptions options = client->options();
        if (!same_job(options.job_id, options.token)) ++torn;
      }
    });
  }
  for (int j = 0; j < kJobs; ++j) ASSERT_TRUE(client->CreateJob("job", Config(2)).ok());
  done = true;
  for (std::thread& t : callers) t.join();
  EXPECT_EQ(torn.load(), 0);
  EXPECT_EQ(client->options().job_id, absl::StrCat("job-", kJobs));
  EXPECT_EQ(client->options().token, absl::StrCat("token-", kJobs));
  absl::MutexLock lock(&mu);
  EXPECT_FALSE(seen.empty());
  for (const auto& [id, token] : seen) EXPECT_TRUE(same_job(id, token)) << id << " " << token;
}

}  // namespace
}  // namespace sparsebalance
