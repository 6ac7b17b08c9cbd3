// A real small disk for tests of full and read-only state directories: a tmpfs of `size`
// mounted on a fresh folder for as long as the object lives (unmounted in every path, lazily,
// so a test that fails with files open still cleans up). Needs root or CAP_SYS_ADMIN; when
// mounting is refused, mounted() is false and error() says why (tests GTEST_SKIP with it).
//
//   TmpfsMount disk("4m");
//   if (!disk.mounted()) GTEST_SKIP() << disk.error();
//   ... state in disk.path() ...; disk.Remount(/*read_only=*/true);
#ifndef SPARSEBALANCE_TESTS_SERVER_TMPFS_MOUNT_H_
#define SPARSEBALANCE_TESTS_SERVER_TMPFS_MOUNT_H_

#include <sys/mount.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace sparsebalance::test_support {

class TmpfsMount {
 public:
  // `size` as mount(8) takes it: "256k", "4m", or bytes.
  explicit TmpfsMount(const std::string& size) : options_("size=" + size + ",mode=0700") {
    std::string pattern = ::testing::TempDir() + "sb_tmpfs_XXXXXX";
    if (mkdtemp(pattern.data()) == nullptr) {
      error_ = std::strerror(errno);
      return;
    }
    path_ = pattern;
    if (mount("tmpfs", path_.c_str(), "tmpfs", MS_NOSUID | MS_NODEV, options_.c_str()) == 0) {
      mounted_ = true;
    } else {
      error_ = absl::StrCat("mount -t tmpfs ", path_, ": ", std::strerror(errno),
                            " (needs root or CAP_SYS_ADMIN)");
    }
  }
  ~TmpfsMount() {
    if (mounted_ && umount2(path_.c_str(), 0) != 0) umount2(path_.c_str(), MNT_DETACH);
    if (!path_.empty()) rmdir(path_.c_str());
  }
  TmpfsMount(const TmpfsMount&) = delete;
  TmpfsMount& operator=(const TmpfsMount&) = delete;

  bool mounted() const { return mounted_; }
  const std::string& error() const { return error_; }
  const std::string& path() const { return path_; }
  // Read-only or writable again. Fails (EBUSY) while a file on it is open for writing.
  bool Remount(bool read_only) {
    return mount("tmpfs", path_.c_str(), "tmpfs",
                 MS_REMOUNT | MS_NOSUID | MS_NODEV | (read_only ? MS_RDONLY : 0),
                 options_.c_str()) == 0;
  }

 private:
  const std::string options_;
  std::string path_;
  std::string error_;
  bool mounted_ = false;
};

}  // namespace sparsebalance::test_support

#endif  // SPARSEBALANCE_TESTS_SERVER_TMPFS_MOUNT_H_
