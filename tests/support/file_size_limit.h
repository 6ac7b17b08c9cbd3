// A file size limit (RLIMIT_FSIZE) for the life of a scope: a write past it lands in part and
// then fails with EFBIG, which is how the store tests make an append fail midway, without
// privileges or a full disk. SIGXFSZ, which the limit would otherwise raise, is ignored meanwhile.
//
//   {
//     test_support::FileSizeLimit limit(4096);
//     EXPECT_FALSE(store->AppendReport(...).ok());
//   }  // the limit and the signal's handler as they were
#ifndef SPARSEBALANCE_TESTS_SUPPORT_FILE_SIZE_LIMIT_H_
#define SPARSEBALANCE_TESTS_SUPPORT_FILE_SIZE_LIMIT_H_

#include <sys/resource.h>

#include <csignal>
#include <cstdint>

#include "gtest/gtest.h"

namespace sparsebalance::test_support {

class FileSizeLimit {
 public:
  explicit FileSizeLimit(int64_t bytes) {
    EXPECT_EQ(getrlimit(RLIMIT_FSIZE, &saved_), 0);
    saved_handler_ = signal(SIGXFSZ, SIG_IGN);
    struct rlimit limit = saved_;
    limit.rlim_cur = static_cast<rlim_t>(bytes);
    EXPECT_EQ(setrlimit(RLIMIT_FSIZE, &limit), 0);
  }
  ~FileSizeLimit() {
    setrlimit(RLIMIT_FSIZE, &saved_);
    signal(SIGXFSZ, saved_handler_);
  }
  FileSizeLimit(const FileSizeLimit&) = delete;
  FileSizeLimit& operator=(const FileSizeLimit&) = delete;

 private:
  struct rlimit saved_ {};
  void (*saved_handler_)(int) = nullptr;
};

}  // namespace sparsebalance::test_support

#endif  // SPARSEBALANCE_TESTS_SUPPORT_FILE_SIZE_LIMIT_H_
