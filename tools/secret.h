// Secrets shared by the planner (job tokens) and the CPU workers (the step-sync secret, which
// sb-run draws per run): random hex from the kernel's CSPRNG, and a comparison whose time does
// not depend on where two strings first differ, so that timing a refusal does not reveal a
// secret byte by byte.
//
//   absl::StatusOr<std::string> secret = tools::RandomHex(64);  // 32 random bytes
//   if (!tools::ConstantTimeEquals(offered, *secret)) ... refuse ...
#ifndef SPARSEBALANCE_TOOLS_SECRET_H_
#define SPARSEBALANCE_TOOLS_SECRET_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace sparsebalance::tools {

// `n` lower-case hex digits (n / 2 random bytes, rounded up) from /dev/urandom; INTERNAL when
// it cannot be read.
absl::StatusOr<std::string> RandomHex(int n);

// Whether `a` and `b` are equal, in time that depends on their length only (the length of a
// token is not secret; its bytes are).
bool ConstantTimeEquals(absl::string_view a, absl::string_view b);

}  // namespace sparsebalance::tools

#endif  // SPARSEBALANCE_TOOLS_SECRET_H_
