// ThreadSanitizer's view of abseil's synchronization, for scripts/tsan.sh. Debian's shared
// libabsl is built without ThreadSanitizer, so absl::Mutex, CondVar and Notification do their
// work in code TSan cannot see: every member that a Mutex guards would be reported as a race.
// This library, preloaded (LD_PRELOAD) into a -fsanitize=thread binary, defines their entry
// points itself: each calls the library's own (dlsym RTLD_NEXT) and tells TSan the
// happens-before edge it makes (a lock acquires the mutex's address, an unlock releases it, a
// wait releases and then acquires it, Notify releases what WaitForNotification acquires).
// Conditions are evaluated inside the library with the mutex held, by the waiting thread or by
// the one unlocking; their reads are left out (AnnotateIgnore*), as TSan cannot order them.
#include <dlfcn.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"

extern "C" {
void __tsan_acquire(void* addr);
void __tsan_release(void* addr);
void AnnotateIgnoreReadsBegin(const char* file, int line);
void AnnotateIgnoreReadsEnd(const char* file, int line);
void AnnotateIgnoreWritesBegin(const char* file, int line);
void AnnotateIgnoreWritesEnd(const char* file, int line);
}

namespace {

#define SB_STR2(x) #x
#define SB_STR(x) SB_STR2(x)

// The library's definition of absl::[inline namespace::]<rest> by its mangled name: `head` is
// "_ZN" for a member ("_ZNK" for a const one), `rest` the mangled tail after the namespaces
// (e.g. "5Mutex4LockEv").
void* Real(const char* head, const char* rest) {
#if ABSL_OPTION_USE_INLINE_NAMESPACE
  const std::string ns = SB_STR(ABSL_OPTION_INLINE_NAMESPACE_NAME);
  const std::string name = std::string(head) + "4absl" + std::to_string(ns.size()) + ns + rest;
#else
  const std::string name = std::string(head) + "4absl" + rest;
#endif
  void* p = dlsym(RTLD_NEXT, name.c_str());
  if (p == nullptr) {
    std::fprintf(stderr, "absl_sync_tsan: %s is not in the loaded libraries\n", name.c_str());
    std::abort();
  }
  return p;
}

#define SB_REAL(type, head, rest) static const auto real = reinterpret_cast<type>(Real(head, rest))

// Accesses inside the library's call, made with the mutex held (conditions), are ignored.
struct IgnoreAccesses {
  IgnoreAccesses() {
    AnnotateIgnoreReadsBegin(__FILE__, __LINE__);
    AnnotateIgnoreWritesBegin(__FILE__, __LINE__);
  }
  ~IgnoreAccesses() {
    AnnotateIgnoreWritesEnd(__FILE__, __LINE__);
    AnnotateIgnoreReadsEnd(__FILE__, __LINE__);
  }
};

// The library's `call` as TSan should see a wait on `mu`: with `give_up`, the mutex released
// before it (Await, a CondVar's wait); acquired after it; the accesses inside it ignored.
template <typename Mu, typename Call>
auto AsWait(Mu* mu, bool give_up, Call call) {
  if (give_up) __tsan_release(mu);
  struct AcquireAfter {
    Mu* mu;
    ~AcquireAfter() { __tsan_acquire(mu); }
  } acquire{mu};
  IgnoreAccesses ignore;  // ends before `acquire`
  return call();
}

}  // namespace

namespace absl {
ABSL_NAMESPACE_BEGIN

void Mutex::Lock() {
  SB_REAL(void (*)(Mutex*), "_ZN", "5Mutex4LockEv");
  real(this);
  __tsan_acquire(this);
}
void Mutex::ReaderLock() {
  SB_REAL(void (*)(Mutex*), "_ZN", "5Mutex10ReaderLockEv");
  real(this);
  __tsan_acquire(this);
}
bool Mutex::TryLock() {
  SB_REAL(bool (*)(Mutex*), "_ZN", "5Mutex7TryLockEv");
  const bool locked = real(this);
  if (locked) __tsan_acquire(this);
  return locked;
}
bool Mutex::ReaderTryLock() {
  SB_REAL(bool (*)(Mutex*), "_ZN", "5Mutex13ReaderTryLockEv");
  const bool locked = real(this);
  if (locked) __tsan_acquire(this);
  return locked;
}
// The unlocking thread evaluates the waiters' conditions inside the library, the mutex still
// held: after the release, as TSan sees it, so those reads are ignored.
void Mutex::Unlock() {
  SB_REAL(void (*)(Mutex*), "_ZN", "5Mutex6UnlockEv");
  __tsan_release(this);
  IgnoreAccesses ignore;
  real(this);
}
void Mutex::ReaderUnlock() {
  SB_REAL(void (*)(Mutex*), "_ZN", "5Mutex12ReaderUnlockEv");
  __tsan_release(this);
  IgnoreAccesses ignore;
  real(this);
}
void Mutex::LockWhen(const Condition& cond) {
  SB_REAL(void (*)(Mutex*, const Condition&), "_ZN", "5Mutex8LockWhenERKNS0_9ConditionE");
  AsWait(this, false, [&] { real(this, cond); });
}
bool Mutex::LockWhenWithTimeout(const Condition& cond, Duration timeout) {
  SB_REAL(bool (*)(Mutex*, const Condition&, Duration), "_ZN",
          "5Mutex19LockWhenWithTimeoutERKNS0_9ConditionENS0_8DurationE");
  return AsWait(this, false, [&] { return real(this, cond, timeout); });
}
bool Mutex::LockWhenWithDeadline(const Condition& cond, Time deadline) {
  SB_REAL(bool (*)(Mutex*, const Condition&, Time), "_ZN",
          "5Mutex20LockWhenWithDeadlineERKNS0_9ConditionENS0_4TimeE");
  return AsWait(this, false, [&] { return real(this, cond, deadline); });
}
void Mutex::Await(const Condition& cond) {
  SB_REAL(void (*)(Mutex*, const Condition&), "_ZN", "5Mutex5AwaitERKNS0_9ConditionE");
  AsWait(this, true, [&] { real(this, cond); });
}
bool Mutex::AwaitWithTimeout(const Condition& cond, Duration timeout) {
  SB_REAL(bool (*)(Mutex*, const Condition&, Duration), "_ZN",
          "5Mutex16AwaitWithTimeoutERKNS0_9ConditionENS0_8DurationE");
  return AsWait(this, true, [&] { return real(this, cond, timeout); });
}
bool Mutex::AwaitWithDeadline(const Condition& cond, Time deadline) {
  SB_REAL(bool (*)(Mutex*, const Condition&, Time), "_ZN",
          "5Mutex17AwaitWithDeadlineERKNS0_9ConditionENS0_4TimeE");
  return AsWait(this, true, [&] { return real(this, cond, deadline); });
}
void CondVar::Wait(Mutex* mu) {
  SB_REAL(void (*)(CondVar*, Mutex*), "_ZN", "7CondVar4WaitEPNS0_5MutexE");
  AsWait(mu, true, [&] { real(this, mu); });
}
bool CondVar::WaitWithTimeout(Mutex* mu, Duration timeout) {
  SB_REAL(bool (*)(CondVar*, Mutex*, Duration), "_ZN",
          "7CondVar15WaitWithTimeoutEPNS0_5MutexENS0_8DurationE");
  return AsWait(mu, true, [&] { return real(this, mu, timeout); });
}
bool CondVar::WaitWithDeadline(Mutex* mu, Time deadline) {
  SB_REAL(bool (*)(CondVar*, Mutex*, Time), "_ZN",
          "7CondVar16WaitWithDeadlineEPNS0_5MutexENS0_4TimeE");
  return AsWait(mu, true, [&] { return real(this, mu, deadline); });
}
void Notification::Notify() {
  SB_REAL(void (*)(Notification*), "_ZN", "12Notification6NotifyEv");
  __tsan_release(this);
  real(this);
}
void Notification::WaitForNotification() const {
  SB_REAL(void (*)(const Notification*), "_ZNK", "12Notification19WaitForNotificationEv");
  real(this);
  __tsan_acquire(const_cast<Notification*>(this));
}
bool Notification::WaitForNotificationWithTimeout(Duration timeout) const {
  SB_REAL(bool (*)(const Notification*, Duration), "_ZNK",
          "12Notification30WaitForNotificationWithTimeoutENS0_8DurationE");
  const bool notified = real(this, timeout);
  if (notified) __tsan_acquire(const_cast<Notification*>(this));
  return notified;
}
bool Notification::WaitForNotificationWithDeadline(Time deadline) const {
  SB_REAL(bool (*)(const Notification*, Time), "_ZNK",
          "12Notification31WaitForNotificationWithDeadlineENS0_4TimeE");
  const bool notified = real(this, deadline);
  if (notified) __tsan_acquire(const_cast<Notification*>(this));
  return notified;
}

ABSL_NAMESPACE_END
}  // namespace absl
