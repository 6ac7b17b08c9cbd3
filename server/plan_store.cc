#include "server/plan_store.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"

namespace sparsebalance {
namespace {

absl::Status IoError(absl::string_view what, const std::string& path) {
  return absl::UnavailableError(
      absl::StrCat("state: ", what, " ", path, ": ", std::strerror(errno)));
}

absl::Status MakeDir(const std::string& path) {
  if (mkdir(path.c_str(), 0700) == 0 || errno == EEXIST) return absl::OkStatus();
  return IoError("cannot create", path);
}

absl::Status SyncPath(const std::string& path) {
  const int fd = open(path.c_str(), O_RDONLY);
  if (fd < 0) return IoError("cannot open", path);
  const int rc = fsync(fd);
  close(fd);
  return rc == 0 ? absl::OkStatus() : IoError("cannot fsync", path);
}

absl::Status WriteAll(int fd, const std::string& bytes, const std::string& path) {
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return IoError("cannot write", path);
    done += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

// Write to a temporary file, fsync, rename over `path`, fsync the folder. Without `sync` only
// the rename is atomic: a process crash leaves the old or the new file, a machine crash may
// lose the write.
absl::Status WriteDurably(const std::string& dir, const std::string& path, const std::string& bytes,
                          bool sync = true) {
  const std::string tmp = path + ".tmp";
  const int fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  if (fd < 0) return IoError("cannot create", tmp);
  absl::Status status = WriteAll(fd, bytes, tmp);
  if (status.ok() && sync && fsync(fd) != 0) status = IoError("cannot fsync", tmp);
  close(fd);
  if (!status.ok()) return status;
  if (rename(tmp.c_str(), path.c_str()) != 0) return IoError("cannot rename to", path);
  return sync ? SyncPath(dir) : absl::OkStatus();
}

absl::StatusOr<std::string> ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return IoError("cannot read", path);
  std::stringstream bytes;
  bytes << in.rdbuf();
  return bytes.str();
}

std::string StepPath(const std::string& job_dir, int64_t step, absl::string_view suffix) {
  return absl::StrCat(job_dir, "/step-", step, suffix);
}

}  // namespace

absl::StatusOr<std::unique_ptr<PlanStore>> PlanStore::Open(const std::string& dir,
                                                           bool fsync_reports) {
  if (dir.empty()) return absl::InvalidArgumentError("state_dir: empty");
  if (absl::Status s = MakeDir(dir); !s.ok()) return s;
  return std::unique_ptr<PlanStore>(new PlanStore(dir, fsync_reports));
}

std::string PlanStore::JobDir(const std::string& job_id) const {
  return absl::StrCat(dir_, "/", job_id);
}

absl::Status PlanStore::SaveJob(const state::v1::JobSnapshot& job, bool sync) {
  const std::string job_dir = JobDir(job.job_id());
  if (absl::Status s = MakeDir(job_dir); !s.ok()) return s;
  return WriteDurably(job_dir, job_dir + "/job.pb", job.SerializeAsString(),
                      sync || fsync_reports_);
}

absl::Status PlanStore::SaveStep(const std::string& job_id, const state::v1::StepRecord& step) {
  const std::string job_dir = JobDir(job_id);
  return WriteDurably(job_dir, StepPath(job_dir, step.step(), ".pb"), step.SerializeAsString());
}

absl::Status PlanStore::AppendReport(const std::string& job_id, int64_t step,
                                     const state::v1::ReportRecord& report) {
  const std::string path = StepPath(JobDir(job_id), step, ".reports");
  const std::string body = report.SerializeAsString();
  std::string record(4, '\0');
  const uint32_t size = static_cast<uint32_t>(body.size());
  std::memcpy(record.data(), &size, 4);  // little-endian hosts only (x86-64, arm64)
  record += body;
  absl::MutexLock lock(&logs_mu_);
  auto it = report_logs_.find({job_id, step});
  if (it == report_logs_.end()) {
    if (report_logs_.size() >= kMaxOpenReportLogs) {
      for (const auto& [key, fd] : report_logs_) close(fd);
      report_logs_.clear();
    }
    const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
    if (fd < 0) return IoError("cannot open", path);
    it = report_logs_.emplace(std::make_pair(job_id, step), fd).first;
  }
  const int fd = it->second;
  absl::Status status = WriteAll(fd, record, path);
  if (status.ok() && fsync_reports_ && fsync(fd) != 0) status = IoError("cannot fsync", path);
  if (!status.ok()) {  // reopen next time
    close(fd);
    report_logs_.erase(it);
  }
  return status;
}

PlanStore::~PlanStore() {
  absl::MutexLock lock(&logs_mu_);
  for (const auto& [key, fd] : report_logs_) close(fd);
}

void PlanStore::CloseReportLogs(const std::string& job_id, int64_t step) {
  absl::MutexLock lock(&logs_mu_);
  for (auto it = report_logs_.begin(); it != report_logs_.end();) {
    if (it->first.first == job_id && (step < 0 || it->first.second == step)) {
      close(it->second);
      it = report_logs_.erase(it);
    } else {
      ++it;
    }
  }
}

absl::Status PlanStore::DropStep(const std::string& job_id, int64_t step) {
  CloseReportLogs(job_id, step);
  const std::string job_dir = JobDir(job_id);
  for (absl::string_view suffix : {".pb", ".reports"}) {
    const std::string path = StepPath(job_dir, step, suffix);
    if (unlink(path.c_str()) != 0 && errno != ENOENT) return IoError("cannot remove", path);
  }
  return absl::OkStatus();
}

absl::Status PlanStore::DeleteJob(const std::string& job_id) {
  CloseReportLogs(job_id, -1);
  const std::string job_dir = JobDir(job_id);
  DIR* d = opendir(job_dir.c_str());
  if (d == nullptr) return errno == ENOENT ? absl::OkStatus() : IoError("cannot list", job_dir);
  std::vector<std::string> names;
  while (dirent* e = readdir(d)) {
    const std::string name = e->d_name;
    if (name != "." && name != "..") names.push_back(name);
  }
  closedir(d);
  for (const std::string& name : names) {
    const std::string path = job_dir + "/" + name;
    if (unlink(path.c_str()) != 0) return IoError("cannot remove", path);
  }
  if (rmdir(job_dir.c_str()) != 0) return IoError("cannot remove", job_dir);
  return SyncPath(dir_);
}

absl::StatusOr<std::vector<PlanStore::LoadedJob>> PlanStore::LoadAll() const {
  std::vector<std::string> ids;
  DIR* d = opendir(dir_.c_str());
  if (d == nullptr) return IoError("cannot list", dir_);
  while (dirent* e = readdir(d)) {
    const std::string name = e->d_name;
    if (name == "." || name == "..") continue;
    struct stat st;
    if (stat((dir_ + "/" + name).c_str(), &st) == 0 && S_ISDIR(st.st_mode)) ids.push_back(name);
  }
  closedir(d);
  std::sort(ids.begin(), ids.end());
  std::vector<LoadedJob> jobs;
  for (const std::string& id : ids) {
    const std::string job_dir = JobDir(id);
    absl::StatusOr<std::string> bytes = ReadAll(job_dir + "/job.pb");
    if (!bytes.ok()) continue;  // a job folder whose first snapshot never landed
    LoadedJob job;
    if (!job.job.ParseFromString(*bytes)) {
      return absl::DataLossError(absl::StrCat("state: ", job_dir, "/job.pb does not parse"));
    }
    std::vector<int64_t> steps;
    DIR* jd = opendir(job_dir.c_str());
    if (jd == nullptr) return IoError("cannot list", job_dir);
    while (dirent* e = readdir(jd)) {
      absl::string_view name = e->d_name;
      int64_t step = 0;
      if (absl::ConsumePrefix(&name, "step-") && absl::ConsumeSuffix(&name, ".pb") &&
          absl::SimpleAtoi(name, &step)) {
        steps.push_back(step);
      }
    }
    closedir(jd);
    std::sort(steps.begin(), steps.end());
    for (int64_t step : steps) {
      LoadedStep loaded;
      absl::StatusOr<std::string> record = ReadAll(StepPath(job_dir, step, ".pb"));
      if (!record.ok()) return record.status();
      if (!loaded.record.ParseFromString(*record)) {
        return absl::DataLossError(
            absl::StrCat("state: ", StepPath(job_dir, step, ".pb"), " does not parse"));
      }
      absl::StatusOr<std::string> log = ReadAll(StepPath(job_dir, step, ".reports"));
      if (log.ok()) {
        size_t at = 0;
        while (at + 4 <= log->size()) {
          uint32_t size = 0;
          std::memcpy(&size, log->data() + at, 4);
          if (at + 4 + size > log->size()) break;  // torn by a crash mid-append: dropped
          state::v1::ReportRecord report;
          if (!report.ParseFromArray(log->data() + at + 4, static_cast<int>(size))) break;
          loaded.reports.push_back(std::move(report));
          at += 4 + size;
        }
      }
      job.steps.push_back(std::move(loaded));
    }
    jobs.push_back(std::move(job));
  }
  return jobs;
}

}  // namespace sparsebalance
