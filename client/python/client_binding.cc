// PlannerClient and TrainerSession for Python. Every call that talks to the planner releases the
// GIL (other Python threads, e.g. data loading, run meanwhile); errors raise PlannerError with
// the gRPC code. Reports are the exception: while the planner is unreachable they are kept
// (bounded) and sent later, so TrainerSession.report returns False instead of raising.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "client/planner_client.h"
#include "client/python/bindings.h"
#include "client/python/record.h"
#include "client/trainer_session.h"

namespace sparsebalance {
namespace python {
namespace {

using Release = py::call_guard<py::gil_scoped_release>;

// Report/Flush: true when everything buffered went out, false when the planner is unreachable
// (kept for later); other errors (a report the planner refused for good) raise.
bool Delivered(const absl::Status& status, const TrainerSession& session) {
  if (!status.ok() && !IsUnreachable(status)) throw StatusError(status, ErrorKind::kPlanner);
  return status.ok() && session.buffered_reports() == 0;
}

}  // namespace

void BindClient(py::module_& m) {
  Record<ClientOptions>(m, "ClientOptions", "How to reach sb-planner and which job to speak for.")
      .Field("target", &ClientOptions::target, "host:port of sb-planner")
      .Field("job_id", &ClientOptions::job_id, "the job (CreateJob's answer)")
      .Field("token", &ClientOptions::token, "the job token (CreateJob's answer)", true)
      .Field("admin_token", &ClientOptions::admin_token,
             "for create/delete when the planner has one", true)
      .Field("call_timeout_seconds", &ClientOptions::call_timeout_seconds,
             "deadline of every call but get_rank_plan")
      .Field("plan_timeout_seconds", &ClientOptions::plan_timeout_seconds,
             "how long get_rank_plan waits for the step's plan")
      .Field("root_certs_pem", &ClientOptions::root_certs_pem, "PEM roots: the channel is TLS")
      .Field("cert_chain_pem", &ClientOptions::cert_chain_pem, "client certificate (mutual TLS)")
      .Field("private_key_pem", &ClientOptions::private_key_pem, "its key", true)
      .Field("max_buffered_reports", &ClientOptions::max_buffered_reports,
             "reports kept while the planner is away")
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
          py::arg("job_id"), Release(), "Deletes a job and its state.")
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
          [](PlannerClient& c, int64_t step, int rank) {
            return ValueOrThrow(c.GetRankPlan(step, rank), ErrorKind::kPlanner);
          },
          py::arg("step"), py::arg("rank"), Release(),
          "Waits (up to plan_timeout_seconds) for the step's plan; returns this rank's part.")
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
          "Reports one rank's timings; returns True when the planner had them already.");

  py::class_<TrainerSession>(m, "TrainerSession", R"(The per-rank step helper (one per rank).

    session = TrainerSession(client, rank, coordinator=(rank == 0), config=config)
    plan = session.plan(step, batch)        # never stalls: local plan when the planner is away
    if any_rank_fell_back:                  # all-reduce plan.local_fallback across ranks
        plan = session.local_plan(step, batch)
    ... run plan.micro_batches ...
    session.report(step, timings, wait_seconds)

Not thread-safe: call it from one thread. Keeps `client` alive.)")
      .def(py::init<PlannerClient*, int, bool, PlannerConfig>(), py::arg("client"), py::arg("rank"),
           py::arg("coordinator"), py::arg("config"), py::keep_alive<1, 2>())
      .def(
          "plan",
          [](TrainerSession& s, int64_t step, const std::vector<Sample>& batch) {
            return ValueOrThrow(s.Plan(step, batch), ErrorKind::kPlanner);
          },
          py::arg("step"), py::arg("batch"), Release(),
          "This rank's plan of `step` (the coordinator submits `batch`; every rank passes the "
          "same global batch). Falls back to the local plan when the planner is unreachable "
          "(plan.local_fallback); other errors raise PlannerError.")
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
          "the planner is unreachable and the report is kept for later. Raises PlannerError when "
          "the planner refused a report for good (it is dropped; training may go on).")
      .def(
          "flush",
          [](TrainerSession& s) {
            absl::Status status = WithoutGil([&] { return s.Flush(); });
            return Delivered(status, s);
          },
          "Sends what is buffered (e.g. at the end of training); same answers as report().")
      .def_property_readonly("buffered_reports", &TrainerSession::buffered_reports)
      .def_property_readonly("unsent_local_steps", &TrainerSession::unsent_local_steps)
      .def_property_readonly("dropped_reports", &TrainerSession::dropped_reports);

  m.def(
      "is_unreachable",
      [](int code) { return IsUnreachable(absl::Status(static_cast<absl::StatusCode>(code), "")); },
      py::arg("code"), "True for the gRPC codes that mean 'the planner is not reachable now'.");
}

}  // namespace python
}  // namespace sparsebalance
