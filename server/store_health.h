// Whether sb-planner's readiness (grpc.health.v1 for its service) and its
// sparsebalance_state_dir_writable gauge say the state directory can be written, from what the
// store's writes and probes found. Pure logic: the caller passes the time in, runs the probes
// (PlanStore::CheckWritable) and publishes serving() (sb-planner's StateDirHealth, main.cc).
//
// The rule: NOT_SERVING from the moment a write of the store fails (a store failure: disk
// full, I/O error, read-only; never a job's quota refusal) or a probe fails. SERVING again only
// through a probe that writes and fsyncs at least as many bytes as the largest write that failed
// since health was last SERVING (at most kMaxProbeBytes), started at least kHold after the last
// failure, and with no failure while it ran; where that write was larger than the probe, the
// file system must also say that it has room for all of it (PlanStore::CheckWritable's
// `free_bytes`: a 16 MiB probe passed where 40 MB step records failed, and health turned
// SERVING between each step's failures). A 23-byte probe succeeded on a disk that refused
// every step record (8 KiB free, or fsync failing on step files alone) and turned health
// SERVING again between the failures; while the trainers keep writing and failing, each failure
// restarts the hold, and an idle planner whose disk was freed comes back with its next probe.
//
//   StoreHealth health;
//   health.OnStoreFailure(absl::Now(), /*bytes=*/150000);          // serving() is false
//   if (std::optional<StoreHealth::Probe> p = health.NextProbe(absl::Now())) {
//     health.OnProbe(*p, store->CheckWritable(p->bytes).ok());    // serving() again when ok
//   }
#ifndef SPARSEBALANCE_SERVER_STORE_HEALTH_H_
#define SPARSEBALANCE_SERVER_STORE_HEALTH_H_

#include <algorithm>
#include <cstdint>
#include <optional>

#include "absl/time/time.h"

namespace sparsebalance {

class StoreHealth {
 public:
  // A probe after a failure is at least this far from it: on a disk that refuses every real
  // write but not the probe, health does not turn SERVING between writes a second apart.
  static constexpr absl::Duration kHold = absl::Seconds(1);
  // The largest probe (bytes): a step record of 2^20 samples takes some 40 MB, and a probe that
  // large every second on a failing disk would take the room real writes need.
  static constexpr int64_t kMaxProbeBytes = int64_t{16} << 20;

  // A probe to run: PlanStore::CheckWritable(bytes), then OnProbe with it.
  struct Probe {
    int64_t bytes = 0;
    // The failed write's size where it exceeds `bytes` (else 0): the room the file system must
    // report free (PlanStore::CheckWritable's free_bytes).
    int64_t free_bytes = 0;
    int64_t failures = 0;  // failures noted when it was handed out
  };

  bool serving() const { return serving_; }
  // While NOT_SERVING: the bytes of the probe that can turn it SERVING (0: the smallest).
  int64_t probe_bytes() const { return std::min(kMaxProbeBytes, failed_bytes_); }

  // A write of `bytes` (0: unknown) to the state directory failed at `now`: NOT_SERVING.
  void OnStoreFailure(absl::Time now, int64_t bytes);
  // The probe to run at `now`, or none while NOT_SERVING within kHold of the last failure.
  // While SERVING it is the smallest (bytes 0).
  std::optional<Probe> NextProbe(absl::Time now) const;
  // The result of `probe` (taken from NextProbe) that ended at `now`. A failed probe counts as a
  // failure of 0 bytes; a successful one turns health SERVING unless a failure came after the
  // probe was handed out.
  void OnProbe(const Probe& probe, bool ok, absl::Time now);

 private:
  bool serving_ = true;
  int64_t failures_ = 0;      // failures noted, ever
  int64_t failed_bytes_ = 0;  // the largest failed write since SERVING
  absl::Time last_failure_ = absl::InfinitePast();
};

}  // namespace sparsebalance

#endif  // SPARSEBALANCE_SERVER_STORE_HEALTH_H_
