// Preloaded (LD_PRELOAD) into sb-planner by sb_planner_test to fail one fsync when the test
// chooses: while the file named by $SB_FAIL_FOLDER_FSYNC exists, the next fsync of a folder
// fails with EIO, and while the one named by $SB_FAIL_FILE_FSYNC exists, the next fsync of a
// regular file does; each file is removed as its failure is injected (once per file the test
// creates). Every other fsync is the C library's.
#include <dlfcn.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>

namespace {

// True when the fault armed by the file $`variable` names applies now (and disarms it).
bool Armed(const char* variable) {
  const char* path = std::getenv(variable);
  return path != nullptr && unlink(path) == 0;
}

}  // namespace

extern "C" int fsync(int fd) {
  using Fsync = int (*)(int);
  static const Fsync real = reinterpret_cast<Fsync>(dlsym(RTLD_NEXT, "fsync"));
  struct stat st;
  if (fstat(fd, &st) == 0 && ((S_ISDIR(st.st_mode) && Armed("SB_FAIL_FOLDER_FSYNC")) ||
                              (S_ISREG(st.st_mode) && Armed("SB_FAIL_FILE_FSYNC")))) {
    errno = EIO;
    return -1;
  }
  return real(fd);
}
