// PlannerClient, TrainerSession and Balancer for Python. Every call that talks to the planner
// releases the GIL (other Python threads, e.g. data loading, run meanwhile); errors raise
// PlannerError with the gRPC code. Reports are the exception: while the planner is unreachable
// or busy they are kept (bounded) and sent later, so TrainerSession.report returns False instead of
// raising (and Balancer.finish too). Balancer's collectives and warn are Python callables that
// C++ calls, holding the GIL for the call, from the thread that called start/plan.
#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "client/balancer.h"
#include "client/planner_client.h"
#include "client/python/bindings.h"
#include "client/python/record.h"
#include "client/trainer_session.h"

namespace sparsebalance {
namespace python {
namespace {

using Release = py::call_guard<py::gil_scoped_release>;

// Report/Flush: true when everything buffered went out, false when the planner is unreachable
// or busy (IsTransient: kept for later); other errors (a report the planner refused for good)
// raise.
bool Delivered(const absl::Status& status, const TrainerSession& session) {
  if (!status.ok() && !IsTransient(status)) throw StatusError(status, ErrorKind::kPlanner);
  return status.ok() && session.buffered_reports() == 0;
}

// Deletes a Balancer with the GIL released: its destructor waits for the background thread's
// current call to the planner (up to plan_timeout_seconds), during which Python must go on.
struct DeleteWithoutGil {
  void operator()(Balancer* balancer) const {
    if (PyGILState_Check() != 0) {
      py::gil_scoped_release release;
      delete balancer;
    } else {
      delete balancer;
    }
  }
};
using BalancerHolder = std::unique_ptr<Balancer, DeleteWithoutGil>;

}  // namespace

namespace {
void BindBalancer(py::module_& m);
}  // namespace

void BindClient(py::module_& m) {
  Record<ClientOptions>(m, "ClientOptions", "How to reach sb-planner and which job to speak for.")
      .Field("target", &ClientOptions::target, "host:port of sb-planner")
      .Field("job_id", &ClientOptions::job_id, "the job (CreateJob's answer)")
      .Field("token", &ClientOptions::token, "the job token (CreateJob's answer)", true)
      .Field("admin_token", &ClientOptions::admin_token,
             "for create/delete when the planner has one", true)
      .Field("call_timeout_seconds", &ClientOptions::call_timeout_seconds,
             "deadline of every call but get_rank_plan (finite, > 0)")
      .Field("plan_timeout_seconds", &ClientOptions::plan_timeout_seconds,
             "how long get_rank_plan waits for the step's plan (finite, > 0)")
      .Field("root_certs_pem", &ClientOptions::root_certs_pem, "PEM roots: the channel is TLS")
      .Field("cert_chain_pem", &ClientOptions::cert_chain_pem, "client certificate (mutual TLS)")
      .Field("private_key_pem", &ClientOptions::private_key_pem, "its key", true)
      .Field("host_name", &ClientOptions::host_name,
             "this worker's host name for JoinJob (GetJob's slowest ranks); empty: the "
             "machine's")
      .Field("max_buffered_reports", &ClientOptions::max_buffered_reports,
             "reports kept while the planner is away")
      .Field("report_stream", &ClientOptions::report_stream,
             "report on one ReportSteps stream instead of unary ReportStep calls (default False)")
      .Done();

  Record<JobHandle>(m, "JobHandle", "A job as create_job made it.")
      .Field("job_id", &JobHandle::job_id, "the job id")
      .Field("token", &JobHandle::token, "the job token: every rank needs it", true)
      .Field("config", &JobHandle::config, "PlannerConfig as the planner stored it")
      .Field("history_steps", &JobHandle::history_steps, "steps of history kept")
      .Done();

  Record<RankStepPlan>(m, "RankStepPlan", "One rank's part of a step plan.")
      .Field("step", &RankStepPlan::step, "training step")
      .Field("rank", &RankStepPlan::rank, "the rank")
      .Field("micro_batches", &RankStepPlan::micro_batches,
             "list of MicroBatchPlan (empty ones included: skip them)")
      .Field("predicted_seconds", &RankStepPlan::predicted_seconds, "this rank's predicted time")
      .Field("predicted_makespan_seconds", &RankStepPlan::predicted_makespan_seconds,
             "the slowest rank's")
      .Field("local_fallback", &RankStepPlan::local_fallback,
             "computed on this rank (planner unreachable), not by the planner")
      .Field("deferred_ids", &RankStepPlan::deferred_ids,
             "the step's deferred samples (overflow=defer), the same on every rank: they belong "
             "in the next step's batch")
      .Done();

  py::class_<PlannerClient>(m, "PlannerClient", R"(A connection to sb-planner (thread-safe).

    client = PlannerClient(ClientOptions(target="planner:50151"))
    job = client.create_job("run-1", PlannerConfig(ranks=8))   # client now speaks for the job
    config, next_step, rank_next_step = client.join_job(rank)

Every call has a deadline; UNAVAILABLE is retried with backoff. Errors raise PlannerError.)")
      .def(py::init([](const ClientOptions& options) {
             return ValueOrThrow(PlannerClient::Connect(options), ErrorKind::kPlanner);
           }),
           py::arg("options"))
      .def_property_readonly("options", &PlannerClient::options, "ClientOptions (a copy)")
      .def(
          "create_job",
          [](PlannerClient& c, const std::string& name, const PlannerConfig& config,
             int history_steps) {
            return ValueOrThrow(c.CreateJob(name, config, history_steps), ErrorKind::kPlanner);
          },
          py::arg("name"), py::arg("config"), py::arg("history_steps") = 0, Release(),
          "Creates a job; afterwards this client speaks for it (its id and token are set).")
      .def(
          "delete_job",
          [](PlannerClient& c, const std::string& job_id) {
            ThrowIfError(c.DeleteJob(job_id), ErrorKind::kPlanner);
          },
          py::arg("job_id"), Release(),
          "Deletes a job and its state: with admin_token when the options hold one, else with "
          "the job token (a job deletes itself).")
      .def(
          "join_job",
          [](PlannerClient& c, int rank) {
            int64_t rank_next_step = 0;
            std::pair<PlannerConfig, int64_t> joined =
                ValueOrThrow(c.JoinJob(rank, &rank_next_step), ErrorKind::kPlanner);
            return std::make_tuple(joined.first, joined.second, rank_next_step);
          },
          py::arg("rank"), Release(),
          "Announces `rank`. Returns (config, next_step, rank_next_step): the job's config, the "
          "next step the planner will plan, and the first kept step this rank has not reported "
          "(where a restarted rank resumes).")
      .def(
          "upload_profile",
          [](PlannerClient& c, const std::string& text) {
            return ValueOrThrow(c.UploadProfile(text), ErrorKind::kPlanner);
          },
          py::arg("profile_text"), Release(),
          "Replaces the job's cost prior with a profile table (sb-profile's output); returns the "
          "device it names.")
      .def(
          "submit_batch",
          [](PlannerClient& c, int64_t step, const std::vector<Sample>& batch,
             bool planned_locally) {
            return ValueOrThrow(c.SubmitBatch(step, batch, planned_locally), ErrorKind::kPlanner);
          },
          py::arg("step"), py::arg("batch"), py::arg("planned_locally") = false, Release(),
          "Submits a step's global batch (coordinator rank); returns the deferred sample ids.")
      .def(
          "get_rank_plan",
          [](PlannerClient& c, int64_t step, int rank, int world_size, int block_size) {
            return ValueOrThrow(c.GetRankPlan(step, rank, world_size, block_size),
                                ErrorKind::kPlanner);
          },
          py::arg("step"), py::arg("rank"), py::arg("world_size") = 0, py::arg("block_size") = 0,
          Release(),
          "Waits (up to plan_timeout_seconds) for the step's plan; returns this rank's part. "
          "Given the job's world_size and block_size, shards of split documents are checked "
          "against them too.")
      .def(
          "report_step",
          [](PlannerClient& c, int64_t step, int rank,
             const std::vector<MicroBatchTiming>& micro_batches, double wait_seconds,
             bool planned_locally) {
            return ValueOrThrow(
                c.ReportStep(step, rank, micro_batches, wait_seconds, planned_locally),
                ErrorKind::kPlanner);
          },
          py::arg("step"), py::arg("rank"), py::arg("micro_batches"), py::arg("wait_seconds"),
          py::arg("planned_locally") = false, Release(),
          "Reports one rank's timings; returns True when the planner had them already.")
      .def(
          "get_rank_plans",
          [](PlannerClient& c, int64_t step, const std::vector<int>& ranks, int world_size,
             int block_size) {
            return ValueOrThrow(c.GetRankPlans(step, ranks, world_size, block_size),
                                ErrorKind::kPlanner);
          },
          py::arg("step"), py::arg("ranks"), py::arg("world_size") = 0, py::arg("block_size") = 0,
          Release(),
          "The plans of several ranks of the step in one GetRankPlans call (e.g. a node "
          "leader's), in `ranks`' order, each as get_rank_plan would return it.")
      .def(
          "report_step_batch",
          [](PlannerClient& c, const std::vector<RankStepReport>& reports) {
            return ValueOrThrow(c.ReportStepBatch(reports), ErrorKind::kPlanner);
          },
          py::arg("reports"), Release(),
          "Several RankStepReport in one ReportStepBatch call (e.g. a node's, through its "
          "leader); returns per report whether the planner had it already. The first report "
          "refused raises, naming reports[k]; the ones before it were accepted.");

  py::class_<TrainerSession>(m, "TrainerSession", R"(The per-rank step helper (one per rank).

    session = TrainerSession(client, rank, coordinator=(rank == 0), config=config)
    plan = session.plan(step, batch)        # never stalls: local plan when the planner is away
    if any_rank_fell_back:                  # all-reduce plan.local_fallback across ranks
        plan = session.local_plan(step, batch)
    ... run plan.micro_batches ...
    session.report(step, timings, wait_seconds)

Not thread-safe: call it from one thread. Keeps `client` alive.)")
      // None for the client would be a null pointer: a TypeError here instead.
      .def(py::init<PlannerClient*, int, bool, PlannerConfig>(), py::arg("client").none(false),
           py::arg("rank"), py::arg("coordinator"), py::arg("config"), py::keep_alive<1, 2>())
      .def(
          "plan",
          [](TrainerSession& s, int64_t step, const std::vector<Sample>& batch) {
            return ValueOrThrow(s.Plan(step, batch), ErrorKind::kPlanner);
          },
          py::arg("step"), py::arg("batch"), Release(),
          "This rank's plan of `step` (the coordinator submits `batch`; every rank passes the "
          "same global batch). Falls back to the local plan (plan.local_fallback) on every "
          "error the trainer's input did not cause: the planner unreachable, busy or failing. "
          "Errors of the input (INVALID_ARGUMENT, ALREADY_EXISTS, NOT_FOUND, UNAUTHENTICATED, "
          "PERMISSION_DENIED) and a plan that does not fit the batch (FAILED_PRECONDITION) raise "
          "PlannerError.")
      .def(
          "local_plan",
          [](TrainerSession& s, int64_t step, const std::vector<Sample>& batch) {
            return ValueOrThrow(s.LocalPlan(step, batch), ErrorKind::kPlanner);
          },
          py::arg("step"), py::arg("batch"), Release(),
          "The locally computed plan of `step`: what every falling-back rank uses.")
      .def(
          "report",
          [](TrainerSession& s, int64_t step, const std::vector<MicroBatchTiming>& micro_batches,
             double wait_seconds) {
            absl::Status status =
                WithoutGil([&] { return s.Report(step, micro_batches, wait_seconds); });
            return Delivered(status, s);
          },
          py::arg("step"), py::arg("micro_batches"), py::arg("wait_seconds"),
          "Reports this rank's timings. True: delivered (with anything buffered before); False: "
          "the planner is unreachable or busy and the report is kept for later. Raises "
          "PlannerError when the planner refused a report for good (it is dropped; training may "
          "go on).")
      .def(
          "flush",
          [](TrainerSession& s) {
            absl::Status status = WithoutGil([&] { return s.Flush(); });
            return Delivered(status, s);
          },
          "Sends what is buffered (e.g. at the end of training); same answers as report().")
      .def_property_readonly("buffered_reports", &TrainerSession::buffered_reports)
      .def_property_readonly("unsent_local_steps", &TrainerSession::unsent_local_steps)
      .def_property_readonly("dropped_reports", &TrainerSession::dropped_reports)
      .def_property_readonly("carried", &TrainerSession::carried,
                             "Samples the latest planned step deferred (overflow=defer): they go "
                             "ahead of the next step's batch");

  BindBalancer(m);

  m.def(
      "is_unreachable",
      [](int code) { return IsUnreachable(absl::Status(static_cast<absl::StatusCode>(code), "")); },
      py::arg("code"), "True for the gRPC codes that mean 'the planner is not reachable now'.");
}

namespace {

// A Python object that a std::function keeps: released with the GIL held, whichever thread
// drops the last copy.
struct GilHeld {
  py::object object;
  ~GilHeld() {
    try {
      py::gil_scoped_acquire gil;
      object = py::object();
    } catch (...) {  // no interpreter left to take the GIL from: nothing to release
    }
  }
};

// BalancerOptions.gather_reports from Python: callable(bytes) -> list of bytes (or None on the
// members that are not the leader). Reports are bytes, not text: pybind11's own conversion
// would decode them as UTF-8.
void SetGatherReports(BalancerOptions& options, py::handle value) {
  if (value.is_none()) {
    options.gather_reports = nullptr;
    return;
  }
  if (!PyCallable_Check(value.ptr())) {
    throw py::type_error("gather_reports: " + py::repr(value).cast<std::string>() +
                         " is not callable (callable(bytes) -> list of bytes, or None)");
  }
  auto held = std::make_shared<GilHeld>();
  held->object = py::reinterpret_borrow<py::object>(value);
  options.gather_reports = [held](const std::string& report) {
    py::gil_scoped_acquire gil;
    py::object out = held->object(py::bytes(report));
    std::vector<std::string> gathered;
    if (out.is_none()) return gathered;
    for (py::handle item : out) {
      if (!py::isinstance<py::bytes>(item)) {
        throw py::type_error("gather_reports: returned " + py::repr(item).cast<std::string>() +
                             " among the reports; each must be the bytes a member passed");
      }
      gathered.push_back(item.cast<std::string>());
    }
    return gathered;
  };
}

// BalancerOptions.scatter_plans from Python: callable(list of bytes) -> bytes (the leader
// passes one payload per member of plan_group, the others an empty list; each gets its own).
// Plans are bytes, as reports are.
void SetScatterPlans(BalancerOptions& options, py::handle value) {
  if (value.is_none()) {
    options.scatter_plans = nullptr;
    return;
  }
  if (!PyCallable_Check(value.ptr())) {
    throw py::type_error("scatter_plans: " + py::repr(value).cast<std::string>() +
                         " is not callable (callable(list of bytes) -> bytes, or None)");
  }
  auto held = std::make_shared<GilHeld>();
  held->object = py::reinterpret_borrow<py::object>(value);
  options.scatter_plans = [held](const std::vector<std::string>& payloads) {
    py::gil_scoped_acquire gil;
    py::list in;
    for (const std::string& p : payloads) in.append(py::bytes(p));
    py::object out = held->object(in);
    if (!py::isinstance<py::bytes>(out)) {
      throw py::type_error("scatter_plans: returned " + py::repr(out).cast<std::string>() +
                           "; it must be the bytes the group's leader passed for this member");
    }
    return out.cast<std::string>();
  };
}

void BindBalancer(py::module_& m) {
  Record<BalancerOptions>(m, "BalancerOptions", R"(How a Balancer starts (see Balancer.start).

Fields: client (ClientOptions: target, timeouts, admin_token, and the job's token to resume), rank,
world, job_id (resume/join this job; empty: rank 0 creates one from `config`), job_name, config
(PlannerConfig of a new job, and of the local plans when offline), allow_offline_start, prefetch,
runs_shards, warn_interval_seconds, and callables that C++ calls from the thread that calls
start/plan/report (with the GIL): any_rank(bool) -> bool (True when any rank passed True: an
all-reduce), share_job(JobHandle) -> JobHandle (rank 0's handle to every rank: a broadcast),
warn(str) (default: one line on stderr), optionally gather_reports(bytes) -> list of bytes (a
gather to a node's leader, which then sends the node's reports in one call), and optionally
plan_group (this rank's group, leader first) with scatter_plans(list of bytes) -> bytes (a scatter
from that leader, which fetches the group's plans in one call).
The collectives may be None for world 1.)")
      .Field("client", &BalancerOptions::client,
             "ClientOptions: target and timeouts (job_id and token are filled by start)")
      .Field("rank", &BalancerOptions::rank, "this rank")
      .Field("world", &BalancerOptions::world, "number of ranks")
      .Field("job_id", &BalancerOptions::job_id,
             "resume/join this job (its token in client.token); empty: rank 0 creates one")
      .Field("job_name", &BalancerOptions::job_name, "the name of a new job")
      .Field("config", &BalancerOptions::config,
             "PlannerConfig of a new job; also the local plans' config when offline")
      .Field("allow_offline_start", &BalancerOptions::allow_offline_start,
             "planner unreachable at start: train on local plans instead of raising")
      .Field("prefetch", &BalancerOptions::prefetch,
             "plan step N+1 in the background while step N trains")
      .Field("runs_shards", &BalancerOptions::runs_shards,
             "the trainer runs shards of split documents; False: plan() raises "
             "FAILED_PRECONDITION on every rank for a step whose plan holds one")
      .Field("warn_interval_seconds", &BalancerOptions::warn_interval_seconds,
             "at most one fallback warning per this many seconds")
      .Field("any_rank", &BalancerOptions::any_rank,
             "callable(bool) -> bool: True when any rank passed True (None: world 1)")
      .Field("share_job", &BalancerOptions::share_job,
             "callable(JobHandle) -> JobHandle: rank 0's handle on every rank (None: world 1)")
      .Field("warn", &BalancerOptions::warn, "callable(str): a warning line (None: stderr)")
      .Field("now_seconds", &BalancerOptions::now_seconds,
             "callable() -> float: the clock of warn_interval_seconds (None: a steady clock)")
      .Property(
          "gather_reports",
          [](const BalancerOptions& options) -> py::object {
            if (!options.gather_reports) return py::none();
            std::function<std::vector<std::string>(const std::string&)> gather =
                options.gather_reports;
            return py::cpp_function([gather](const py::bytes& report) {
              py::list out;
              for (const std::string& r : gather(std::string(report))) out.append(py::bytes(r));
              return out;
            });
          },
          SetGatherReports,
          "callable(bytes) -> list of bytes or None: a collective over this rank's node (or any "
          "group) that hands the leader every member's encoded report, its own included, and the "
          "others nothing; the leader then sends the group's reports of a step in one "
          "ReportStepBatch call (None: each rank sends its own)")
      .Field("plan_group", &BalancerOptions::plan_group,
             "list of int: this rank's plan group, its leader first (with scatter_plans)")
      .Property(
          "scatter_plans",
          [](const BalancerOptions& options) -> py::object {
            if (!options.scatter_plans) return py::none();
            std::function<std::string(const std::vector<std::string>&)> scatter =
                options.scatter_plans;
            return py::cpp_function([scatter](const std::vector<py::bytes>& payloads) {
              std::vector<std::string> in(payloads.begin(), payloads.end());
              return py::bytes(scatter(in));
            });
          },
          SetScatterPlans,
          "callable(list of bytes) -> bytes or None: a collective over plan_group in which the "
          "leader passes one payload per member (in plan_group's order) and the others an empty "
          "list, and each member gets its own; the leader then fetches the group's plans of a "
          "step in one GetRankPlans call and hands them over (None: each rank fetches its own)")
      .Done();

  Record<Balancer::Stats>(m, "BalancerStats", "What a Balancer did so far (Balancer.stats).")
      .Field("planned_steps", &Balancer::Stats::planned_steps, "steps whose plan plan() returned")
      .Field("local_steps", &Balancer::Stats::local_steps, "of them, run on the local plan")
      .Field("prefetched_steps", &Balancer::Stats::prefetched_steps,
             "of them, planned in the background by prefetch()")
      .Field("plan_wait_seconds", &Balancer::Stats::plan_wait_seconds,
             "total time plan() blocked waiting for a plan")
      .Field("last_plan_wait_seconds", &Balancer::Stats::last_plan_wait_seconds,
             "the latest step's")
      .Field("buffered_reports", &Balancer::Stats::buffered_reports,
             "reports queued or kept while the planner is away")
      .Field("dropped_reports", &Balancer::Stats::dropped_reports,
             "reports given up (refused for good, or over the buffer's bound)")
      .Field("planner_reachable", &Balancer::Stats::planner_reachable,
             "False while the latest step fell back because the planner was away")
      .Field("last_error", &Balancer::Stats::last_error, "why the latest local step fell back")
      .Done();

  py::class_<Balancer, BalancerHolder>(m, "Balancer", R"(One rank's whole SparseBalance flow.

    b = Balancer.start(BalancerOptions(client=ClientOptions(target="planner:50151"),
                                       config=config, rank=rank, world=world,
                                       any_rank=all_reduce_or, share_job=broadcast_from_0))
    for step in range(b.next_step, steps):
        b.prefetch(step + 1, batch_of(step + 1))   # planned while this step trains
        plan = b.plan(step, batch_of(step))        # the same global batch on every rank
        ... run plan.micro_batches ...
        b.report(step, timings, wait_seconds)      # sent in the background
    b.finish()                                     # False: the planner is still away

Every rank calls plan() for every step in order; plan() calls any_rank once. Thread-safe, but
meant for one training thread; a background thread plans prefetched steps and sends reports.)")
      .def_static(
          "start",
          [](const BalancerOptions& options) {
            BalancerOptions copy = options;  // copies the callables with the GIL held
            std::unique_ptr<Balancer> balancer = ValueOrThrow(
                WithoutGil([&] { return Balancer::Start(std::move(copy)); }), ErrorKind::kPlanner);
            return BalancerHolder(balancer.release());
          },
          py::arg("options"),
          "Creates (rank 0, no job_id) or joins the job, shares it with every rank (share_job) "
          "and joins it on every rank. Raises PlannerError: UNAVAILABLE naming the target when "
          "the planner is unreachable (unless allow_offline_start), or the planner's error.")
      .def(
          "prefetch",
          [](Balancer& b, int64_t step, std::vector<Sample> batch) {
            b.Prefetch(step, std::move(batch));
          },
          py::arg("step"), py::arg("batch"), Release(),
          "Plans `step` in the background once the step before is final; `batch` must be what "
          "plan(step, ...) will get. Does nothing when options.prefetch is False.")
      .def(
          "plan",
          [](Balancer& b, int64_t step, const std::vector<Sample>& batch) {
            return ValueOrThrow(WithoutGil([&] { return b.Plan(step, batch); }),
                                ErrorKind::kPlanner);
          },
          py::arg("step"), py::arg("batch"),
          "This rank's RankStepPlan of `step` (the prefetched one, or planned now); if any rank "
          "fell back (one any_rank call), the local plan on every rank (plan.local_fallback). "
          "Raises PlannerError for errors other than the planner being away.")
      .def(
          "report",
          [](Balancer& b, int64_t step, std::vector<MicroBatchTiming> timings,
             double wait_seconds) { b.Report(step, std::move(timings), wait_seconds); },
          py::arg("step"), py::arg("timings"), py::arg("wait_seconds"), Release(),
          "Queues this rank's MicroBatchTiming list of `step`; sent in the background, in order. "
          "With options.gather_reports, first gathers it to the group's leader (only the leader "
          "queues the group's reports).")
      .def("skip_report", &Balancer::SkipReport, py::arg("step"), Release(),
           "With options.gather_reports: takes part in the gather of `step` without a report "
           "(so that the group's other reports still go); without it, nothing.")
      .def(
          "finish",
          [](Balancer& b, double timeout_seconds) {
            absl::Status status = WithoutGil([&] { return b.Finish(timeout_seconds); });
            if (!status.ok() && status.code() != absl::StatusCode::kUnavailable) {
              throw StatusError(status, ErrorKind::kPlanner);
            }
            return status.ok();
          },
          py::arg("timeout_seconds") = 10.0,
          "Sends everything queued, retrying for up to timeout_seconds. True: delivered (or "
          "offline: nothing to send); False: the planner is still away (stats.buffered_reports "
          "says how much is kept; call it again later). Raises PlannerError when the planner "
          "refused a report for good (it is dropped).")
      .def(
          "resume",
          [](Balancer& b, int64_t next_step, std::vector<Sample> carried) {
            b.Resume(next_step, std::move(carried));
          },
          py::arg("next_step"), py::arg("carried"), Release(),
          "From a checkpoint: the step to run next and the samples carried into it (`carried` "
          "when the checkpoint was taken).")
      .def_property_readonly(
          "job", [](const Balancer& b) { return b.job(); },
          "JobHandle: job id and token ('' when offline)")
      .def_property_readonly(
          "config", [](const Balancer& b) { return b.config(); },
          "PlannerConfig: the job's (from join) or options.config offline")
      .def_property_readonly("next_step", &Balancer::next_step,
                             "the step to run next: where this rank resumes at start (0 for a "
                             "new job), then after the latest planned step")
      .def_property_readonly("carried", &Balancer::carried,
                             "list of Sample: deferred by the latest planned step, waiting for "
                             "the next (save it with next_step in a checkpoint)")
      .def_property_readonly("stats", &Balancer::stats, "BalancerStats");
}

}  // namespace

}  // namespace python
}  // namespace sparsebalance
