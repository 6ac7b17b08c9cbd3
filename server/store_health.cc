#include "server/store_health.h"

#include <algorithm>

namespace sparsebalance {

void StoreHealth::OnStoreFailure(absl::Time now, int64_t bytes) {
  serving_ = false;
  ++failures_;
  failed_bytes_ = std::max(failed_bytes_, bytes);
  last_failure_ = std::max(last_failure_, now);
}

std::optional<StoreHealth::Probe> StoreHealth::NextProbe(absl::Time now) const {
  if (serving_) return Probe{0, 0, failures_};
  if (now - last_failure_ < kHold) return std::nullopt;
  const int64_t bytes = probe_bytes();
  return Probe{bytes, failed_bytes_ > bytes ? failed_bytes_ : 0, failures_};
}

void StoreHealth::OnProbe(const Probe& probe, bool ok, absl::Time now) {
  if (!ok) {
    OnStoreFailure(now, 0);
    return;
  }
  if (serving_ || probe.failures != failures_) return;
  serving_ = true;
  failed_bytes_ = 0;
}

}  // namespace sparsebalance
