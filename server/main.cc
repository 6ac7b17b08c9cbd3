// sb-planner: the SparseBalance planner service. `sb-planner --help` lists the flags; with none
// it listens on 127.0.0.1:50151 and says so.
#include <netdb.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <iostream>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "planner/plan_threads.h"
#include "planner/types.h"
#include "prometheus/exposer.h"
#include "prometheus/registry.h"
#include "server/planner_metrics.h"
#include "server/planner_service.h"
#include "server/store_health.h"
#include "tools/listen_address.h"
#include "tools/secret.h"
#include "tools/tool_support.h"

ABSL_FLAG(std::string, listen, "127.0.0.1:50151",
          "host:port for gRPC: IPv4, [IPv6] or a host name, port 1-65535 (0 picks a free port; "
          "the chosen address is printed), or unix:PATH. Anything else is refused at start");
ABSL_FLAG(std::string, state_dir, "sb-planner-state",
          "directory for jobs, plans and reports (created, mode 0700: it holds job tokens); "
          "a restarted planner reloads every job from it. When it cannot make a change durable "
          "once made (a folder's fsync failing after a rename), sb-planner says so on stderr and "
          "exits with code 3: restarted, it serves what the directory holds");
ABSL_FLAG(bool, fsync_reports, false,
          "also fsync every report before acknowledging it (survives machine crashes, not just "
          "planner crashes; costs a disk flush per report, or per step's reports in one "
          "ReportStepBatch call)");
ABSL_FLAG(int, max_job_state_mb, 8192,
          "MiB one job's files may take in --state_dir, 0-16777216 (0: no bound). A new step or "
          "report past it is refused with RESOURCE_EXHAUSTED (reason JOB_STATE_QUOTA) for that "
          "job alone: it keeps what it stored, other jobs and health are untouched; lower its "
          "history (UpdateJobConfig history_steps) or delete it to make room. A job keeps "
          "history_steps + 1 step records (about 38 bytes a sample; 280 with per-layer densities "
          "at 32 layers) and history_steps steps of reports (about 100 bytes a rank, and 16 a "
          "document whose recall is measured). The default holds, twice over, a job at "
          "--max_samples (2^20 samples over 65,536 ranks) with the default history of 64 steps "
          "(about 3.8 GiB), or one of 16,384 samples over 1,024 ranks with the largest history, "
          "4,096 steps (about 3.7 GiB); a job at both limits (about 240 GiB) fits no volume. "
          "Keep it under the volume's size, so that no job can fill it for the others");
ABSL_FLAG(std::string, metrics_listen, "127.0.0.1:9151",
          "IP:port of the Prometheus endpoint /metrics: IPv4 or [IPv6], port 1-65535 (0 picks a "
          "free port)");
ABSL_FLAG(int, max_rank_series, 64, "jobs of at most this many ranks also export per-rank series");
ABSL_FLAG(int, slow_rank_series, 8,
          "export this many of each job's slowest ranks (sparsebalance_slowest_rank_speed_factor, "
          "labelled with position, rank and host), for jobs of any size; 0 to 64");
ABSL_FLAG(absl::Duration, job_idle_ttl, absl::Hours(24),
          "delete a job (state files, waiting calls, metric series) when no call has carried its "
          "token for this long, e.g. 24h, 30m; 0 keeps jobs until DeleteJob");
ABSL_FLAG(std::string, admin_token_file, "",
          "file holding the admin token; when set, CreateJob and ListJobs need it, and DeleteJob "
          "it or the job's own token. Without it any caller may create and list jobs, and only a "
          "job's own token deletes it. Required when --listen is not a loopback address (see "
          "--insecure_no_admin_token)");
ABSL_FLAG(bool, insecure_no_admin_token, false,
          "allow a --listen beyond loopback without --admin_token_file: then anyone who reaches "
          "the port can create and list every job. Without this flag sb-planner refuses "
          "to start that way");
ABSL_FLAG(std::string, tls_cert, "", "PEM server certificate chain: serve TLS (with --tls_key)");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert");
ABSL_FLAG(std::string, tls_client_ca, "",
          "PEM CA bundle: require and verify client certificates (mutual TLS)");
ABSL_FLAG(int, max_jobs, 1024, "jobs held at once (RESOURCE_EXHAUSTED above)");
ABSL_FLAG(int, max_samples, 1 << 20, "samples per SubmitBatch (RESOURCE_EXHAUSTED above)");
ABSL_FLAG(int, max_world_size, 65536, "ranks per job (RESOURCE_EXHAUSTED above)");
ABSL_FLAG(int, max_message_bytes, 256 << 20,
          "largest request accepted, bytes (1024 to 2147483647). gRPC checks it only once it "
          "has received the whole request, so it does not bound what a call makes the planner "
          "hold meanwhile (--max_transport_memory_mb does)");
ABSL_FLAG(int, max_request_memory_mb, 512,
          "MiB the requests in hand may take once parsed, all together, 1-1048576: a request's "
          "parse is estimated from its bytes after its token is checked and before it is parsed, "
          "and one that does not fit is RESOURCE_EXHAUSTED (a protobuf field of two bytes takes "
          "up to 100 parsed; a full SubmitBatch of 2^20 samples about 100 MiB). Keep it well "
          "under the planner's memory limit");
ABSL_FLAG(int, max_transport_memory_mb, 512,
          "MiB gRPC may hold, all connections together, for the bytes of requests still "
          "arriving, 16-1048576 and at least --max_message_bytes (a larger request could never "
          "arrive): the planner refuses a call without a valid token before reading its request, "
          "but gRPC receives an admitted caller's request whole before the planner checks it "
          "against its job, so without a bound calls with a job's token that send all but the "
          "last byte of large requests and stall held that much each. Past it gRPC cancels calls "
          "(RESOURCE_EXHAUSTED, \"Buffers full\") until it is back under it. A soft bound: under "
          "a flood of many concurrent large calls the planner's memory can still pass it "
          "(README, Limits). Keep it plus --max_request_memory_mb well under the planner's "
          "memory limit");
ABSL_FLAG(std::string, health_listen, "",
          "also serve grpc.health.v1 alone, in plaintext, on this host:port (as --listen; port 0 "
          "picks a free port): for probes, which need no TLS, and it stays open for the whole "
          "drain (--listen closes after --drain_notice_seconds). Service \"\" is SERVING until "
          "the process exits (liveness), sparsebalance.planner.v1.PlannerService follows "
          "readiness; empty: off");
ABSL_FLAG(double, drain_seconds, 10.0,
          "on SIGTERM/SIGINT: health turns NOT_SERVING and calls in flight get this long");
ABSL_FLAG(double, drain_notice_seconds, 2.0,
          "the first part of --drain_seconds during which new calls are still accepted, so that "
          "health checks (not only open Watch streams) see NOT_SERVING before the port closes");
ABSL_FLAG(double, state_check_seconds, 5.0,
          "probe that --state_dir can be written this often (every second while it cannot). "
          "Health is NOT_SERVING from the first write to it that fails (disk full, I/O error, "
          "read-only; a job refused at --max_job_state_mb is not one) or probe that fails, and "
          "SERVING again once a probe as large as the largest failed write (at most 16 MiB), "
          "made a second or more after the last failure, is written and synced");
ABSL_FLAG(int, plan_threads, 0,
          "threads each step's planning is split over, 1-64 (0: the CPUs this process may use, "
          "after its affinity and its cgroup's CPU limit, at most 8); plans are the same bytes "
          "with any number. A restart also restores --state_dir's jobs on them");
ABSL_FLAG(int, max_waiting_calls, 16384,
          "GetRankPlan calls waiting for their step at once (RESOURCE_EXHAUSTED above); per job "
          "at most 2 per rank + 64");
ABSL_FLAG(int, max_report_streams, 16384,
          "ReportSteps streams (one per reporting rank) open at once, 0-1048576; one more is "
          "refused with RESOURCE_EXHAUSTED and its client reports by unary ReportStep calls "
          "(0: every client does)");

namespace sparsebalance {
namespace {

constexpr char kServiceName[] = "sparsebalance.planner.v1.PlannerService";
// The health-only listener takes health checks alone (a service name: tens of bytes) and its
// buffers have a quota of their own. gRPC checks a request's size only once it holds all of it,
// so the quota is what bounds what stalled calls hold there; the size still refuses the rest.
constexpr int kMaxHealthRequestBytes = 4096;
constexpr size_t kHealthQuotaBytes = size_t{16} << 20;

// The file a flag names; the error names both.
absl::StatusOr<std::string> ReadFlagFile(absl::string_view flag, const std::string& path) {
  absl::StatusOr<std::string> text = tools::ReadFile(path);
  if (!text.ok())
    return absl::InvalidArgumentError(absl::StrCat("--", flag, ": ", text.status().message()));
  return text;
}

// Job ids and tokens come from the kernel's CSPRNG; without it the planner cannot hand out any.
std::string RandomHex(int n) {
  absl::StatusOr<std::string> hex = tools::RandomHex(n);
  if (!hex.ok()) {
    std::cerr << "sb-planner: " << hex.status().message() << " (job ids and tokens)\n";
    std::abort();
  }
  return *std::move(hex);
}

// The value of a listen flag, checked strictly (tools/listen_address.h): a wrong one ends the
// process with kExitUsage and a message naming the flag.
tools::ListenAddress CheckedListenFlag(absl::string_view flag, const std::string& value,
                                       const tools::ListenAddressRules& rules) {
  absl::StatusOr<tools::ListenAddress> parsed = tools::ParseListenAddress(flag, value, rules);
  if (!parsed.ok()) tools::UsageError(parsed.status().message());
  return *std::move(parsed);
}

// Stops the metrics endpoint at once. civetweb's mg_stop (the Exposer's destructor) sets a flag
// and waits for its listening thread, which sees the flag only when its poll of the listening
// socket returns: up to a second at every planner stop when nobody connects. Connecting to the
// port while it stops wakes that poll (0.07 s instead of 1.0 measured on loopback).
void StopMetricsEndpoint(std::unique_ptr<prometheus::Exposer> exposer,
                         const tools::ListenAddress& listen) {
  if (exposer == nullptr) return;
  const std::vector<int> ports = exposer->GetListeningPorts();
  absl::Notification stopped;
  std::thread poke;
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICHOST | AI_NUMERICSERV;
  addrinfo* target = nullptr;
  // A wildcard listener is reached through loopback, of its own family.
  const std::string host = !listen.wildcard                             ? listen.host
                           : listen.host.find(':') == std::string::npos ? "127.0.0.1"
                                                                        : "::1";
  if (!ports.empty() &&
      getaddrinfo(host.c_str(), std::to_string(ports.front()).c_str(), &hints, &target) == 0) {
    poke = std::thread([&stopped, target] {
      while (!stopped.WaitForNotificationWithTimeout(absl::Milliseconds(20))) {
        const int fd = socket(target->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (fd < 0) continue;
        (void)connect(fd, target->ai_addr, target->ai_addrlen);  // failing is fine: it stops
        close(fd);
      }
    });
  }
  exposer.reset();
  stopped.Notify();
  if (poke.joinable()) poke.join();
  if (target != nullptr) freeaddrinfo(target);
}

// A background thread that runs a loop body until Stop(). Between rounds the body calls
// Wait, which returns false once Stop() was called (Stop wakes it at once).
class BackgroundLoop {
 public:
  ~BackgroundLoop() { Stop(); }
  void Start(std::function<void()> body) { thread_ = std::thread(std::move(body)); }
  void Stop() {
    {
      absl::MutexLock lock(&mu_);
      stop_ = true;
      wake_.Signal();
    }
    if (thread_.joinable()) thread_.join();
  }
  // Sleeps up to `timeout`, or less when Wake() or Stop() is called meanwhile. With
  // `take_wake`, a Wake() made before the call ends it at once. False once stopping.
  bool Wait(absl::Duration timeout, bool take_wake) {
    absl::MutexLock lock(&mu_);
    if (!stop_ && !(take_wake && woken_)) wake_.WaitWithTimeout(&mu_, timeout);
    woken_ = false;
    return !stop_;
  }
  void Wake() {
    absl::MutexLock lock(&mu_);
    woken_ = true;
    wake_.Signal();
  }

 private:
  absl::Mutex mu_;
  absl::CondVar wake_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  bool woken_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

// Health follows the state directory (the rule: StoreHealth, store_health.h): NOT_SERVING at
// once when a write of the store fails or a probe fails, SERVING again only once a probe as
// large as the largest failed write (at most 16 MiB), run at least a second after the last
// failure, has been written and synced. Probes every `check_seconds` while SERVING (a short
// one), every second while not. Only this thread publishes the status (`set_serving`), in the
// order it decides it.
class StateDirHealth {
 public:
  StateDirHealth(PlanStore* store, double check_seconds, std::function<void(bool)> set_serving)
      : store_(store), check_seconds_(check_seconds), set_serving_(std::move(set_serving)) {}
  void Start() {
    loop_.Start([this] { Run(); });
  }
  // A store failure (JobRegistry::Options::on_store_failure; never a job's quota refusal) of a
  // write of `bytes` (0: unknown). Cheap: callers hold a job's lock.
  void OnStoreFailure(const absl::Status& failure, int64_t bytes) {
    {
      absl::MutexLock lock(&mu_);
      health_.OnStoreFailure(absl::Now(), bytes);
      last_failure_ = std::string(failure.message());
    }
    loop_.Wake();
  }
  void Stop() { loop_.Stop(); }

 private:
  void Run() {
    bool published = true;  // SERVING, as the servers start
    while (loop_.Wait(absl::Seconds(published ? check_seconds_ : 1.0), /*take_wake=*/published)) {
      std::optional<StoreHealth::Probe> probe;
      {
        absl::MutexLock lock(&mu_);
        probe = health_.NextProbe(absl::Now());
      }
      if (probe.has_value()) {
        const absl::Status probed = store_->CheckWritable(probe->bytes, probe->free_bytes);
        absl::MutexLock lock(&mu_);
        health_.OnProbe(*probe, probed.ok(), absl::Now());
        if (!probed.ok()) last_failure_ = std::string(probed.message());
      }
      bool serving = true;
      std::string why;
      int64_t probe_bytes = 0;
      {
        absl::MutexLock lock(&mu_);
        serving = health_.serving();
        why = last_failure_;
        probe_bytes = health_.probe_bytes();
      }
      if (serving == published) continue;
      published = serving;
      std::cout << "sb-planner: "
                << (serving ? std::string("--state_dir can be written again: SERVING")
                            : absl::StrCat("--state_dir cannot be written (", why,
                                           "): NOT_SERVING until a probe of ",
                                           std::max<int64_t>(probe_bytes, 1),
                                           " bytes can be written and synced there"))
                << std::endl;
      set_serving_(serving);
    }
  }

  PlanStore* const store_;
  const double check_seconds_;
  const std::function<void(bool)> set_serving_;
  absl::Mutex mu_;
  StoreHealth health_ ABSL_GUARDED_BY(mu_);
  std::string last_failure_ ABSL_GUARDED_BY(mu_);  // the last store failure's message
  BackgroundLoop loop_;  // last: stopped (joined) before the members its thread reads go
};

// Deletes idle jobs (PlannerServiceImpl::ExpireIdleJobs) every `period` until stopped.
class IdleJobSweeper {
 public:
  IdleJobSweeper(PlannerServiceImpl* service, absl::Duration ttl)
      : service_(service),
        ttl_(ttl),
        period_(std::clamp(ttl / 10, absl::Seconds(1), absl::Seconds(60))) {}
  void Start() {
    if (ttl_ > absl::ZeroDuration()) loop_.Start([this] { Run(); });
  }
  void Stop() { loop_.Stop(); }

 private:
  void Run() {
    while (loop_.Wait(period_, /*take_wake=*/false)) {
      for (const std::string& job_id : service_->ExpireIdleJobs(absl::ToChronoNanoseconds(ttl_))) {
        std::cout << "sb-planner: job " << job_id
                  << " deleted: idle for --job_idle_ttl=" << absl::FormatDuration(ttl_)
                  << std::endl;
      }
    }
  }

  PlannerServiceImpl* const service_;
  const absl::Duration ttl_;
  const absl::Duration period_;
  BackgroundLoop loop_;  // last: stopped (joined) before the members its thread reads go
};

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> Credentials() {
  const std::string cert = absl::GetFlag(FLAGS_tls_cert);
  const std::string key = absl::GetFlag(FLAGS_tls_key);
  const std::string ca = absl::GetFlag(FLAGS_tls_client_ca);
  if (cert.empty() && key.empty()) {
    if (!ca.empty()) {
      return absl::InvalidArgumentError("--tls_client_ca needs --tls_cert and --tls_key");
    }
    return grpc::InsecureServerCredentials();
  }
  if (cert.empty() || key.empty()) {
    return absl::InvalidArgumentError("TLS needs both --tls_cert and --tls_key");
  }
  grpc::SslServerCredentialsOptions options(
      ca.empty() ? GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE
                 : GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  absl::StatusOr<std::string> cert_pem = ReadFlagFile("tls_cert", cert);
  if (!cert_pem.ok()) return cert_pem.status();
  absl::StatusOr<std::string> key_pem = ReadFlagFile("tls_key", key);
  if (!key_pem.ok()) return key_pem.status();
  options.pem_key_cert_pairs.push_back({*key_pem, *cert_pem});
  if (!ca.empty()) {
    absl::StatusOr<std::string> ca_pem = ReadFlagFile("tls_client_ca", ca);
    if (!ca_pem.ok()) return ca_pem.status();
    options.pem_root_certs = *ca_pem;
  }
  return grpc::SslServerCredentials(options);
}

int Main(int argc, char** argv) {
  // absl::Mutex's deadlock detection (on in Debian's build) costs a graph update per lock;
  // the tests keep it, the service does not need it.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  tools::InitTool(
      argc, argv,
      "the SparseBalance planner service (sparsebalance.planner.v1.PlannerService).\n"
      "Trainers create a job (CreateJob returns its token), submit each step's global batch,\n"
      "and every rank gets its plan and reports its timings. Health: grpc.health.v1 for\n"
      "service \"sparsebalance.planner.v1.PlannerService\"; reflection is on. Plans are on\n"
      "disk in --state_dir before SubmitBatch returns; a restarted planner continues every job.\n\n"
      "  sb-planner                                 # 127.0.0.1:50151\n"
      "  sb-planner --listen=0.0.0.0:50151 --admin_token_file=/run/secrets/admin");

  // Stop signals are taken by a waiting thread, not a handler: the drain needs locks.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGTERM);
  sigaddset(&stop_signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);

  // Every listen address is checked before anything starts: gRPC and civetweb would otherwise
  // bind something else without a word (`--listen=:99999` bound a random port).
  const std::string listen = absl::GetFlag(FLAGS_listen);
  const tools::ListenAddress listen_address = CheckedListenFlag("listen", listen, {});
  const std::string metrics_listen = absl::GetFlag(FLAGS_metrics_listen);
  tools::ListenAddressRules ip_only;  // civetweb binds IP addresses only
  ip_only.allow_host_names = false;
  ip_only.allow_unix_sockets = false;
  const tools::ListenAddress metrics_address =
      CheckedListenFlag("metrics_listen", metrics_listen, ip_only);
  const std::string health_listen = absl::GetFlag(FLAGS_health_listen);
  if (!health_listen.empty()) CheckedListenFlag("health_listen", health_listen, {});

  std::string admin_token;
  if (const std::string path = absl::GetFlag(FLAGS_admin_token_file); !path.empty()) {
    absl::StatusOr<std::string> token = ReadFlagFile("admin_token_file", path);
    if (!token.ok()) tools::Fatal(token.status().message(), tools::kExitUsage);
    admin_token = std::string(absl::StripAsciiWhitespace(*token));
    if (admin_token.empty()) {
      tools::Fatal(absl::StrCat("--admin_token_file=", path, " is empty"), tools::kExitUsage);
    }
  }
  if (admin_token.empty() && !listen_address.loopback &&
      !absl::GetFlag(FLAGS_insecure_no_admin_token)) {
    tools::Fatal(absl::StrCat("--listen=", listen,
                              " is reachable beyond this machine but no --admin_token_file is "
                              "set: anyone could create and list every job. Give an "
                              "admin token file (e.g. a secret), listen on 127.0.0.1, or pass "
                              "--insecure_no_admin_token"),
                 tools::kExitUsage);
  }
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> credentials = Credentials();
  if (!credentials.ok()) tools::Fatal(credentials.status().message(), tools::kExitUsage);

  const std::string state_dir = absl::GetFlag(FLAGS_state_dir);
  // MiB, so that an int holds any bound a disk may need (16 TiB at most).
  const int max_job_state_mb = absl::GetFlag(FLAGS_max_job_state_mb);
  if (max_job_state_mb < 0 || max_job_state_mb > (1 << 24)) {
    tools::Fatal(absl::StrCat("--max_job_state_mb=", max_job_state_mb,
                              " is outside [0, 16777216]; 0 leaves jobs unbounded"),
                 tools::kExitUsage);
  }
  const int64_t max_job_state_bytes = int64_t{max_job_state_mb} << 20;
  absl::StatusOr<std::unique_ptr<PlanStore>> store =
      PlanStore::Open(state_dir, absl::GetFlag(FLAGS_fsync_reports), max_job_state_bytes);
  if (!store.ok()) {
    tools::Fatal(absl::StrCat("--state_dir=", state_dir, ": ", store.status().message()),
                 tools::kExitUsage);
  }
  if (struct stat st; stat(state_dir.c_str(), &st) == 0 && (st.st_mode & S_IWOTH) != 0) {
    std::cerr << "sb-planner: warning: --state_dir=" << state_dir
              << " may be written by every user of this machine and is not this process's to "
                 "make private: others could rename, remove or plant job folders. Use a "
                 "directory of this user's, or one only its group can write"
              << std::endl;
  }
  const absl::Duration idle_ttl = absl::GetFlag(FLAGS_job_idle_ttl);
  if (idle_ttl < absl::ZeroDuration()) {
    tools::Fatal(absl::StrCat("--job_idle_ttl=", absl::FormatDuration(idle_ttl),
                              " is negative; give a duration such as 24h, or 0 to keep jobs"),
                 tools::kExitUsage);
  }
  const int slow_rank_series = absl::GetFlag(FLAGS_slow_rank_series);
  if (slow_rank_series < 0 || slow_rank_series > 64) {
    tools::Fatal(absl::StrCat("--slow_rank_series=", slow_rank_series, " is outside [0, 64]"),
                 tools::kExitUsage);
  }
  // Numeric limits: a value outside its range started a planner that reported healthy and
  // refused every call (--max_jobs=-1, --max_world_size=0, ...), or, for --max_message_bytes=-1,
  // none (gRPC's "unlimited").
  auto int_flag = [](const char* name, int value, int lo, int hi) {
    if (value < lo || value > hi) {
      tools::Fatal(absl::StrCat("--", name, "=", value, " is outside [", lo, ", ", hi, "]"),
                   tools::kExitUsage);
    }
    return value;
  };
  auto seconds_flag = [](const char* name, double value) {
    if (!std::isfinite(value) || value < 0.0 || value > 86400.0) {
      tools::Fatal(
          absl::StrCat("--", name, "=", value, " is not a number of seconds in [0, 86400]"),
          tools::kExitUsage);
    }
    return value;
  };
  const int max_report_streams =
      int_flag("max_report_streams", absl::GetFlag(FLAGS_max_report_streams), 0, 1 << 20);
  const int max_rank_series =
      int_flag("max_rank_series", absl::GetFlag(FLAGS_max_rank_series), 0, 1 << 20);
  const int max_jobs = int_flag("max_jobs", absl::GetFlag(FLAGS_max_jobs), 1, 1 << 20);
  const int max_samples =
      int_flag("max_samples", absl::GetFlag(FLAGS_max_samples), 1, kMaxBatchSamples);
  const int max_world_size =
      int_flag("max_world_size", absl::GetFlag(FLAGS_max_world_size), 1, kMaxPlanSlots);
  const int max_message_bytes =
      int_flag("max_message_bytes", absl::GetFlag(FLAGS_max_message_bytes), 1024,
               std::numeric_limits<int>::max());
  const int max_waiting_calls =
      int_flag("max_waiting_calls", absl::GetFlag(FLAGS_max_waiting_calls), 0, 1 << 24);
  const int max_request_memory_mb =
      int_flag("max_request_memory_mb", absl::GetFlag(FLAGS_max_request_memory_mb), 1, 1 << 20);
  const int max_transport_memory_mb = int_flag(
      "max_transport_memory_mb", absl::GetFlag(FLAGS_max_transport_memory_mb), 16, 1 << 20);
  if ((int64_t{max_transport_memory_mb} << 20) < max_message_bytes) {
    tools::Fatal(absl::StrCat("--max_transport_memory_mb=", max_transport_memory_mb,
                              " MiB is less than --max_message_bytes=", max_message_bytes,
                              ": a request that large could never arrive. Raise the first or "
                              "lower the second"),
                 tools::kExitUsage);
  }
  const double drain_seconds = seconds_flag("drain_seconds", absl::GetFlag(FLAGS_drain_seconds));
  const double drain_notice_seconds =
      seconds_flag("drain_notice_seconds", absl::GetFlag(FLAGS_drain_notice_seconds));
  const double state_check_seconds =
      seconds_flag("state_check_seconds", absl::GetFlag(FLAGS_state_check_seconds));
  int plan_threads = absl::GetFlag(FLAGS_plan_threads);
  if (plan_threads < 0 || plan_threads > kMaxPlanThreads) {
    tools::Fatal(absl::StrCat("--plan_threads=", plan_threads, " is outside [0, ", kMaxPlanThreads,
                              "]; 0 takes the CPUs this process may use (at most 8)"),
                 tools::kExitUsage);
  }
  if (plan_threads == 0) plan_threads = std::min(tools::UsableCpus(), 8);
  PlanThreads planning(plan_threads);
  auto metrics_registry = std::make_shared<prometheus::Registry>();
  PlannerMetrics metrics(metrics_registry, max_rank_series, slow_rank_series);
  std::unique_ptr<prometheus::Exposer> exposer;
  try {  // prometheus-cpp reports a busy port by throwing
    exposer = std::make_unique<prometheus::Exposer>(metrics_listen);
  } catch (const std::exception& e) {
    std::cerr << "sb-planner: cannot serve metrics on --metrics_listen=" << metrics_listen << ": "
              << e.what() << "\n";
    return 1;
  }
  exposer->RegisterCollectable(metrics_registry);
  metrics.SetJobStateLimit(max_job_state_bytes);
  // Each job's bytes in --state_dir as its writes change them (the restored ones are set below).
  (*store)->set_job_bytes_observer([&metrics](const std::string& job_id, int64_t bytes) {
    metrics.SetJobStateBytes(job_id, bytes);
  });

  // Health follows the state directory (StateDirHealth); its probes start once the servers do,
  // and a store failure before that (Restore's) turns health NOT_SERVING at the first round.
  std::unique_ptr<grpc::Server> server;
  std::unique_ptr<grpc::Server> health_server;
  auto set_serving = [&server, &health_server, &metrics](bool serving) {
    server->GetHealthCheckService()->SetServingStatus(kServiceName, serving);
    if (health_server != nullptr) {
      health_server->GetHealthCheckService()->SetServingStatus(kServiceName, serving);
    }
    metrics.SetStateDirWritable(serving);
  };
  StateDirHealth state_health(store->get(), std::max(0.1, state_check_seconds), set_serving);
  JobRegistry::Options registry_options;
  registry_options.store = store->get();
  // Only store failures come here: a job's quota refusal (JOB_STATE_QUOTA) leaves health alone.
  registry_options.on_store_failure = [&metrics, &state_health,
                                       &store](const absl::Status& failure) {
    metrics.ObserveStateWriteFailure();
    state_health.OnStoreFailure(failure, (*store)->TakeFailedWriteBytes());
  };
  registry_options.on_fold_failure = [&metrics](const std::string& job_id, int64_t step,
                                                const absl::Status& why) {
    metrics.ObserveUnfoldedStep();
    std::cerr << "sb-planner: job " << job_id << ": step " << step
              << " could not be folded into the latency model (kept): " << why.message()
              << std::endl;
  };
  registry_options.on_step = [&metrics](const std::string& job_id, const StepStats& stats) {
    metrics.ObserveStep(job_id, stats);
  };
  registry_options.max_jobs = max_jobs;
  registry_options.plan_threads = &planning;
  registry_options.pack_in_submit = false;  // the service packs after waking the ranks
  registry_options.limits.max_samples = max_samples;
  registry_options.limits.max_world_size = max_world_size;
  JobRegistry registry(registry_options, RandomHex);
  if (absl::Status restored = registry.Restore(); !restored.ok()) {
    std::cerr << "sb-planner: cannot reload --state_dir=" << state_dir << ": " << restored.message()
              << "\n";
    return 1;
  }
  const std::vector<JobView> failed_jobs = registry.failed_jobs();
  for (const JobView& failed : failed_jobs) {
    std::cerr << "sb-planner: job " << failed.job_id
              << " could not be loaded and is not served (quarantined in " << state_dir
              << "/quarantine/" << failed.job_id << "; DeleteJob removes it): " << failed.failure
              << std::endl;
  }
  metrics.SetFailedJobs(static_cast<int>(failed_jobs.size()));
  for (const std::string& job_id : registry.job_ids()) {
    metrics.AddJob(job_id);
    metrics.SetJobStateBytes(job_id, (*store)->JobBytes(job_id));
  }
  const size_t jobs = static_cast<size_t>(registry.job_count());
  PlannerServiceImpl::Options service_options;
  service_options.admin_token = admin_token;
  service_options.limits = registry_options.limits;
  service_options.metrics = &metrics;
  service_options.max_waiting_calls = max_waiting_calls;
  service_options.max_report_streams = max_report_streams;
  service_options.max_request_memory_bytes = static_cast<size_t>(max_request_memory_mb) << 20;
  PlannerServiceImpl service(&registry, service_options);
  IdleJobSweeper sweeper(&service, idle_ttl);

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  // gRPC receives each request whole before the planner sees it (and checks its caller): its
  // buffers, all connections together, are bounded by this quota, whose reclaimer cancels calls
  // once they pass it. Not shared with the health-only listener, so that an attack on this port
  // never cancels the probes.
  grpc::ResourceQuota transport_quota("sb-planner");
  transport_quota.Resize(static_cast<size_t>(max_transport_memory_mb) << 20);
  grpc::ServerBuilder builder;
  builder.SetResourceQuota(transport_quota);
  int port = 0;
  builder.AddListeningPort(listen, *credentials, &port);
  builder.RegisterService(&service);
  builder.SetMaxReceiveMessageSize(max_message_bytes);
  // Keepalive: ping idle clients every 30 s and accept their pings every 10 s, so that dead
  // trainers' connections are noticed and live ones are not cut by middleboxes.
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, 30000);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 10000);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 10000);
  server = builder.BuildAndStart();
  if (server == nullptr || port == 0) {
    std::cerr << "sb-planner: cannot listen on --listen=" << listen
              << " (address in use or not local?)\n";
    return 1;
  }
  server->GetHealthCheckService()->SetServingStatus(kServiceName, true);
  // The health-only listener: a second server that registers nothing but the default health
  // service (enabled above for every server). kServiceName follows the main one (readiness);
  // "" (the default service's own entry, SERVING) stays so until the process exits, since this
  // server closes only after the drain (liveness: a drain is not a crash).
  int health_port = 0;
  grpc::ResourceQuota health_quota("sb-planner-health");
  health_quota.Resize(kHealthQuotaBytes);
  if (!health_listen.empty()) {
    grpc::ServerBuilder health_builder;
    health_builder.SetResourceQuota(health_quota);
    health_builder.SetMaxReceiveMessageSize(kMaxHealthRequestBytes);
    health_builder.AddListeningPort(health_listen, grpc::InsecureServerCredentials(), &health_port);
    health_server = health_builder.BuildAndStart();
    if (health_server == nullptr || health_port == 0) {
      std::cerr << "sb-planner: cannot listen on --health_listen=" << health_listen << "\n";
      server->Shutdown();
      return 1;
    }
    health_server->GetHealthCheckService()->SetServingStatus(kServiceName, true);
  }
  state_health.Start();
  sweeper.Start();
  const std::string host = listen.substr(0, listen.rfind(':'));
  std::cout << "sb-planner: listening on " << host << ":" << port
            << (absl::GetFlag(FLAGS_tls_cert).empty() ? " (plaintext)" : " (TLS)")
            << "; health service " << kServiceName << "; state in " << state_dir << " (" << jobs
            << " jobs reloaded); metrics on http://"
            << metrics_listen.substr(0, metrics_listen.rfind(':')) << ":"
            << exposer->GetListeningPorts().front() << "/metrics; planning on " << planning.size()
            << (planning.size() == 1 ? " thread" : " threads") << std::endl;
  if (health_server != nullptr) {
    std::cout << "sb-planner: health only (plaintext) on "
              << health_listen.substr(0, health_listen.rfind(':')) << ":" << health_port
              << std::endl;
  }

  int signal = 0;
  sigwait(&stop_signals, &signal);
  std::cout << "sb-planner: " << (signal == SIGTERM ? "SIGTERM" : "SIGINT") << ", draining for "
            << drain_seconds << " s" << std::endl;
  state_health.Stop();  // health stays NOT_SERVING from here on
  sweeper.Stop();       // no job expires during the drain
  server->GetHealthCheckService()->SetServingStatus(kServiceName, false);
  if (health_server != nullptr) {
    health_server->GetHealthCheckService()->SetServingStatus(kServiceName, false);
  }
  // New calls are still accepted for the notice, so health checks see NOT_SERVING; then the
  // port closes and the calls in flight get the rest of the drain.
  const double drain = drain_seconds;
  const double notice = std::clamp(drain_notice_seconds, 0.0, drain);
  absl::SleepFor(absl::Seconds(notice));
  const auto deadline = std::chrono::system_clock::now() +
                        std::chrono::milliseconds(static_cast<int64_t>((drain - notice) * 1000));
  // Report streams end between reports (their clients go on by unary ReportStep calls, which
  // are refused from here on like any new call); the shutdown would otherwise wait on them.
  service.CloseReportStreams();
  server->Shutdown(deadline);
  server->Wait();
  // Only now does the health-only listener close: probes of "" on it pass for the whole drain.
  if (health_server != nullptr) {
    health_server->Shutdown(std::chrono::system_clock::now());
    health_server->Wait();
  }
  StopMetricsEndpoint(std::move(exposer), metrics_address);
  std::cout << "sb-planner: stopped" << std::endl;
  return 0;
}

}  // namespace
}  // namespace sparsebalance

int main(int argc, char** argv) { return sparsebalance::Main(argc, argv); }
