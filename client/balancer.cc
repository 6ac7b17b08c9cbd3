#include "client/balancer.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <deque>
#include <limits>
#include <map>
#include <thread>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/trainer_session.h"

namespace sparsebalance {
namespace {

using SteadyClock = std::chrono::steady_clock;

// What a member hands gather_reports: kGatheredReport then its EncodeRankStepReport, or
// kGatheredNothing for a step it does not report (SkipReport). Never empty bytes, which are
// also the encoding of an empty report of step 0 by rank 0.
constexpr char kGatheredReport[] = "R";
constexpr char kGatheredNothing[] = "-";

// What a plan group's leader hands each member by scatter_plans, by its first byte:
constexpr char kHandedPlan = 'P';        // then the member's plan (GetRankPlans' `encoded`)
constexpr char kHandedPrefetched = 'Q';  // the same, fetched by the leader's prefetch
constexpr char kHandedLocal = 'L';       // then why the leader fell back: plan locally
constexpr char kHandedFetch = 'F';       // a planner without GetRankPlans: fetch your own
constexpr char kHandedError = 'E';       // then "<absl::StatusCode>:<message>", the leader's error
constexpr size_t kMaxPlanGroup = 1024;   // kMaxBatchRanks (proto/wire.h)

double SecondsSince(SteadyClock::time_point start) {
  return std::chrono::duration<double>(SteadyClock::now() - start).count();
}

// FAILED_PRECONDITION naming the first shard in `plan` (BalancerOptions::runs_shards false);
// OK when it holds none.
absl::Status RefuseShards(const RankStepPlan& plan) {
  for (const MicroBatchPlan& mb : plan.micro_batches) {
    for (const PlannedSample& p : mb.samples) {
      if (!p.sharded()) continue;
      return absl::FailedPreconditionError(absl::StrCat(
          "step ", plan.step, ": sample ", p.id, " is planned as shard ", p.shard_index, " of ",
          p.shard_group.size(), " (tokens [", p.shard_begin, ", ", p.shard_end, ") of ", p.length,
          "): the job's max_shards was raised above 1 (UpdateJobConfig) while this trainer runs "
          "documents whole, so it would train the whole document on every rank of the shard's "
          "group; set max_shards back to 1 with UpdateJobConfig (steps planned already keep "
          "their shards), or train with sb-worker, which runs shards"));
    }
  }
  return absl::OkStatus();
}

// Steps are below 2^48 (the planner refuses others).
constexpr int64_t kStepBound = int64_t{1} << 48;

// The least of every rank's `value` in [0, kStepBound), found with any_rank alone: each probe
// is one any_rank(value < probe), the same calls on every rank. Probes 1, 2, 4, ... until one
// is above the least, then a binary search below it: one call when every value is 0 (a new
// job), about 2 log2(least) + 1 otherwise.
int64_t LeastOnAnyRank(const std::function<bool(bool)>& any_rank, int64_t value) {
  int64_t lo = 0;  // the least is in [lo, hi)
  int64_t hi = 1;
  while (hi < kStepBound && !any_rank(value < hi)) {
    lo = hi;
    hi *= 2;
  }
  while (hi - lo > 1) {
    const int64_t probe = lo + (hi - lo) / 2;
    if (any_rank(value < probe)) {
      hi = probe;
    } else {
      lo = probe;
    }
  }
  return lo;
}

bool SameBatch(const std::vector<Sample>& a, const std::vector<Sample>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].id != b[i].id || a[i].length != b[i].length || a[i].sensitivity != b[i].sensitivity ||
        a[i].group != b[i].group || a[i].segments != b[i].segments) {
      return false;
    }
  }
  return true;
}

// plan_group and scatter_plans: both or neither; the group holds this rank, distinct ranks of
// the job, at most kMaxPlanGroup, and rank 0 leads its group.
absl::Status CheckPlanGroup(const BalancerOptions& options) {
  const std::vector<int>& group = options.plan_group;
  if (!options.scatter_plans) {
    if (group.empty()) return absl::OkStatus();
    return absl::InvalidArgumentError(
        "scatter_plans: unset, but plan_group is given (plans through a group leader need both)");
  }
  if (group.empty() || group.size() > kMaxPlanGroup) {
    return absl::InvalidArgumentError(absl::StrCat("plan_group: ", group.size(), " ranks; 1 to ",
                                                   kMaxPlanGroup, " with scatter_plans"));
  }
  for (size_t k = 0; k < group.size(); ++k) {
    if (group[k] < 0 || group[k] >= options.world) {
      return absl::InvalidArgumentError(absl::StrCat("plan_group[", k, "]: ", group[k],
                                                     " is outside [0, world=", options.world, ")"));
    }
    if (std::find(group.begin(), group.begin() + k, group[k]) != group.begin() + k) {
      return absl::InvalidArgumentError(
          absl::StrCat("plan_group[", k, "]: rank ", group[k], " is in the group twice"));
    }
  }
  if (std::find(group.begin(), group.end(), options.rank) == group.end()) {
    return absl::InvalidArgumentError(
        absl::StrCat("plan_group: it does not hold this rank (", options.rank, ")"));
  }
  if (group[0] != 0 && std::find(group.begin(), group.end(), 0) != group.end()) {
    return absl::InvalidArgumentError(
        "plan_group: rank 0 must lead its group (come first): it submits each step's batch");
  }
  return absl::OkStatus();
}

}  // namespace

struct Balancer::State {
  // A plan made on the session, with what it needs besides: the samples the step deferred
  // (carried() right after it) and, for a local plan, why (OK: the planner's record of the step
  // is a local plan).
  struct Planned {
    absl::StatusOr<RankStepPlan> plan = absl::UnknownError("not planned");
    std::vector<Sample> carried;
    absl::Status why;
    std::vector<std::string> encoded;  // a plan group leader's: its members' plans
    bool prefetched = false;  // a member's: its leader's prefetch fetched it (kHandedPrefetched)
  };
  struct Prefetched {
    enum class Phase { kQueued, kRunning, kDone };
    std::vector<Sample> batch;
    Phase phase = Phase::kQueued;
    Planned planned;
  };
  BalancerOptions options;
  std::unique_ptr<PlannerClient> client;
  JobHandle job;
  PlannerConfig config;
  bool offline = false;
  std::string offline_reason;
  bool leads_plans = false;  // scatter_plans, and this rank leads its plan group
  bool takes_plans = false;  // scatter_plans, and another rank leads this one's group

  // Every TrainerSession call holds it. Lock order: session_mu, then mu.
  absl::Mutex session_mu;
  std::unique_ptr<TrainerSession> session ABSL_GUARDED_BY(session_mu);

  mutable absl::Mutex mu;
  absl::CondVar changed;  // any of the below changed
  int64_t next_step ABSL_GUARDED_BY(mu) = 0;
  int64_t last_final_step ABSL_GUARDED_BY(mu) = -1;
  // The first step this rank had not reported when it joined (JoinJob): the steps before it
  // that it runs again (the ranks start at the least of theirs, or Resume goes back) are not
  // reported twice. Set once, at Start.
  int64_t reported_before = 0;
  std::vector<Sample> carried ABSL_GUARDED_BY(mu);  // deferred by the latest final step
  std::map<int64_t, Prefetched> prefetches ABSL_GUARDED_BY(mu);
  // Reports to send: this rank's, or with gather_reports on the leader its group's.
  std::deque<RankStepReport> reports ABSL_GUARDED_BY(mu);
  size_t sending ABSL_GUARDED_BY(mu) = 0;  // reports the worker is handing to the session
  bool stop ABSL_GUARDED_BY(mu) = false;
  Stats stats ABSL_GUARDED_BY(mu);
  int64_t queue_dropped ABSL_GUARDED_BY(mu) = 0;     // reports the queue's bound dropped
  int64_t session_buffered ABSL_GUARDED_BY(mu) = 0;  // the session's, after its latest call
  int64_t session_dropped ABSL_GUARDED_BY(mu) = 0;
  absl::Status refused ABSL_GUARDED_BY(mu);  // a report refused for good, not yet said

  // Fallback warnings; the caller's thread only (Plan).
  double last_warn_seconds = -std::numeric_limits<double>::infinity();
  bool away = false;         // the latest step ran on the local plan
  bool warned_away = false;  // and that was said

  std::thread worker;

  size_t ReportLimit() const {
    return static_cast<size_t>(std::max(1, options.client.max_buffered_reports));
  }
  // After a session call: its counts for stats() (which must not wait for the session).
  void NoteSession() ABSL_EXCLUSIVE_LOCKS_REQUIRED(session_mu) {
    absl::MutexLock lock(&mu);
    session_buffered = static_cast<int64_t>(session->buffered_reports());
    session_dropped = session->dropped_reports();
  }
  // The first queued prefetch that may start now: the step after the latest final one.
  Prefetched* Startable(int64_t* step) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    auto it = prefetches.find(last_final_step + 1);
    if (it == prefetches.end() || it->second.phase != Prefetched::Phase::kQueued) return nullptr;
    *step = it->first;
    return &it->second;
  }
  // Plans `step` on the session: the planner's plan (or the local one offline).
  Planned PlanOnSession(int64_t step, const std::vector<Sample>& batch)
      ABSL_LOCKS_EXCLUDED(session_mu, mu) {
    Planned planned;
    absl::MutexLock lock(&session_mu);
    if (offline) {
      planned.plan = session->LocalPlan(step, batch);
      planned.why = absl::UnavailableError(offline_reason);
    } else if (leads_plans) {
      planned.plan = session->Plan(step, batch, options.plan_group, &planned.encoded);
      planned.why = session->fallback_reason();
    } else {
      planned.plan = session->Plan(step, batch);
      planned.why = session->fallback_reason();
    }
    planned.carried = session->carried();
    NoteSession();
    return planned;
  }
  // A plan group's leader: hands each member its part of `own` (scatter_plans), which its
  // prefetch fetched when `prefetched`.
  void HandPlans(const Planned& own, bool prefetched) ABSL_LOCKS_EXCLUDED(session_mu, mu);
  // A plan group's member: its plan of `step` as the leader handed it (scatter_plans), taken
  // on the session.
  Planned TakePlan(int64_t step, const std::vector<Sample>& batch)
      ABSL_LOCKS_EXCLUDED(session_mu, mu);
  // gather_reports with this rank's `payload`; on the leader, the group's reports (a member's
  // payload that is not a report nor kGatheredNothing is dropped with a warning).
  std::vector<RankStepReport> Gather(int64_t step, const std::string& payload);
  // Queues reports for the worker, bounded by ReportLimit (the oldest go).
  void Queue(std::vector<RankStepReport> queued) ABSL_LOCKS_EXCLUDED(mu);
  bool AnyRunning() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    return std::any_of(prefetches.begin(), prefetches.end(),
                       [](const auto& p) { return p.second.phase == Prefetched::Phase::kRunning; });
  }
};

Balancer::Balancer(std::unique_ptr<State> state) : state_(std::move(state)) {
  state_->worker = std::thread([this] { Work(); });
}

Balancer::~Balancer() {
  {
    absl::MutexLock lock(&state_->mu);
    state_->stop = true;
    state_->changed.SignalAll();
  }
  state_->worker.join();
}

absl::StatusOr<std::unique_ptr<Balancer>> Balancer::Start(BalancerOptions options) {
  if (options.world < 1) {
    return absl::InvalidArgumentError(absl::StrCat("world: ", options.world, " must be >= 1"));
  }
  if (options.rank < 0 || options.rank >= options.world) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank: ", options.rank, " is outside [0, world=", options.world, ")"));
  }
  if (!(options.warn_interval_seconds >= 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("warn_interval_seconds: ", options.warn_interval_seconds, " must be >= 0"));
  }
  if (options.world > 1 && (!options.any_rank || !options.share_job)) {
    return absl::InvalidArgumentError(
        absl::StrCat("any_rank and share_job: both are needed when world is ", options.world,
                     " (collectives over the trainer's ranks, e.g. torch.distributed)"));
  }
  if (absl::Status group = CheckPlanGroup(options); !group.ok()) return group;
  if (!options.any_rank) options.any_rank = [](bool mine) { return mine; };
  if (!options.share_job) options.share_job = [](const JobHandle& job) { return job; };
  if (!options.warn) {
    options.warn = [](const std::string& line) { std::fprintf(stderr, "%s\n", line.c_str()); };
  }
  if (!options.now_seconds) {
    options.now_seconds = [] {
      return std::chrono::duration<double>(SteadyClock::now().time_since_epoch()).count();
    };
  }
  const std::string& target = options.client.target;
  const int rank = options.rank;

  // Bad client options fail every rank alike, before any collective.
  absl::StatusOr<std::unique_ptr<PlannerClient>> admin = PlannerClient::Connect(options.client);
  if (!admin.ok()) return admin.status();

  // Rank 0 creates the job (or names the one to resume); every rank learns it from rank 0.
  absl::Status mine;
  JobHandle handle;
  if (rank == 0) {
    if (options.job_id.empty()) {
      absl::StatusOr<JobHandle> created = (*admin)->CreateJob(options.job_name, options.config);
      if (created.ok()) {
        handle = *std::move(created);
      } else {
        mine = created.status();
      }
    } else {
      handle.job_id = options.job_id;
      handle.token = options.client.token;
    }
  }
  const JobHandle shared = options.share_job(mine.ok() ? handle : JobHandle{});
  if (mine.ok() && shared.job_id.empty()) {
    mine = absl::UnavailableError("rank 0 could not start the job");
  }

  auto state = std::make_unique<State>();
  ClientOptions client_options = options.client;
  client_options.job_id = shared.job_id;
  client_options.token = shared.token;
  absl::StatusOr<std::unique_ptr<PlannerClient>> client = PlannerClient::Connect(client_options);
  if (!client.ok()) return client.status();  // cannot be: the same options connected above
  state->client = *std::move(client);
  PlannerConfig config = options.config;
  int64_t next_step = 0;
  if (mine.ok()) {
    absl::StatusOr<std::pair<PlannerConfig, int64_t>> joined =
        state->client->JoinJob(rank, &next_step);
    if (joined.ok()) {
      config = joined->first;
    } else {
      mine = joined.status();
    }
  }
  // Every rank agrees: an error anywhere fails every rank; the planner away anywhere makes every
  // rank offline (or fails them all).
  const bool failed = options.any_rank(!mine.ok() && !IsUnreachable(mine));
  const bool away = options.any_rank(!mine.ok() && IsUnreachable(mine));
  if (failed) {
    if (!mine.ok() && !IsUnreachable(mine)) return mine;
    return absl::AbortedError(
        absl::StrCat("Balancer::Start: another rank could not start the job on the planner at ",
                     target, " (its error says why)"));
  }
  if (away) {
    const std::string reason =
        mine.ok() ? std::string("another rank could not reach it") : mine.ToString();
    if (!options.allow_offline_start) {
      return absl::UnavailableError(absl::StrCat(
          "the planner at ", target, " is unreachable: ", reason,
          "; start it, fix the target, or allow offline start to train on local plans"));
    }
    state->offline = true;
    state->offline_reason = absl::StrCat("offline since start (", reason, ")");
    config = options.config;
    next_step = 0;
    options.warn(absl::StrCat("sparsebalance: the planner at ", target, " is unreachable (", reason,
                              "); offline start: every step runs on the local plan"));
  } else {
    state->job = shared;
    state->job.config = config;
    state->reported_before = next_step;
    // A joined job's ranks may have reported different steps (one died with reports still
    // buffered): each would start at its own, and the ranks would train parts of different
    // global batches in every step after. They start at the least. Every rank searches (only
    // rank 0 need be given the job's id), with one collective for a new job.
    next_step = LeastOnAnyRank(options.any_rank, next_step);
  }
  state->config = config;
  {
    absl::MutexLock lock(&state->session_mu);
    // Offline, no rank keeps batches for a planner that will never see them.
    state->session = std::make_unique<TrainerSession>(
        state->client.get(), rank, /*coordinator=*/rank == 0 && !state->offline, config);
  }
  if (options.scatter_plans) {
    state->leads_plans = options.plan_group[0] == rank;
    state->takes_plans = !state->leads_plans;
  }
  {
    absl::MutexLock lock(&state->mu);
    state->next_step = next_step;
    state->last_final_step = next_step - 1;
    state->stats.planner_reachable = !state->offline;
    if (state->offline) state->stats.last_error = state->offline_reason;
  }
  state->options = std::move(options);
  return std::unique_ptr<Balancer>(new Balancer(std::move(state)));
}

void Balancer::Work() {
  State& s = *state_;
  while (true) {
    int64_t step = 0;
    State::Prefetched* prefetch = nullptr;
    std::vector<Sample> batch;
    std::vector<RankStepReport> reports;
    {
      absl::MutexLock lock(&s.mu);
      while (!s.stop && (prefetch = s.Startable(&step)) == nullptr && s.reports.empty()) {
        s.changed.Wait(&s.mu);
      }
      if (s.stop) return;
      if (prefetch != nullptr) {  // a step's plan is on the critical path: it goes first
        prefetch->phase = State::Prefetched::Phase::kRunning;
        batch = prefetch->batch;
      } else {  // every queued report: a backlog, or a group's, goes in batches
        reports.assign(std::make_move_iterator(s.reports.begin()),
                       std::make_move_iterator(s.reports.end()));
        s.reports.clear();
        s.sending = reports.size();
      }
    }
    if (prefetch != nullptr) {
      State::Planned planned = s.PlanOnSession(step, batch);
      absl::MutexLock lock(&s.mu);
      prefetch->planned = std::move(planned);  // map nodes stay put; only Plan erases it, after
      prefetch->phase = State::Prefetched::Phase::kDone;
      s.changed.SignalAll();
      continue;
    }
    absl::Status sent;
    {
      absl::MutexLock lock(&s.session_mu);
      sent = s.session->Report(std::move(reports));
      s.NoteSession();
    }
    absl::MutexLock lock(&s.mu);
    s.sending = 0;
    if (!sent.ok() && s.refused.ok()) s.refused = sent;  // said by the next Plan or Finish
    s.changed.SignalAll();
  }
}

void Balancer::Prefetch(int64_t step, std::vector<Sample> batch) {
  State& s = *state_;
  if (!s.options.prefetch) return;
  if (s.takes_plans && !s.offline) return;  // the group's leader prefetches this rank's plan
  absl::MutexLock lock(&s.mu);
  if (step <= s.last_final_step) return;  // already final: nothing to plan ahead
  auto [it, inserted] = s.prefetches.try_emplace(step);
  if (!inserted && it->second.phase != State::Prefetched::Phase::kQueued) return;
  it->second.batch = std::move(batch);
  s.changed.SignalAll();
}

absl::StatusOr<RankStepPlan> Balancer::Plan(int64_t step, const std::vector<Sample>& batch) {
  State& s = *state_;
  const SteadyClock::time_point start = SteadyClock::now();
  State::Planned own;
  bool prefetched = false;
  bool planned = false;
  std::string refused;
  {
    absl::MutexLock lock(&s.mu);
    if (!s.refused.ok()) {
      refused = s.refused.ToString();
      s.refused = absl::OkStatus();
    }
    for (auto it = s.prefetches.begin(); it != s.prefetches.end() && it->first < step;) {
      // Prefetches of steps that were never planned: stale (a running one ends on its own).
      if (it->second.phase == State::Prefetched::Phase::kRunning) {
        ++it;
      } else {
        it = s.prefetches.erase(it);
      }
    }
    auto it = s.prefetches.find(step);
    if (it != s.prefetches.end() && it->second.phase == State::Prefetched::Phase::kQueued) {
      s.prefetches.erase(it);  // not started: plan it here
    } else if (it != s.prefetches.end()) {
      while (it->second.phase != State::Prefetched::Phase::kDone) s.changed.Wait(&s.mu);
      if (SameBatch(it->second.batch, batch)) {
        own = std::move(it->second.planned);
        prefetched = true;
      } else {
        own.plan = absl::InvalidArgumentError(
            absl::StrCat("batch: Plan(", step, ") was given another batch than Prefetch(", step,
                         ") planned; pass the same samples to both"));
      }
      s.prefetches.erase(it);
      planned = true;
    }
  }
  if (!refused.empty()) s.options.warn(absl::StrCat("sparsebalance: ", refused));
  if (!planned) {
    own = s.takes_plans && !s.offline ? s.TakePlan(step, batch) : s.PlanOnSession(step, batch);
  }
  if (s.leads_plans && !s.offline) s.HandPlans(own, prefetched);
  // A member's plan counts as prefetched when its leader's prefetch fetched it.
  prefetched = prefetched || own.prefetched;
  double wait_seconds = SecondsSince(start);
  // A shard this trainer would run as its whole document is an input error of this rank: the
  // collectives below make it every rank's, so that a rank whose own plan holds no shard does
  // not go on alone. Local plans are left out: every rank makes its own below, with the config
  // it joined with.
  if (!s.options.runs_shards && own.plan.ok() && !own.plan->local_fallback) {
    if (absl::Status whole = RefuseShards(*own.plan); !whole.ok()) own.plan = std::move(whole);
  }
  // The one collective of the step: every rank runs one plan, the local one if any rank fell
  // back. A rank that failed (an error of the trainer's input: the planner's own errors are
  // fallbacks) counts as fallen back here; then a second collective, which every rank makes
  // because the first one's answer is the same everywhere, tells the others, and every rank
  // returns an error, as at Start: a rank that trained the step alone would wait for the
  // failed one in its next collective for ever.
  const bool fell_back = !own.plan.ok() || own.plan->local_fallback;
  const bool any_fell_back = s.options.any_rank(fell_back);
  if (any_fell_back && s.options.any_rank(!own.plan.ok())) {
    if (!own.plan.ok()) return own.plan.status();
    return absl::AbortedError(absl::StrCat("Balancer::Plan: another rank could not plan step ",
                                           step, " (its error says why); no rank runs it"));
  }
  bool reachable = true;
  std::string reason;
  if (own.plan->local_fallback) {
    reachable = own.why.ok();
    if (s.offline) {
      reason = s.offline_reason;
    } else if (reachable) {
      reason = absl::StrCat("the planner's record of step ", step, " is a local plan");
      // Its copy is made with the job's config as it is now and with the planner's release;
      // the ranks that fell back made theirs with the config they joined with and this
      // release. Every rank makes its own, so that all run one plan after an UpdateJobConfig
      // or between releases too (the same plan where nothing differs).
      absl::MutexLock lock(&s.session_mu);
      own.plan = s.session->LocalPlan(step, batch);
      own.carried = s.session->carried();
      s.NoteSession();
      if (!own.plan.ok()) return own.plan.status();
    } else {
      reason = own.why.ToString();
    }
  } else if (any_fell_back) {
    const SteadyClock::time_point local_start = SteadyClock::now();
    {
      absl::MutexLock lock(&s.session_mu);
      own.plan = s.session->LocalPlan(step, batch);
      own.carried = s.session->carried();
      s.NoteSession();
    }
    wait_seconds += SecondsSince(local_start);
    if (!own.plan.ok()) return own.plan.status();
    reason = "another rank could not get the planner's plan";
  }
  const bool local = own.plan->local_fallback;
  int64_t local_steps = 0;
  {
    absl::MutexLock lock(&s.mu);
    s.last_final_step = step;
    s.next_step = step + 1;
    s.carried = std::move(own.carried);
    Stats& stats = s.stats;
    ++stats.planned_steps;
    if (local) ++stats.local_steps;
    if (prefetched) ++stats.prefetched_steps;
    stats.plan_wait_seconds += wait_seconds;
    stats.last_plan_wait_seconds = wait_seconds;
    stats.planner_reachable = !s.offline && reachable;
    if (local) stats.last_error = reason;
    local_steps = stats.local_steps;
    s.changed.SignalAll();  // a prefetch of step + 1 may start now
  }
  const std::string& target = s.options.client.target;
  if (local) {
    const double now = s.options.now_seconds();
    if (now - s.last_warn_seconds >= s.options.warn_interval_seconds) {
      s.options.warn(absl::StrCat("sparsebalance: step ", step,
                                  " runs on the local plan (local-plan steps so far: ", local_steps,
                                  "); the planner at ", target, ": ", reason));
      s.last_warn_seconds = now;
      s.warned_away = true;
    }
    s.away = true;
  } else if (s.away) {
    if (s.warned_away) {
      s.options.warn(
          absl::StrCat("sparsebalance: the planner at ", target, " answers again from step ", step,
                       " on (local-plan steps so far: ", local_steps, "; it learns of them now)"));
    }
    s.away = false;
    s.warned_away = false;
  }
  return *std::move(own.plan);
}

void Balancer::Report(int64_t step, std::vector<MicroBatchTiming> timings, double wait_seconds) {
  State& s = *state_;
  if (s.offline) return;  // no job: nobody to tell
  // Reported before this rank joined: the planner has its first report (a second one, timed
  // again, would be refused as a differing repeat and fail Finish).
  if (step < s.reported_before) return SkipReport(step);
  RankStepReport own;
  own.step = step;
  own.rank = s.options.rank;
  own.micro_batches = std::move(timings);
  own.wait_seconds = wait_seconds;
  std::vector<RankStepReport> reports;
  if (s.options.gather_reports) {
    reports = s.Gather(step, absl::StrCat(kGatheredReport, EncodeRankStepReport(own)));
  } else {
    reports.push_back(std::move(own));
  }
  s.Queue(std::move(reports));
}

void Balancer::SkipReport(int64_t step) {
  State& s = *state_;
  if (s.offline || !s.options.gather_reports) return;
  s.Queue(s.Gather(step, kGatheredNothing));
}

void Balancer::State::HandPlans(const Planned& own, bool prefetched) {
  const std::vector<int>& group = options.plan_group;
  std::vector<std::string> payloads(group.size());
  for (size_t k = 0; k < group.size(); ++k) {
    if (group[k] == options.rank) continue;  // the leader's own: it has it
    std::string& p = payloads[k];
    if (!own.plan.ok()) {
      p = absl::StrCat(std::string(1, kHandedError), static_cast<int>(own.plan.status().code()),
                       ":", own.plan.status().message());
    } else if (!own.encoded.empty()) {
      p = std::string(1, prefetched ? kHandedPrefetched : kHandedPlan) + own.encoded[k];
    } else if (own.plan->local_fallback && !own.why.ok()) {
      p = std::string(1, kHandedLocal) + own.why.ToString();
    } else {
      p = std::string(1, kHandedFetch);
    }
  }
  options.scatter_plans(payloads);
}

Balancer::State::Planned Balancer::State::TakePlan(int64_t step, const std::vector<Sample>& batch) {
  const std::string got = options.scatter_plans({});
  const std::string rest = got.empty() ? std::string() : got.substr(1);
  const std::string leader =
      absl::StrCat("rank ", options.plan_group[0], ", which leads this rank's plan group,");
  Planned planned;
  absl::MutexLock lock(&session_mu);
  switch (got.empty() ? '\0' : got[0]) {
    case kHandedPlan:
    case kHandedPrefetched:
      planned.prefetched = got[0] == kHandedPrefetched;
      planned.plan = session->Adopt(step, batch, rest);
      if (!planned.plan.ok()) {
        planned.plan =
            absl::Status(planned.plan.status().code(),
                         absl::StrCat("scatter_plans: the plan ", leader, " handed over for step ",
                                      step, ": ", planned.plan.status().message()));
      }
      break;
    case kHandedLocal:
      planned.plan = session->LocalPlan(step, batch);
      planned.why = absl::UnavailableError(absl::StrCat(leader, " fell back: ", rest));
      break;
    case kHandedFetch:
      planned.plan = session->Plan(step, batch);
      planned.why = session->fallback_reason();
      break;
    case kHandedError: {
      int code = 0;
      const size_t colon = rest.find(':');
      if (colon == std::string::npos || !absl::SimpleAtoi(rest.substr(0, colon), &code) ||
          code <= 0 || code > static_cast<int>(absl::StatusCode::kUnauthenticated)) {
        code = static_cast<int>(absl::StatusCode::kUnknown);
      }
      planned.plan =
          absl::Status(static_cast<absl::StatusCode>(code),
                       absl::StrCat(leader, " could not plan step ", step, ": ",
                                    colon == std::string::npos ? rest : rest.substr(colon + 1)));
      break;
    }
    default:
      planned.plan = absl::InternalError(
          absl::StrCat("scatter_plans: handed ", got.size(), " bytes for step ", step,
                       " that are not what a Balancer's plan group leader hands over"));
  }
  planned.carried = session->carried();
  NoteSession();
  return planned;
}

std::vector<RankStepReport> Balancer::State::Gather(int64_t step, const std::string& payload) {
  // Every member of the group calls it; only the leader gets the reports back.
  std::vector<RankStepReport> reports;
  const std::vector<std::string> gathered = options.gather_reports(payload);
  for (size_t k = 0; k < gathered.size(); ++k) {
    const std::string& got = gathered[k];
    if (got == kGatheredNothing) continue;
    absl::StatusOr<RankStepReport> report =
        absl::StartsWith(got, kGatheredReport)
            ? DecodeRankStepReport(got.substr(1))
            : absl::InvalidArgumentError("it is not what a Balancer hands gather_reports");
    if (!report.ok()) {
      options.warn(absl::StrCat("sparsebalance: gather_reports: member ", k, "'s report of step ",
                                step, " was dropped: ", report.status().message()));
      continue;
    }
    reports.push_back(*std::move(report));
  }
  return reports;
}

void Balancer::State::Queue(std::vector<RankStepReport> queued) {
  if (queued.empty()) return;
  absl::MutexLock lock(&mu);
  for (RankStepReport& report : queued) reports.push_back(std::move(report));
  while (reports.size() > ReportLimit()) {
    reports.pop_front();
    ++queue_dropped;
  }
  changed.SignalAll();
}

absl::Status Balancer::Finish(double timeout_seconds) {
  State& s = *state_;
  if (s.offline) return absl::OkStatus();
  const absl::Time deadline = absl::Now() + absl::Seconds(std::max(0.0, timeout_seconds));
  absl::Status refused;
  {
    // The queue first: the worker sends it in order.
    absl::MutexLock lock(&s.mu);
    while ((!s.reports.empty() || s.sending > 0 || s.AnyRunning()) &&
           !s.changed.WaitWithDeadline(&s.mu, deadline)) {
    }
    refused = s.refused;
    s.refused = absl::OkStatus();
  }
  while (true) {
    absl::Status flushed;
    size_t reports = 0;
    size_t local_steps = 0;
    {
      absl::MutexLock lock(&s.session_mu);
      flushed = s.session->Flush();
      reports = s.session->buffered_reports();
      local_steps = s.session->unsent_local_steps();
      s.NoteSession();
    }
    if (!flushed.ok() && !IsTransient(flushed) && refused.ok()) refused = flushed;
    size_t queued = 0;
    {
      absl::MutexLock lock(&s.mu);
      queued = s.reports.size() + s.sending;
    }
    if (reports == 0 && local_steps == 0 && queued == 0) return refused;
    if (absl::Now() >= deadline) {
      return absl::UnavailableError(absl::StrCat(
          "Finish: ", reports + queued, " reports and ", local_steps,
          " locally planned steps not delivered to the planner at ", s.options.client.target,
          " after ", timeout_seconds, " s: ",
          IsTransient(flushed) ? flushed.ToString()
                               : std::string("waiting for rank 0 to resubmit its local steps"),
          "; they are kept: call Finish again"));
    }
    absl::SleepFor(std::min(absl::Milliseconds(200), deadline - absl::Now()));
  }
}

void Balancer::Resume(int64_t next_step, std::vector<Sample> carried) {
  State& s = *state_;
  {
    absl::MutexLock lock(&s.mu);
    while (s.AnyRunning()) s.changed.Wait(&s.mu);
    s.prefetches.clear();
    s.next_step = next_step;
    s.last_final_step = next_step - 1;
    s.carried = carried;
  }
  absl::MutexLock lock(&s.session_mu);
  s.session->Restore(next_step, std::move(carried));
}

const JobHandle& Balancer::job() const { return state_->job; }
const PlannerConfig& Balancer::config() const { return state_->config; }

int64_t Balancer::next_step() const {
  absl::MutexLock lock(&state_->mu);
  return state_->next_step;
}

std::vector<Sample> Balancer::carried() const {
  absl::MutexLock lock(&state_->mu);
  return state_->carried;
}

Balancer::Stats Balancer::stats() const {
  absl::MutexLock lock(&state_->mu);
  Stats stats = state_->stats;
  stats.buffered_reports = static_cast<int64_t>(state_->reports.size()) + state_->session_buffered;
  stats.dropped_reports = state_->queue_dropped + state_->session_dropped;
  return stats;
}

}  // namespace sparsebalance
