// libFuzzer target for whole RPC sequences: the input is a list of operations
// (registry_ops.h) on a JobRegistry backed by a real PlanStore in a temporary directory, with
// "restart" (destroy both, reopen, Restore()) among them. Requests go through the same
// conversions as sb-planner's adapters (ConfigFromProto, SamplesFromProto, TimingFromProto).
// Aborts (besides any sanitizer report) when
//  - a refusal has an empty message;
//  - a refused SubmitBatch or ReportStep changed the plan of its step;
//  - a plan acknowledged before (by SubmitBatch, or GetPlan after a local switch) is not
//    served identically later, in particular after a restart;
//  - after a restart a job that existed and was not deleted is missing (unless the store
//    reports it failed or quarantined), or a deleted job is back.
// Built with AddressSanitizer and UndefinedBehaviorSanitizer by scripts/fuzz.sh; seeds in
// tests/fuzz/corpus/registry/ (make_registry_corpus.cc writes them).
#include <unistd.h>

#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "planner/plan_threads.h"
#include "planner/planner.h"
#include "proto/wire.h"
#include "server/job_registry.h"
#include "server/plan_store.h"
#include "tests/fuzz/registry_ops.h"

namespace sparsebalance {
namespace fuzz {
namespace {

// Small limits keep each input fast: a fuzz input is many RPCs, not one large one.
WireLimits FuzzLimits() {
  WireLimits limits;
  limits.max_samples = 64;
  limits.max_segments = 16;
  limits.max_world_size = 16;
  limits.max_history_steps = 8;
  return limits;
}
constexpr int kMaxJobs = 6;
constexpr int kMaxOps = 64;

// ---------------------------------------------------------------------------------------------
// Adapter: every use of the JobRegistry / PlanStore API is in this section, so that when
// server/ changes (the store's RetireJob/Quarantine/LoadAll struct) only this part moves.
// ---------------------------------------------------------------------------------------------

struct Server {
  std::unique_ptr<PlanStore> store;
  std::unique_ptr<JobRegistry> registry;
};

// Deterministic ids and tokens, never repeated within a process (a deleted job's id is never
// handed out again, so "a deleted job came back" cannot be a new job with its id).
std::string CountingHex(int n) {
  static uint64_t counter = 0;
  std::string out = absl::StrFormat("%016x", ++counter);
  while (static_cast<int>(out.size()) < n) out += out;
  return out.substr(out.size() - n);
}

// Opens the store in `dir` and a registry on it, and restores it. `failed` receives the jobs
// Restore quarantined (files that did not load): those may be missing after a restart. The
// harness never damages files, so with REGISTRY_FUZZER_STRICT=1 a quarantined job is a
// violation too (the registry wrote state it cannot read back).
absl::Status OpenServer(const std::string& dir, Server* server, std::set<std::string>* failed) {
  failed->clear();
  absl::StatusOr<std::unique_ptr<PlanStore>> store = PlanStore::Open(dir, /*fsync_reports=*/false);
  if (!store.ok()) return store.status();
  server->store = *std::move(store);
  JobRegistry::Options options;
  options.limits = FuzzLimits();
  options.max_jobs = kMaxJobs;
  options.store = server->store.get();
  // Planning threads, as sb-planner has them: a restart restores each job's steps on them
  // (JobRegistry::Restore), and large enough steps plan on them.
  static PlanThreads threads(2);
  options.plan_threads = &threads;
  server->registry = std::make_unique<JobRegistry>(options, CountingHex);
  if (absl::Status s = server->registry->Restore(); !s.ok()) return s;
  for (const JobView& job : server->registry->failed_jobs()) {
    if (std::getenv("REGISTRY_FUZZER_STRICT") != nullptr) {
      return absl::DataLossError(
          absl::StrCat("job ", job.job_id, " was quarantined on restore: ", job.failure));
    }
    failed->insert(job.job_id);
  }
  return absl::OkStatus();
}

void CloseServer(Server* server) {
  server->registry.reset();  // first: it holds a pointer to the store
  server->store.reset();
}

// The job's next step, or nullopt-like -1 when it does not exist.
int64_t NextStep(const Server& server, const std::string& id) {
  absl::StatusOr<JobView> view = server.registry->GetJob(id);
  return view.ok() ? view->next_step : -1;
}

// The text of a plan as served, for exact comparison (CanonicalPlanText and the local mark).
std::string PlanText(const StepPlan& plan) {
  return absl::StrCat(CanonicalPlanText(plan), "local ", plan.planned_locally ? 1 : 0, "\n");
}

// What GetPlan serves for (job, step) at rank 0: the plan's text, "" when it is not ready, or
// the refusal.
absl::StatusOr<std::string> ServedPlan(const Server& server, const std::string& id, int64_t step) {
  bool ready = false;
  absl::StatusOr<std::shared_ptr<const StepPlan>> plan =
      server.registry->GetPlan(id, step, /*rank=*/0, &ready);
  if (!plan.ok()) return plan.status();
  if (!ready || *plan == nullptr) return std::string();
  return PlanText(**plan);
}

// ---------------------------------------------------------------------------------------------
// The interpreter.
// ---------------------------------------------------------------------------------------------

// Reads fields front to back; past the end everything reads as zero.
class Reader {
 public:
  Reader(const uint8_t* data, size_t size) : data_(data), size_(size) {}
  bool done() const { return at_ >= size_; }
  uint8_t U8() { return at_ < size_ ? data_[at_++] : 0; }
  uint64_t Le(int bytes) {
    uint64_t v = 0;
    for (int i = 0; i < bytes; ++i) v |= static_cast<uint64_t>(U8()) << (8 * i);
    return v;
  }
  int32_t I32() { return static_cast<int32_t>(static_cast<uint32_t>(Le(4))); }
  int64_t I64() { return static_cast<int64_t>(Le(8)); }
  std::string Blob() {
    size_t n = static_cast<size_t>(Le(2));
    if (n > size_ - std::min(at_, size_)) n = size_ - std::min(at_, size_);
    std::string out(reinterpret_cast<const char*>(data_ + at_), n);
    at_ += n;
    return out;
  }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t at_ = 0;
};

class Harness {
 public:
  explicit Harness(std::string dir) : dir_(std::move(dir)) {}
  ~Harness() {
    CloseServer(&server_);
    std::error_code ignored;
    std::filesystem::remove_all(dir_, ignored);
  }

  void Run(const uint8_t* data, size_t size) {
    std::set<std::string> failed;
    Expect(OpenServer(dir_, &server_, &failed), "open an empty state directory", true);
    Reader in(data, size);
    for (int n = 0; n < kMaxOps && !in.done(); ++n) Step(in);
    Restart();  // every input ends with a restart: what was acknowledged must come back
    // REGISTRY_FUZZER_TRACE=1 shows what an input did (to read a seed or a reproducer).
    if (std::getenv("REGISTRY_FUZZER_TRACE") != nullptr) std::fputs(trace_.c_str(), stderr);
  }

 private:
  // A job this input created, and what it acknowledged.
  struct Job {
    std::string id;
    bool deleted = false;                  // DeleteJob said OK: must never come back
    bool uncertain = false;                // DeleteJob failed: it may or may not be there
    std::map<int64_t, std::string> plans;  // step -> PlanText acknowledged
  };

  [[noreturn]] void Fail(const std::string& what) {
    std::fprintf(stderr, "registry_fuzzer: %s\noperations so far:\n%s", what.c_str(),
                 trace_.c_str());
    std::abort();
  }

  // Every refusal must say why; `must_succeed` for calls that cannot fail legitimately.
  void Expect(const absl::Status& status, const std::string& call, bool must_succeed = false) {
    if (status.ok()) return;
    if (status.message().empty()) Fail(absl::StrCat(call, ": refused with an empty message"));
    if (must_succeed) Fail(absl::StrCat(call, ": ", status.ToString()));
  }

  void Trace(const std::string& line) { absl::StrAppend(&trace_, "  ", line, "\n"); }

  Job* PickJob(Reader& in) {
    const uint8_t slot = in.U8();
    const size_t i = slot % (jobs_.size() + 1);
    return i < jobs_.size() ? &jobs_[i] : nullptr;
  }
  std::string IdOf(const Job* job) const { return job != nullptr ? job->id : "0123456789abcdef"; }

  int64_t PickStep(Reader& in, const std::string& id) {
    const int64_t next = std::max<int64_t>(NextStep(server_, id), 0);
    switch (in.U8() % kStepModes) {
      case kStepNext:
        return next;
      case kStepLast:
        return next - 1;
      case kStepRaw:
        return in.I64();
      default:
        return next + in.U8();
    }
  }

  // After a refused call on (job, step): the step's plan must be what it was.
  void ExpectPlanUnchanged(const Job* job, int64_t step, const std::string& call) {
    if (job == nullptr) return;
    auto it = job->plans.find(step);
    if (it == job->plans.end()) return;
    absl::StatusOr<std::string> served = ServedPlan(server_, job->id, step);
    if (served.ok() && *served != it->second) {
      Fail(absl::StrCat(call, " was refused but changed the plan of step ", step, "\nbefore:\n",
                        it->second, "after:\n", *served));
    }
  }

  void Step(Reader& in) {
    const uint8_t op = in.U8() % kOpCount;
    switch (op) {
      case kCreateJob: {
        v1::JobConfig config;
        const bool parsed = config.ParseFromString(in.Blob());
        const std::string profile = in.Blob();
        Trace(absl::StrCat("CreateJob ", config.ShortDebugString(), " profile ", profile.size(),
                           " bytes"));
        if (!parsed) return;
        absl::StatusOr<JobSettings> settings = ConfigFromProto(config, FuzzLimits());
        Expect(settings.status(), "ConfigFromProto");
        if (!settings.ok()) return;
        absl::StatusOr<CreatedJob> created =
            server_.registry->CreateJob("fuzz", *settings, profile);
        Expect(created.status(), "CreateJob");
        if (created.ok()) {
          jobs_.emplace_back();
          jobs_.back().id = created->job_id;
          Trace(absl::StrCat("  -> job ", created->job_id, " (slot ", jobs_.size() - 1, ")"));
        }
        return;
      }
      case kJoinJob: {
        Job* job = PickJob(in);
        const int32_t rank = in.I32();
        Trace(absl::StrCat("JoinJob ", IdOf(job), " rank ", rank));
        Expect(server_.registry->JoinJob(IdOf(job), rank).status(), "JoinJob");
        return;
      }
      case kSubmitBatch: {
        Job* job = PickJob(in);
        const int64_t step = PickStep(in, IdOf(job));
        const bool planned_locally = (in.U8() & 1) != 0;
        v1::SubmitBatchRequest request;
        const bool parsed = request.ParseFromString(in.Blob());
        Trace(absl::StrCat("SubmitBatch ", IdOf(job), " step ", step,
                           planned_locally ? " planned_locally " : " ",
                           request.ShortDebugString()));
        if (!parsed) return;
        absl::StatusOr<std::vector<Sample>> batch =
            SamplesFromProto(request.samples(), FuzzLimits());
        Expect(batch.status(), "SamplesFromProto");
        if (!batch.ok()) return;
        absl::StatusOr<SubmitResult> result =
            server_.registry->SubmitBatch(IdOf(job), step, *batch, planned_locally);
        Expect(result.status(), "SubmitBatch");
        if (!result.ok()) {
          Trace(absl::StrCat("  -> ", result.status().ToString()));
          ExpectPlanUnchanged(job, step, "SubmitBatch");
          return;
        }
        if (job == nullptr) Fail("SubmitBatch succeeded for a job that never existed");
        const std::string text = PlanText(*result->plan);
        auto known = job->plans.find(step);
        if (result->repeated && !result->switched_to_local && known != job->plans.end() &&
            known->second != text) {
          Fail(absl::StrCat("a repeated SubmitBatch of step ", step, " returned another plan"));
        }
        job->plans[step] = text;
        Trace(absl::StrCat("  -> planned step ", result->step, result->repeated ? " (repeat)" : "",
                           result->switched_to_local ? " (switched to local)" : ""));
        return;
      }
      case kGetPlan: {
        Job* job = PickJob(in);
        const int64_t step = PickStep(in, IdOf(job));
        const int32_t rank = in.I32();
        Trace(absl::StrCat("GetPlan ", IdOf(job), " step ", step, " rank ", rank));
        bool ready = false;
        absl::StatusOr<std::shared_ptr<const StepPlan>> plan =
            server_.registry->GetPlan(IdOf(job), step, rank, &ready);
        Expect(plan.status(), "GetPlan");
        if (plan.ok() && ready && job != nullptr) {
          if (*plan == nullptr) Fail("GetPlan: ready with no plan");
          auto known = job->plans.find(step);
          if (known != job->plans.end() && known->second != PlanText(**plan)) {
            Fail(absl::StrCat("GetPlan serves another plan for step ", step, " than acknowledged"));
          }
        }
        return;
      }
      case kReportStep: {
        Job* job = PickJob(in);
        const int64_t step = PickStep(in, IdOf(job));
        v1::ReportStepRequest request;
        const bool parsed = request.ParseFromString(in.Blob());
        Trace(absl::StrCat("ReportStep ", IdOf(job), " step ", step, " ",
                           request.ShortDebugString(), " wait ", request.wait_seconds()));
        if (!parsed) return;
        std::vector<MicroBatchTiming> measured;
        for (const v1::MicroBatchReport& m : request.micro_batches()) {
          measured.push_back(TimingFromProto(m));
        }
        absl::StatusOr<bool> duplicate =
            server_.registry->ReportStep(IdOf(job), step, request.rank(), measured,
                                         request.wait_seconds(), request.planned_locally());
        Expect(duplicate.status(), "ReportStep");
        if (!duplicate.ok()) {
          Trace(absl::StrCat("  -> ", duplicate.status().ToString()));
          ExpectPlanUnchanged(job, step, "ReportStep");
          return;
        }
        // A planned_locally report may switch the step to the local plan: that is now the
        // acknowledged one.
        if (job != nullptr && request.planned_locally()) {
          absl::StatusOr<std::string> served = ServedPlan(server_, job->id, step);
          if (served.ok() && !served->empty()) job->plans[step] = *served;
        }
        return;
      }
      case kReportSteps: {
        Job* job = PickJob(in);
        const int64_t step = PickStep(in, IdOf(job));
        v1::ReportStepBatchRequest request;
        const bool parsed = request.ParseFromString(in.Blob());
        Trace(absl::StrCat("ReportSteps ", IdOf(job), " step ", step, " ",
                           request.ShortDebugString()));
        if (!parsed) return;
        std::vector<RankStepReport> reports;
        bool local = false;
        for (const v1::ReportStepRequest& r : request.reports()) {
          reports.push_back(ReportFromProto(r));
          reports.back().step = step;
          local = local || r.planned_locally();
        }
        std::vector<JobRegistry::ReportAnswer> answers;
        const absl::Status status = server_.registry->ReportSteps(IdOf(job), reports, &answers);
        Expect(status, "ReportSteps");
        // One answer per report looked at: all of them, or up to the refused one.
        if (answers.size() > reports.size() || (status.ok() && answers.size() != reports.size()) ||
            (!status.ok() && job != nullptr && answers.empty() && !reports.empty() &&
             status.code() != absl::StatusCode::kNotFound)) {
          Fail(absl::StrCat("ReportSteps: ", answers.size(), " answers to ", reports.size(),
                            " reports, status ", status.ToString()));
        }
        if (!status.ok()) Trace(absl::StrCat("  -> ", status.ToString()));
        // A planned_locally report may switch the step to the local plan, even in a call that
        // then failed; otherwise nothing a refused batch holds changes the plan.
        if (job != nullptr && local) {
          absl::StatusOr<std::string> served = ServedPlan(server_, job->id, step);
          if (served.ok() && !served->empty()) job->plans[step] = *served;
        } else if (!status.ok()) {
          ExpectPlanUnchanged(job, step, "ReportSteps");
        }
        return;
      }
      case kUpdateJobConfig: {
        Job* job = PickJob(in);
        v1::UpdateJobConfigRequest request;
        const bool parsed = request.ParseFromString(in.Blob());
        Trace(absl::StrCat("UpdateJobConfig ", IdOf(job), " ", request.ShortDebugString()));
        if (!parsed) return;
        // As PlannerServiceImpl::OnUpdateJobConfig builds the update.
        absl::StatusOr<ConfigUpdate> update = ConfigUpdateFromProto(request);
        Expect(update.status(), "UpdateJobConfig conversion");
        if (!update.ok()) return;
        Expect(
            server_.registry->UpdateJobConfig(IdOf(job), update->values, update->fields).status(),
            "UpdateJobConfig");
        ForgetDroppedSteps(job);
        return;
      }
      case kUploadProfile: {
        Job* job = PickJob(in);
        const std::string profile = in.Blob();
        Trace(absl::StrCat("UploadProfile ", IdOf(job), " ", profile.size(), " bytes"));
        Expect(server_.registry->UploadProfile(IdOf(job), profile).status(), "UploadProfile");
        return;
      }
      case kDeleteJob: {
        Job* job = PickJob(in);
        Trace(absl::StrCat("DeleteJob ", IdOf(job)));
        const absl::Status status = server_.registry->DeleteJob(IdOf(job));
        Expect(status, "DeleteJob");
        if (job == nullptr) return;
        if (status.ok()) {
          job->deleted = true;
        } else if (!absl::IsNotFound(status)) {
          job->uncertain = true;
        }
        return;
      }
      case kRestart:
        Trace("restart");
        Restart();
        return;
      case kGetJob: {
        Job* job = PickJob(in);
        Trace(absl::StrCat("GetJob ", IdOf(job)));
        Expect(server_.registry->GetJob(IdOf(job)).status(), "GetJob");
        for (const JobView& view : server_.registry->ListJobs("", kMaxJobs)) {
          if (view.job_id.empty()) Fail("ListJobs lists a job without an id");
        }
        return;
      }
      default:
        return;
    }
  }

  // Steps a job no longer serves (dropped from its history) are no longer expected back.
  void ForgetDroppedSteps(Job* job) {
    if (job == nullptr) return;
    for (auto it = job->plans.begin(); it != job->plans.end();) {
      absl::StatusOr<std::string> served = ServedPlan(server_, job->id, it->first);
      it = !served.ok() && absl::IsFailedPrecondition(served.status()) ? job->plans.erase(it)
                                                                       : std::next(it);
    }
  }

  void Restart() {
    // What must come back: every live job, and every acknowledged plan it still serves.
    for (Job& job : jobs_) {
      if (job.deleted || job.uncertain) continue;
      ForgetDroppedSteps(&job);
      for (const auto& [step, text] : job.plans) {
        absl::StatusOr<std::string> served = ServedPlan(server_, job.id, step);
        if (served.ok() && *served != text) {
          Fail(absl::StrCat("before a restart, job ", job.id, " step ", step,
                            " serves another plan than acknowledged\nacknowledged:\n", text,
                            "served:\n", *served));
        }
      }
    }
    CloseServer(&server_);
    std::set<std::string> failed;
    const absl::Status restored = OpenServer(dir_, &server_, &failed);
    if (!restored.ok()) Fail(absl::StrCat("Restore after a restart: ", restored.ToString()));
    for (Job& job : jobs_) {
      if (job.uncertain) continue;
      absl::StatusOr<JobView> view = server_.registry->GetJob(job.id);
      if (job.deleted) {
        if (view.ok() || failed.count(job.id) > 0) {
          Fail(absl::StrCat("deleted job ", job.id, " is back after a restart",
                            view.ok() ? "" : " (quarantined)"));
        }
        continue;
      }
      if (failed.count(job.id) > 0) continue;
      if (!view.ok()) {
        Fail(absl::StrCat("job ", job.id, " is gone after a restart: ", view.status().ToString()));
      }
      for (const auto& [step, text] : job.plans) {
        absl::StatusOr<std::string> served = ServedPlan(server_, job.id, step);
        if (!served.ok() || *served != text) {
          Fail(absl::StrCat("after a restart, job ", job.id, " step ", step,
                            " is not served as acknowledged\nacknowledged:\n", text, "served:\n",
                            served.ok() ? *served : served.status().ToString()));
        }
      }
    }
  }

  const std::string dir_;
  Server server_;
  std::vector<Job> jobs_;
  std::string trace_;
};

// The process's directory of per-input directories; removed at exit (a crash leaves it).
std::string& Root() {
  static auto* const root = new std::string;  // never destroyed: RemoveRoot runs at exit
  return *root;
}

void RemoveRoot() {
  std::error_code ignored;
  std::filesystem::remove_all(Root(), ignored);
}

// A fresh directory per input, under /dev/shm when there is one (fsync is cheap on tmpfs).
std::string FreshDirectory() {
  static const std::string& root = Root() = [] {
    const char* base = std::filesystem::exists("/dev/shm") ? "/dev/shm" : "/tmp";
    std::string pattern = absl::StrCat(base, "/sb-registry-fuzz-XXXXXX");
    if (mkdtemp(pattern.data()) == nullptr) {
      std::perror("registry_fuzzer: mkdtemp");
      std::abort();
    }
    std::atexit(RemoveRoot);
    return pattern;
  }();
  static uint64_t n = 0;
  return absl::StrCat(root, "/", ++n);
}

}  // namespace
}  // namespace fuzz
}  // namespace sparsebalance

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  sparsebalance::fuzz::Harness harness(sparsebalance::fuzz::FreshDirectory());
  harness.Run(data, size);
  return 0;
}
