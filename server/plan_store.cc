#include "server/plan_store.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <set>

#include "absl/functional/function_ref.h"
#include "absl/strings/ascii.h"
#include "absl/strings/cord.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "google/protobuf/arena.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "planner/plan_threads.h"
#include "server/crc32c.h"
#include "server/state_codec.h"

namespace sparsebalance {
namespace {

constexpr absl::string_view kStorePrefix = "state_dir: ";
// The first bytes of every report record. As a little-endian length (the previous format) it
// would be some 3 GB, which no report ever was: a log starting with it is in the new format.
constexpr char kMagicBytes[4] = {'\xE2', '\x9C', '\x53', '\xB7'};
constexpr absl::string_view kMagic(kMagicBytes, 4);
constexpr size_t kHeaderBytes = 12;                  // magic, length, crc
constexpr uint32_t kMaxRecordBytes = 64 << 20;       // a report body, far above any real one
constexpr int64_t kMaxFileBytes = int64_t{1} << 30;  // a file the loader reads whole
constexpr int kMaxRemoveDepth = 8;  // job folders are flat; deeper trees are not ours
constexpr absl::string_view kQuarantine = "quarantine";
constexpr absl::string_view kDeletedPrefix = ".deleted-";
constexpr absl::string_view kTmpSuffix = ".tmp";
// A dropped step's file, kept in its job's folder for the next step saved there to write over
// (DropStep, SaveStep): writing over pages the page cache still holds costs a fraction of
// filling new ones. On the 2-core VM this project is measured on, a 4.3 MB step record (65,536
// samples) took 36-53 ms to write into a new file and 1.5-2.5 ms over an old one; a new page
// costs a hypervisor fault there. Its name ends in kTmpSuffix: never loaded, swept at the next
// start.
constexpr absl::string_view kSpareStepName = "spare-step.pb.tmp";
// Writes through a buffer of this size when a file's bytes are produced as they are written.
constexpr int kStreamBufferBytes = 256 << 10;

absl::Status IoFailure(absl::string_view what, absl::string_view path, int err) {
  const absl::StatusCode code = err == ENOSPC || err == EDQUOT || err == EFBIG
                                    ? absl::StatusCode::kResourceExhausted
                                    : absl::StatusCode::kInternal;
  return StoreFailure(code, absl::StrCat(what, " ", path, ": ", std::strerror(err)));
}

// `status` with `more` appended to its message, its code and payloads (the store-failure reason)
// kept.
absl::Status WithMore(const absl::Status& status, absl::string_view more) {
  return WithMessage(status, absl::StrCat(status.message(), more));
}

bool IsFolder(const std::string& path) {
  struct stat st;
  return lstat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

bool IsGone(const std::string& path) {
  struct stat st;
  return lstat(path.c_str(), &st) != 0 && errno == ENOENT;
}

absl::StatusOr<std::vector<std::string>> ListDir(const std::string& path) {
  DIR* d = opendir(path.c_str());
  if (d == nullptr) return IoFailure("cannot list", path, errno);
  std::vector<std::string> names;
  while (true) {
    errno = 0;
    const dirent* e = readdir(d);
    if (e == nullptr) break;
    const absl::string_view name = e->d_name;
    if (name != "." && name != "..") names.emplace_back(name);
  }
  const int err = errno;
  closedir(d);
  if (err != 0) return IoFailure("cannot list", path, err);
  std::sort(names.begin(), names.end());
  return names;
}

// Opens and fsyncs the folder `path`: 0, or the errno of what failed (`*failed` names it).
int SyncDirOrErrno(const std::string& path, const char** failed) {
  const int fd = open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) {
    *failed = "cannot open";
    return errno;
  }
  int err = 0;
  if (fsync(fd) != 0) {
    err = errno;
    *failed = "cannot fsync";
  }
  close(fd);
  return err;
}

absl::Status SyncDir(const std::string& path) {
  const char* failed = "";
  const int err = SyncDirOrErrno(path, &failed);
  return err == 0 ? absl::OkStatus() : IoFailure(failed, path, err);
}

// Ends the process, exit code kExitStateDirSyncFailed, after one line on stderr naming what
// failed (`failed` on `path`, errno `err`) and the change already made in the state directory
// (`change`: a file renamed over another, a folder renamed away, a log's appended bytes).
//
// Why not answer the call with the error: its callers take an error for "nothing changed" and
// keep their old state in memory, while the directory holds the change and a restart loads it:
// a SubmitBatch refused, its step served as planned after the restart; a switch to the local
// plan refused, the local plan served after it, so that the reports of the ranks that ran the
// plan they were given are refused. Why not undo the change (keep the old file, rename it back
// when the sync fails): the undo is a change of the same folder whose sync can fail too, and
// after a failed fsync Linux may have dropped the dirty state it could not write and report
// the next fsync as a success (PostgreSQL's "fsyncgate", 2018), so no later sync proves that
// either version is on the disk. As PostgreSQL does since then, the planner stops instead and
// its restart rebuilds everything from what the directory holds: memory, disk and what callers
// see agree again. The call in flight sees UNAVAILABLE, an unknown outcome that clients already
// handle (repeating it is harmless: the same batch, report or config gets the answer the disk
// gives). _exit: no destructor or other thread writes anything after the line.
[[noreturn]] void ExitOnUnsyncedChange(absl::string_view failed, const std::string& path, int err,
                                       absl::string_view change) {
  const std::string line = absl::StrCat(
      "sb-planner: state_dir: ", failed, " ", path, ": ", std::strerror(err), " (errno ", err,
      ") after ", change,
      "; that change is in place but may not be durable, so the call that made it can be neither "
      "acknowledged nor refused: exiting with code ",
      kExitStateDirSyncFailed, " so that a restart serves what the state directory holds\n");
  size_t done = 0;
  while (done < line.size()) {
    const ssize_t n = write(STDERR_FILENO, line.data() + done, line.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    done += static_cast<size_t>(n);
  }
  _exit(kExitStateDirSyncFailed);
}

// Syncs the folder `dir` after `change` (a rename in it) was made; ends the process when that
// fails (ExitOnUnsyncedChange).
void SyncDirAfter(const std::string& dir, absl::string_view change) {
  const char* failed = "";
  if (const int err = SyncDirOrErrno(dir, &failed); err != 0) {
    ExitOnUnsyncedChange(failed, dir, err, change);
  }
}

// Writes all of `bytes`; 0, or the errno of the write that failed.
int WriteAllOrErrno(int fd, absl::string_view bytes) {
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return errno;
    if (n == 0) return EIO;
    done += static_cast<size_t>(n);
  }
  return 0;
}

absl::Status WriteAll(int fd, absl::string_view bytes, const std::string& path) {
  const int err = WriteAllOrErrno(fd, bytes);
  return err == 0 ? absl::OkStatus() : IoFailure("cannot write", path, err);
}

// How far WriteFileDurably makes a write survive a machine crash (a process crash leaves the
// old or the new file either way: the rename is atomic). The data is synced before the rename
// always: unsynced, a machine crash may leave the file renamed but never written (empty or
// zero-filled where the old one was, on XFS or ext4 without auto_da_alloc).
enum class Durability {
  // The folder not synced: after a machine crash the file is the old one or the new one, whole.
  kWholeFile,
  // The data and the folder synced: the new file, once the call returns.
  kDurable,
};

// Write to a temporary file, fsync it, rename it over `path`, fsync the folder where
// `durability` asks. A failed write removes its temporary file (on a full disk it holds space).
// `write` writes the contents at the start of `fd` and returns 0 or an errno. With `spare`, a
// file of that path (in `dir`) becomes the temporary file when there is one, written over and
// cut to its new length instead of created (kSpareStepName); `*spare_bytes` (when given) then
// receives its size, else 0: it is gone from its place whether the write succeeds or not.
absl::Status WriteFileDurably(const std::string& dir, const std::string& path,
                              Durability durability, const std::string* spare,
                              absl::FunctionRef<int(int fd)> write,
                              int64_t* spare_bytes = nullptr) {
  const std::string tmp = absl::StrCat(path, kTmpSuffix);
  int fd = -1;
  struct stat st;
  if (spare_bytes != nullptr) *spare_bytes = 0;
  if (spare != nullptr && lstat(spare->c_str(), &st) == 0 && S_ISREG(st.st_mode) &&
      rename(spare->c_str(), tmp.c_str()) == 0) {
    if (spare_bytes != nullptr) *spare_bytes = static_cast<int64_t>(st.st_size);
    fd = open(tmp.c_str(), O_WRONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
    if (fd < 0) unlink(tmp.c_str());  // replaced in between: start afresh
  }
  if (fd < 0) fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (fd < 0) return IoFailure("cannot create", tmp, errno);
  absl::Status status;
  if (const int err = write(fd); err != 0) status = IoFailure("cannot write", tmp, err);
  // A spare's old bytes past the new end go (a new file has none: the same call is harmless).
  if (status.ok()) {
    const off_t end = lseek(fd, 0, SEEK_CUR);
    if (end < 0 || ftruncate(fd, end) != 0) status = IoFailure("cannot truncate", tmp, errno);
  }
  if (status.ok() && fsync(fd) != 0) status = IoFailure("cannot fsync", tmp, errno);
  if (close(fd) != 0 && status.ok()) status = IoFailure("cannot close", tmp, errno);
  if (status.ok() && rename(tmp.c_str(), path.c_str()) != 0) {
    status = IoFailure(absl::StrCat("cannot rename ", tmp, " to"), path, errno);
  }
  if (!status.ok()) {
    unlink(tmp.c_str());
    return status;
  }
  // The new file is in place: from here on an error would tell the caller that nothing changed.
  if (durability == Durability::kDurable) {
    SyncDirAfter(dir, absl::StrCat("renaming ", tmp, " over ", path));
  }
  return absl::OkStatus();
}

absl::Status WriteFileDurably(const std::string& dir, const std::string& path,
                              absl::string_view bytes, Durability durability) {
  return WriteFileDurably(dir, path, durability, /*spare=*/nullptr,
                          [&](int fd) { return WriteAllOrErrno(fd, bytes); });
}

// The size of the regular file at `path` (never following a symlink); 0 when there is none.
int64_t FileBytes(const std::string& path) {
  struct stat st;
  if (lstat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) return 0;
  return static_cast<int64_t>(st.st_size);
}

// fstat of the open file `fd` (at `path`); on failure `fd` is closed.
absl::StatusOr<struct stat> StatOpenFile(int fd, const std::string& path) {
  struct stat st;
  if (fstat(fd, &st) == 0) return st;
  const int err = errno;
  close(fd);
  return IoFailure("cannot stat", path, err);
}

// The whole of a regular file (never a symlink, a FIFO or a device: opening those must not
// block or escape the directory).
absl::StatusOr<std::string> ReadFile(const std::string& path) {
  const int fd = open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) return IoFailure("cannot open", path, errno);
  absl::StatusOr<struct stat> st = StatOpenFile(fd, path);
  if (!st.ok()) return st.status();
  if (!S_ISREG(st->st_mode)) {
    close(fd);
    return absl::DataLossError(absl::StrCat(path, " is not a regular file"));
  }
  std::string out;
  out.reserve(static_cast<size_t>(std::min<int64_t>(st->st_size, kMaxFileBytes)));
  char buffer[1 << 16];
  while (true) {
    const ssize_t n = read(fd, buffer, sizeof(buffer));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int err = errno;
      close(fd);
      return IoFailure("cannot read", path, err);
    }
    if (n == 0) break;
    out.append(buffer, static_cast<size_t>(n));
    if (static_cast<int64_t>(out.size()) > kMaxFileBytes) {
      close(fd);
      return absl::DataLossError(absl::StrCat(path, " is larger than ", kMaxFileBytes,
                                              " bytes, more than the store writes"));
    }
  }
  close(fd);
  return out;
}

// Removes `name` inside the folder `parent_fd` (and all in it when it is a folder) without ever
// following a symlink: a symlink is unlinked itself, folders are opened with O_NOFOLLOW.
absl::Status RemoveTreeAt(int parent_fd, const std::string& name, const std::string& path,
                          int depth) {
  struct stat st;
  if (fstatat(parent_fd, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) {
    return errno == ENOENT ? absl::OkStatus() : IoFailure("cannot stat", path, errno);
  }
  if (!S_ISDIR(st.st_mode)) {
    if (unlinkat(parent_fd, name.c_str(), 0) != 0 && errno != ENOENT) {
      return IoFailure("cannot remove", path, errno);
    }
    return absl::OkStatus();
  }
  if (depth >= kMaxRemoveDepth) {
    return StoreFailure(absl::StatusCode::kInternal,
                        absl::StrCat("cannot remove ", path, ": folders nested deeper than ",
                                     kMaxRemoveDepth, " levels were not made by sb-planner"));
  }
  const int fd = openat(parent_fd, name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) return IoFailure("cannot open", path, errno);
  DIR* d = fdopendir(fd);
  if (d == nullptr) {
    const int err = errno;
    close(fd);
    return IoFailure("cannot list", path, err);
  }
  std::vector<std::string> names;
  while (const dirent* e = readdir(d)) {
    const absl::string_view entry = e->d_name;
    if (entry != "." && entry != "..") names.emplace_back(entry);
  }
  absl::Status status;
  for (const std::string& entry : names) {
    status.Update(RemoveTreeAt(dirfd(d), entry, absl::StrCat(path, "/", entry), depth + 1));
  }
  closedir(d);  // closes fd
  if (!status.ok()) return status;
  if (unlinkat(parent_fd, name.c_str(), AT_REMOVEDIR) != 0 && errno != ENOENT) {
    return IoFailure("cannot remove", path, errno);
  }
  return absl::OkStatus();
}

absl::Status RemoveTree(const std::string& parent, const std::string& name) {
  const int fd = open(parent.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return errno == ENOENT ? absl::OkStatus() : IoFailure("cannot open", parent, errno);
  absl::Status status = RemoveTreeAt(fd, name, absl::StrCat(parent, "/", name), 0);
  close(fd);
  return status;
}

void PutLe32(char* out, uint32_t value) {
  for (int i = 0; i < 4; ++i) out[i] = static_cast<char>((value >> (8 * i)) & 0xff);
}

uint32_t GetLe32(const char* in) {
  uint32_t value = 0;
  for (int i = 0; i < 4; ++i) value |= uint32_t{static_cast<unsigned char>(in[i])} << (8 * i);
  return value;
}

// The checksum of a record: over its 4 length bytes and its body.
uint32_t RecordCrc(absl::string_view length_bytes, absl::string_view body) {
  return ~Crc32cExtend(Crc32cExtend(~uint32_t{0}, length_bytes), body);
}

// A framed record of `body`: magic, length and checksum, then the body serialized straight
// after them (no copy of it).
std::string EncodeRecord(const google::protobuf::MessageLite& body) {
  const size_t size = body.ByteSizeLong();
  std::string record(kHeaderBytes + size, '\0');
  body.SerializeWithCachedSizesToArray(reinterpret_cast<uint8_t*>(&record[kHeaderBytes]));
  std::memcpy(record.data(), kMagicBytes, 4);
  PutLe32(&record[4], static_cast<uint32_t>(size));
  PutLe32(&record[8], RecordCrc(absl::string_view(record).substr(4, 4),
                                absl::string_view(record).substr(kHeaderBytes)));
  return record;
}

// The frame of a whole-file record (job.pb, step-N.pb) whose body of `size` bytes has the
// checksum register `crc` (Crc32cExtend from ~0 over the 4 length bytes, then the body).
std::string FileFrame(uint32_t size, uint32_t crc) {
  std::string header(kHeaderBytes, '\0');
  std::memcpy(header.data(), kMagicBytes, 4);
  PutLe32(&header[4], size);
  PutLe32(&header[8], ~crc);
  return header;
}

// The CRC register (Crc32cExtend from ~0) over the length bytes of a body of `size` bytes.
uint32_t LengthCrc(uint32_t size) {
  char length[4];
  PutLe32(length, size);
  return Crc32cExtend(~uint32_t{0}, absl::string_view(length, 4));
}

// A protobuf output stream into `fd` that keeps the CRC32C register of what it wrote (SaveStep:
// a step record is checksummed as it is serialized into its file, never held whole in memory).
class ChecksummingFileStream : public google::protobuf::io::CopyingOutputStream {
 public:
  ChecksummingFileStream(int fd, uint32_t crc) : fd_(fd), crc_(crc) {}
  bool Write(const void* buffer, int size) override {
    const absl::string_view bytes(static_cast<const char*>(buffer), static_cast<size_t>(size));
    crc_ = Crc32cExtend(crc_, bytes);
    err_ = WriteAllOrErrno(fd_, bytes);
    return err_ == 0;
  }
  uint32_t crc() const { return crc_; }
  int err() const { return err_; }

 private:
  const int fd_;
  uint32_t crc_;
  int err_ = 0;
};

// The records of a report log, on an arena of their own: a 4,096-rank step's log is some 4,096
// records of dozens of small messages each, and parsing them into heap blocks of their own took
// 1.2 s more of the restore of a 4,096-rank job's 64 kept steps (sb-server-bench
// History/samples:65536/.../restart:1: 3.0 s against 1.8 for PlanStore::LoadAll).
struct ParsedLog {
  std::unique_ptr<google::protobuf::Arena> arena = std::make_unique<google::protobuf::Arena>();
  std::vector<const state::v1::ReportRecord*> reports;  // on `arena`, in log order
  int64_t skipped_bytes = 0;
  int framed = 0;  // records whose header and checksum held (parsed or not)
};

// The records of a log of framed records: take(body) for each that frames and checks, in
// order; it returns false for a body that does not parse (its bytes count as skipped). What
// does not frame or check is skipped up to the next magic word: the length of a damaged record
// is never trusted, so the records after it are found. Returns the bytes skipped; `framed`
// counts the records whose header and checksum held (parsed or not).
int64_t ScanFramedLog(absl::string_view log, absl::FunctionRef<bool(absl::string_view)> take,
                      int* framed) {
  int64_t skipped = 0;
  size_t at = 0;
  while (at < log.size()) {
    if (log.size() - at >= kHeaderBytes && log.substr(at, 4) == kMagic) {
      const uint32_t size = GetLe32(log.data() + at + 4);
      if (size <= kMaxRecordBytes && size <= log.size() - at - kHeaderBytes) {
        const absl::string_view body = log.substr(at + kHeaderBytes, size);
        if (GetLe32(log.data() + at + 8) == RecordCrc(log.substr(at + 4, 4), body)) {
          ++*framed;
          if (!take(body)) skipped += static_cast<int64_t>(kHeaderBytes + size);
          at += kHeaderBytes + size;
          continue;
        }
      }
    }
    size_t next = log.find(kMagic, at + 1);
    if (next == absl::string_view::npos) next = log.size();
    skipped += static_cast<int64_t>(next - at);
    at = next;
  }
  return skipped;
}

// A report log of framed records (ScanFramedLog).
ParsedLog ParseFramedLog(absl::string_view log) {
  ParsedLog out;
  out.skipped_bytes = ScanFramedLog(
      log,
      [&](absl::string_view body) {
        auto* report =
            google::protobuf::Arena::CreateMessage<state::v1::ReportRecord>(out.arena.get());
        if (!report->ParseFromArray(body.data(), static_cast<int>(body.size()))) return false;
        out.reports.push_back(report);
        return true;
      },
      &out.framed);
  return out;
}

// A log of the previous format: 4-byte little-endian length + body, read up to the first record
// that is torn or does not parse (without a magic word there is nothing to resynchronise on).
ParsedLog ParseLegacyLog(absl::string_view log) {
  ParsedLog out;
  size_t at = 0;
  while (log.size() - at >= 4) {
    const uint32_t size = GetLe32(log.data() + at);
    // A length of 0 ends the log too: a report always has a body, and a log that a machine
    // crash left zero-filled (its blocks allocated, its data never written) parsed as one empty
    // report of rank 0 per 4 bytes, which restore took as that rank's acknowledged report.
    if (size == 0 || size > log.size() - at - 4) break;
    auto* report = google::protobuf::Arena::CreateMessage<state::v1::ReportRecord>(out.arena.get());
    if (!report->ParseFromArray(log.data() + at + 4, static_cast<int>(size))) break;
    out.reports.push_back(report);
    at += 4 + size;
  }
  out.skipped_bytes = static_cast<int64_t>(log.size() - at);
  return out;
}

// Either format, told apart per file: framed when the log starts with the magic word or holds
// any record that checks (its first record may be the torn one), else the previous format.
ParsedLog ParseReportLog(absl::string_view log, bool* legacy) {
  ParsedLog framed = ParseFramedLog(log);
  *legacy = !log.empty() && !absl::StartsWith(log, kMagic) && framed.framed == 0;
  return *legacy ? ParseLegacyLog(log) : std::move(framed);
}

std::string StepPath(const std::string& job_dir, int64_t step, absl::string_view suffix) {
  return absl::StrCat(job_dir, "/step-", step, suffix);
}

// The job's spare step record (kSpareStepName).
std::string JoinsPath(const std::string& job_dir) { return job_dir + "/joins.log"; }

std::string SparePath(const std::string& job_dir) {
  return absl::StrCat(job_dir, "/", kSpareStepName);
}

absl::Status CheckJobId(absl::string_view id) {
  if (IsValidJobId(id)) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("job id \"", Quoted(id),
                   "\" is not 8 to 64 characters of [0-9a-z]; the state store refuses it"));
}

absl::Status CheckStep(int64_t step) {
  if (step >= 0) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("step ", step, " is negative"));
}

}  // namespace

absl::Status StoreFailure(absl::StatusCode code, absl::string_view message) {
  return WithErrorReason(absl::Status(code, absl::StrCat(kStorePrefix, message)),
                         kReasonStateDirFailure);
}

bool IsStoreFailure(const absl::Status& status) {
  return ErrorReason(status) == kReasonStateDirFailure;
}

absl::Status JobStateQuota(absl::string_view job_id, int64_t job_bytes, absl::string_view write,
                           int64_t max_job_bytes) {
  constexpr int64_t kMiB = int64_t{1} << 20;
  const std::string flag = max_job_bytes % kMiB == 0
                               ? absl::StrCat("--max_job_state_mb=", max_job_bytes / kMiB)
                               : std::string("--max_job_state_mb");
  return WithErrorReason(
      absl::ResourceExhaustedError(absl::StrCat(
          "job \"", Quoted(job_id), "\" keeps ", job_bytes, " bytes in the state directory; ",
          write, " would take it past its bound of ", max_job_bytes, " bytes (", flag,
          "): refused for this job alone, what it stored is kept. Make room by lowering its "
          "history (UpdateJobConfig history_steps) or deleting the job, or raise "
          "--max_job_state_mb")),
      kReasonJobStateQuota);
}

std::string FrameStateFile(absl::string_view body) {
  const uint32_t size = static_cast<uint32_t>(body.size());
  return absl::StrCat(FileFrame(size, Crc32cExtend(LengthCrc(size), body)), body);
}

absl::StatusOr<absl::string_view> StateFileBody(absl::string_view bytes, absl::string_view path,
                                                bool* legacy) {
  int magic = 0;
  for (size_t i = 0; i < 4 && i < bytes.size(); ++i) magic += bytes[i] == kMagicBytes[i];
  const bool length_fits =
      bytes.size() >= kHeaderBytes && GetLe32(bytes.data() + 4) == bytes.size() - kHeaderBytes;
  // A message of the previous format never starts with the magic word (its first byte is the
  // tag of a field numbered below 12) nor, but by a chance of 2^-32, holds its own size less 12
  // at bytes 4-7: a file with 3 of the magic's 4 bytes, or with its length right, is framed and
  // damaged when its frame does not check (one flipped bit anywhere is found).
  *legacy = magic < 3 && !length_fits;
  if (*legacy) return bytes;
  const auto damaged = [&](absl::string_view what) {
    return absl::DataLossError(
        absl::StrCat(path, " (", bytes.size(), " bytes) is damaged: ", what,
                     "; the file was changed after the planner wrote it (disk or copy fault)"));
  };
  if (bytes.size() < kHeaderBytes) return damaged("shorter than its header");
  if (magic != 4) return damaged("its magic word is wrong");
  if (!length_fits) {
    return damaged(absl::StrCat("its header says ", GetLe32(bytes.data() + 4),
                                " bytes of record, it holds ", bytes.size() - kHeaderBytes));
  }
  const absl::string_view body = bytes.substr(kHeaderBytes);
  if (GetLe32(bytes.data() + 8) != RecordCrc(bytes.substr(4, 4), body)) {
    return damaged("its CRC32C does not match its contents");
  }
  return body;
}

bool IsValidJobId(absl::string_view id) {
  if (id.size() < 8 || id.size() > 64 || id == kQuarantine) return false;
  return std::all_of(id.begin(), id.end(),
                     [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z'); });
}

absl::StatusOr<std::unique_ptr<PlanStore>> PlanStore::Open(const std::string& dir,
                                                           bool fsync_reports,
                                                           int64_t max_job_bytes) {
  if (dir.empty()) {
    return absl::InvalidArgumentError("state_dir: empty; pass a writable directory");
  }
  if (max_job_bytes < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_job_bytes: ", max_job_bytes, " is negative; 0 leaves jobs unbounded"));
  }
  if (mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST)
    return IoFailure("cannot create", dir, errno);
  struct stat st;
  if (stat(dir.c_str(), &st) != 0) return IoFailure("cannot stat", dir, errno);
  if (!S_ISDIR(st.st_mode)) {
    return StoreFailure(absl::StatusCode::kInternal,
                        absl::StrCat(dir, " is not a directory; pass a writable directory"));
  }
  // A directory that was there already keeps its mode: one the planner owns that others may
  // write into (0777, 0775) is made 0700, as the planner creates it (others could rename or
  // remove job folders, or plant one that the next start restores). One owned by another user
  // (a volume mounted with fsGroup) is left as it is; sb-planner warns when anyone may write it.
  if ((st.st_mode & (S_IRWXG | S_IRWXO)) != 0 && st.st_uid == geteuid() &&
      chmod(dir.c_str(), st.st_mode & (S_IRWXU | S_ISVTX)) != 0) {
    return IoFailure("cannot make private (chmod 0700)", dir, errno);
  }
  std::unique_ptr<PlanStore> store(new PlanStore(dir, fsync_reports, max_job_bytes));
  if (absl::Status s = store->CheckWritable(); !s.ok()) {
    return WithMore(s, absl::StrCat(" (sb-planner writes its state in ", dir,
                                    ": it must be a writable directory)"));
  }
  store->SweepAfterCrash();
  return store;
}

absl::Status PlanStore::CheckWritable(int64_t bytes, int64_t free_bytes) {
  // A unique name: concurrent probes must not remove each other's file; a crash leaves a
  // `*.tmp` that the next Open() sweeps.
  std::string path = absl::StrCat(dir_, "/.write-probe-XXXXXX", kTmpSuffix);
  const int fd = mkostemps(path.data(), static_cast<int>(kTmpSuffix.size()), O_CLOEXEC);
  if (fd < 0) return IoFailure("cannot create", path, errno);
  constexpr absl::string_view kText = "sb-planner write probe\n";
  absl::Status status = WriteAll(fd, kText, path);
  // Then zeros up to `bytes`, written (not allocated): the disk must take them as it takes a
  // record.
  static const std::string kZeros(kStreamBufferBytes, '\0');
  int64_t left = bytes - static_cast<int64_t>(kText.size());
  while (status.ok() && left > 0) {
    const size_t chunk = static_cast<size_t>(std::min<int64_t>(left, kStreamBufferBytes));
    status = WriteAll(fd, absl::string_view(kZeros.data(), chunk), path);
    left -= static_cast<int64_t>(chunk);
  }
  if (status.ok() && fsync(fd) != 0) status = IoFailure("cannot fsync", path, errno);
  if (close(fd) != 0 && status.ok()) status = IoFailure("cannot close", path, errno);
  if (unlink(path.c_str()) != 0 && status.ok()) status = IoFailure("cannot remove", path, errno);
  if (!status.ok() || free_bytes <= 0) return status;
  struct statvfs fs;
  if (statvfs(dir_.c_str(), &fs) != 0) return IoFailure("cannot statvfs", dir_, errno);
  // The blocks free to this process: root may write into the file system's reserve.
  const uint64_t blocks = geteuid() == 0 ? fs.f_bfree : fs.f_bavail;
  const unsigned __int128 room =
      static_cast<unsigned __int128>(blocks) * static_cast<unsigned __int128>(fs.f_frsize);
  if (room < static_cast<unsigned __int128>(free_bytes)) {
    return StoreFailure(
        absl::StatusCode::kResourceExhausted,
        absl::StrCat(dir_, " has ", static_cast<uint64_t>(room), " bytes free, less than the ",
                     free_bytes, " of a write that failed"));
  }
  return status;
}

int64_t PlanStore::TakeFailedWriteBytes() { return failed_write_bytes_.exchange(0); }

absl::Status PlanStore::NoteWrite(absl::Status status, int64_t bytes) {
  if (!IsStoreFailure(status)) return status;
  int64_t seen = failed_write_bytes_.load();
  while (seen < bytes && !failed_write_bytes_.compare_exchange_weak(seen, bytes)) {
  }
  return status;
}

void PlanStore::SweepAfterCrash() {
  // Best effort: what is left here is never loaded, only takes space.
  absl::StatusOr<std::vector<std::string>> names = ListDir(dir_);
  if (!names.ok()) return;
  for (const std::string& name : *names) {
    const std::string path = absl::StrCat(dir_, "/", name);
    struct stat st;
    if (lstat(path.c_str(), &st) != 0) continue;
    absl::string_view retired = name;
    if (S_ISREG(st.st_mode) && absl::EndsWith(name, kTmpSuffix)) {
      unlink(path.c_str());
    } else if (absl::ConsumePrefix(&retired, kDeletedPrefix) && IsValidJobId(retired)) {
      RemoveTree(dir_, name).IgnoreError();  // a RetireJob whose removal a crash cut short
    } else if (S_ISDIR(st.st_mode) && IsValidJobId(name)) {
      absl::StatusOr<std::vector<std::string>> files = ListDir(path);
      if (!files.ok()) continue;
      for (const std::string& file : *files) {
        const std::string file_path = absl::StrCat(path, "/", file);
        if (absl::EndsWith(file, kTmpSuffix) && lstat(file_path.c_str(), &st) == 0 &&
            S_ISREG(st.st_mode)) {
          unlink(file_path.c_str());
        }
      }
    }
  }
}

std::string PlanStore::JobDir(const std::string& job_id) const {
  return absl::StrCat(dir_, "/", job_id);
}

int64_t PlanStore::JobBytes(const std::string& job_id) const {
  absl::MutexLock lock(&bytes_mu_);
  const auto it = job_bytes_.find(job_id);
  return it == job_bytes_.end() ? 0 : it->second;
}

absl::Status PlanStore::CheckJobRoom(const std::string& job_id) const {
  if (max_job_bytes_ == 0) return absl::OkStatus();
  const int64_t bytes = JobBytes(job_id);
  if (bytes < max_job_bytes_) return absl::OkStatus();
  return JobStateQuota(job_id, bytes, "a new step", max_job_bytes_);
}

absl::Status PlanStore::ReserveBytes(const std::string& job_id, int64_t bytes,
                                     absl::string_view write) {
  absl::MutexLock lock(&bytes_mu_);
  const auto it = job_bytes_.find(job_id);
  if (it == job_bytes_.end()) return absl::OkStatus();
  if (bytes > 0 && max_job_bytes_ > 0 && it->second + bytes > max_job_bytes_) {
    return JobStateQuota(job_id, it->second, absl::StrCat(write, " (", bytes, " bytes more)"),
                         max_job_bytes_);
  }
  it->second += bytes;
  if (bytes != 0 && job_bytes_observer_) job_bytes_observer_(job_id, it->second);
  return absl::OkStatus();
}

void PlanStore::AddBytes(const std::string& job_id, int64_t delta) {
  if (delta == 0) return;
  absl::MutexLock lock(&bytes_mu_);
  const auto it = job_bytes_.find(job_id);
  if (it == job_bytes_.end()) return;
  it->second += delta;
  if (job_bytes_observer_) job_bytes_observer_(job_id, it->second);
}

void PlanStore::ForgetBytes(const std::string& job_id) {
  absl::MutexLock lock(&bytes_mu_);
  job_bytes_.erase(job_id);
}

absl::Status PlanStore::CreateJob(const StoredJob& job) {
  if (absl::Status s = CheckJobId(job.job_id); !s.ok()) return s;
  const std::string job_dir = JobDir(job.job_id);
  if (mkdir(job_dir.c_str(), 0700) != 0) {
    if (errno == EEXIST) {
      return absl::AlreadyExistsError(
          absl::StrCat("job ", job.job_id, " already has a folder in ", dir_));
    }
    return IoFailure("cannot create", job_dir, errno);
  }
  const std::string snapshot = FrameStateFile(EncodeJob(job).SerializeAsString());
  absl::Status status =
      WriteFileDurably(job_dir, job_dir + "/job.pb", snapshot, Durability::kDurable);
  if (status.ok()) status = SyncDir(dir_);
  if (!status.ok()) {
    RemoveTree(dir_, job.job_id).IgnoreError();  // not half a job
    return NoteWrite(std::move(status), static_cast<int64_t>(snapshot.size()));
  }
  absl::MutexLock lock(&bytes_mu_);
  job_bytes_[job.job_id] = static_cast<int64_t>(snapshot.size());
  if (job_bytes_observer_) job_bytes_observer_(job.job_id, job_bytes_[job.job_id]);
  return status;
}

absl::Status PlanStore::SaveJob(const StoredJob& job, bool sync) {
  if (absl::Status s = CheckJobId(job.job_id); !s.ok()) return s;
  const std::string job_dir = JobDir(job.job_id);
  // Its data synced even without `sync`: a job.pb renamed into place but never written (a
  // machine crash after a submit) quarantined the whole job at restart, its synced step records
  // with it. The folder is synced with `sync` only: until it is, a crash leaves the previous
  // snapshot, which restore brings up to date from the step records and report logs. Counted,
  // never refused: its size follows the job's config, not what callers send.
  const std::string path = job_dir + "/job.pb";
  const int64_t before = FileBytes(path);
  const std::string snapshot = FrameStateFile(EncodeJob(job).SerializeAsString());
  absl::Status status =
      WriteFileDurably(job_dir, path, snapshot,
                       sync || fsync_reports_ ? Durability::kDurable : Durability::kWholeFile);
  AddBytes(job.job_id, FileBytes(path) - before);
  if (!status.ok() && IsGone(job_dir)) {
    return absl::FailedPreconditionError(
        absl::StrCat("job ", job.job_id, " has no folder in ", dir_, " (deleted): not saved"));
  }
  return NoteWrite(std::move(status), static_cast<int64_t>(snapshot.size()));
}

absl::Status PlanStore::SaveStep(const std::string& job_id, int64_t step,
                                 const std::vector<Sample>& batch, const StepPlan& plan,
                                 bool folded, const RecallModelState* layer_recall,
                                 const PlannedDensities* planned_with) {
  if (absl::Status s = CheckJobId(job_id); !s.ok()) return s;
  if (absl::Status s = CheckStep(step); !s.ok()) return s;
  // On an arena: a step of 16,384 samples is some 50,000 small messages.
  google::protobuf::Arena arena;
  auto* record = google::protobuf::Arena::CreateMessage<state::v1::StepRecord>(&arena);
  EncodeStep(step, batch, plan, folded, layer_recall, planned_with, record);
  const std::string job_dir = JobDir(job_id);
  const std::string spare = SparePath(job_dir);
  const std::string path = StepPath(job_dir, step, ".pb");
  // What the job's files will hold after the write: this record, in place of the record it
  // replaces (a step switched to its local plan) and of the spare it is written over. Counted
  // before the write, so that a refused one writes nothing.
  const size_t body_bytes = record->ByteSizeLong();
  if (body_bytes > static_cast<size_t>(kMaxFileBytes) - kHeaderBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("step ", step, "'s record would take ", body_bytes, " bytes, more than the ",
                     kMaxFileBytes, " a restart reads back; submit fewer samples a step"));
  }
  const int64_t record_bytes = static_cast<int64_t>(kHeaderBytes + body_bytes);
  const int64_t replaced = FileBytes(path);
  const int64_t expected = record_bytes - replaced - FileBytes(spare);
  if (absl::Status s = ReserveBytes(job_id, expected, absl::StrCat("step ", step, "'s record"));
      !s.ok()) {
    return s;
  }
  // Serialized straight into the file (into a spare's cached pages when there is one): a
  // string of the whole record would be megabytes of new pages a step. Its sizes were computed
  // above (ByteSizeLong) and are not computed again. Framed (FrameStateFile): the header goes
  // first with the checksum left 0, which is written over it once the body has passed through.
  const uint32_t size = static_cast<uint32_t>(body_bytes);
  int64_t spare_taken = 0;
  absl::Status status = WriteFileDurably(
      job_dir, path, Durability::kDurable, &spare,
      [&](int fd) {
        if (const int err = WriteAllOrErrno(fd, FileFrame(size, ~uint32_t{0})); err != 0) {
          return err;
        }
        ChecksummingFileStream sink(fd, LengthCrc(size));
        bool ok = false;
        {
          google::protobuf::io::CopyingOutputStreamAdaptor out(&sink, kStreamBufferBytes);
          {
            google::protobuf::io::CodedOutputStream coded(&out);
            record->SerializeWithCachedSizes(&coded);
            ok = !coded.HadError();
          }
          ok = ok && out.Flush();
        }
        if (!ok) return sink.err() != 0 ? sink.err() : EIO;
        const std::string frame = FileFrame(size, sink.crc());
        if (pwrite(fd, frame.data() + 8, 4, 8) != 4) return errno != 0 ? errno : EIO;
        return 0;
      },
      &spare_taken);
  // The files as they are now: the spare went into the write whether it succeeded or not.
  AddBytes(job_id, (FileBytes(path) - replaced - spare_taken) - expected);
  if (!status.ok() && IsGone(job_dir)) {
    return absl::FailedPreconditionError(
        absl::StrCat("job ", job_id, " has no folder in ", dir_, " (deleted): step not saved"));
  }
  if (status.ok()) CreateReportLog(job_id, step);
  return NoteWrite(std::move(status), record_bytes);
}

void PlanStore::CreateReportLog(const std::string& job_id, int64_t step) const {
  const std::string path = StepPath(JobDir(job_id), step, ".reports");
  const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK, 0600);
  if (fd >= 0) close(fd);
}

absl::StatusOr<PlanStore::ReportLog> PlanStore::OpenReportLog(const std::string& job_id,
                                                              int64_t step) {
  const std::string job_dir = JobDir(job_id);
  const std::string path = StepPath(job_dir, step, ".reports");
  // O_NONBLOCK: a FIFO in place of the log fails (ENXIO) instead of blocking; regular files
  // ignore it.
  const auto open_log = [&]() -> absl::StatusOr<ReportLog> {
    const int fd =
        open(path.c_str(), O_RDWR | O_CREAT | O_APPEND | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK, 0600);
    if (fd < 0) {
      const int err = errno;
      if (IsGone(job_dir)) {
        return absl::FailedPreconditionError(absl::StrCat("job ", job_id, " has no folder in ",
                                                          dir_, " (deleted): report not saved"));
      }
      return IoFailure("cannot open", path, err);
    }
    absl::StatusOr<struct stat> st = StatOpenFile(fd, path);
    if (!st.ok()) return st.status();
    if (!S_ISREG(st->st_mode)) {
      close(fd);
      return StoreFailure(absl::StatusCode::kInternal,
                          absl::StrCat(path, " is not a regular file: cannot append to it"));
    }
    return ReportLog{fd, st->st_size};
  };
  absl::StatusOr<ReportLog> log = open_log();
  if (!log.ok() || log->size == 0) return log;
  char head[4];
  if (pread(log->fd, head, 4, 0) == 4 && absl::string_view(head, 4) == kMagic) return log;
  // Not the framed format at its start: a log of the previous version (rewritten in the new
  // format so that one file never mixes the two), or a framed log whose first record is torn.
  close(log->fd);
  absl::StatusOr<std::string> bytes = ReadFile(path);
  if (!bytes.ok()) return bytes.status();
  bool legacy = false;
  const ParsedLog parsed = ParseReportLog(*bytes, &legacy);
  if (legacy) {
    std::string framed;
    for (const state::v1::ReportRecord* report : parsed.reports) {
      framed += EncodeRecord(*report);
    }
    absl::Status rewritten = WriteFileDurably(job_dir, path, framed, Durability::kDurable);
    AddBytes(job_id, FileBytes(path) - static_cast<int64_t>(bytes->size()));
    if (!rewritten.ok()) return rewritten;
  }
  return open_log();
}

absl::Status PlanStore::AppendReport(const std::string& job_id, int64_t step,
                                     const StoredReport& report) {
  return AppendReports(job_id, step, absl::MakeConstSpan(&report, 1));
}

absl::Status PlanStore::AppendReports(const std::string& job_id, int64_t step,
                                      absl::Span<const StoredReport> reports) {
  if (absl::Status s = CheckJobId(job_id); !s.ok()) return s;
  if (absl::Status s = CheckStep(step); !s.ok()) return s;
  // Each built on a stack block (a report is a few hundred bytes) and serialized into its
  // record; the records go in one write.
  std::string records;
  for (const StoredReport& report : reports) {
    alignas(8) char block[4096];
    google::protobuf::ArenaOptions arena_options;
    arena_options.initial_block = block;
    arena_options.initial_block_size = sizeof(block);
    google::protobuf::Arena arena(arena_options);
    auto* encoded = google::protobuf::Arena::CreateMessage<state::v1::ReportRecord>(&arena);
    EncodeReport(report, encoded);
    const size_t before = records.size();
    records += EncodeRecord(*encoded);
    if (const size_t body = records.size() - before - kHeaderBytes; body > kMaxRecordBytes) {
      return absl::InvalidArgumentError(absl::StrCat("report: ", body, " bytes (rank ", report.rank,
                                                     "); at most ", kMaxRecordBytes));
    }
  }
  const int64_t bytes = static_cast<int64_t>(records.size());
  if (absl::Status s = ReserveBytes(
          job_id, bytes,
          absl::StrCat(reports.size() == 1 ? "a report" : absl::StrCat(reports.size(), " reports"),
                       " of step ", step));
      !s.ok()) {
    return s;
  }
  absl::MutexLock lock(&logs_mu_);
  auto it = report_logs_.find({job_id, step});
  if (it == report_logs_.end()) {
    if (report_logs_.size() >= kMaxOpenReportLogs) {
      for (const auto& [key, log] : report_logs_) close(log.fd);
      report_logs_.clear();
    }
    absl::StatusOr<ReportLog> log = OpenReportLog(job_id, step);
    if (!log.ok()) {
      AddBytes(job_id, -bytes);
      return NoteWrite(log.status(), bytes);
    }
    it = report_logs_.emplace(std::make_pair(job_id, step), *log).first;
  }
  ReportLog& log = it->second;
  int err = WriteAllOrErrno(log.fd, records);
  const char* failed = err != 0 ? "cannot write" : nullptr;
  if (err == 0 && fsync_reports_ && fsync(log.fd) != 0) {
    err = errno;
    failed = "cannot fsync";
  }
  if (failed == nullptr) {
    log.size += static_cast<off_t>(records.size());
    return absl::OkStatus();
  }
  // The log's path only names it in the error: built when there is one.
  const std::string path = StepPath(JobDir(job_id), step, ".reports");
  absl::Status status = IoFailure(failed, path, err);
  // Cut off what part of the records landed, so that the next append (once space is back)
  // starts on a record boundary instead of after a torn record. Not cut back, the log would keep
  // whole records of the refused reports (all of them after a failed fsync, the first ones after
  // a write that failed part-way), which a restart loads and counts: the process ends instead.
  if (ftruncate(log.fd, log.size) != 0) {
    const int cut_err = errno;
    ExitOnUnsyncedChange("cannot cut back", path, cut_err,
                         absl::StrCat("an append of ", reports.size(), " report(s) of step ", step,
                                      " to it failed (", failed, ": ", std::strerror(err),
                                      ") and was to be cut off at byte ", log.size));
  }
  AddBytes(job_id, -bytes);
  close(log.fd);  // reopened (and its size read again) by the next append
  report_logs_.erase(it);
  return NoteWrite(std::move(status), bytes);
}

absl::StatusOr<struct stat> PlanStore::OpenJoinsLog(const std::string& job_id, int flags,
                                                    int* fd) const {
  const std::string job_dir = JobDir(job_id);
  const std::string path = JoinsPath(job_dir);
  // O_NONBLOCK: a FIFO in its place fails (or is refused below) instead of blocking.
  *fd = open(path.c_str(), flags | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK, 0600);
  if (*fd < 0) {
    const int err = errno;
    if (IsGone(job_dir)) {
      return absl::FailedPreconditionError(
          absl::StrCat("job ", job_id, " has no folder in ", dir_, " (deleted): join not saved"));
    }
    return IoFailure("cannot open", path, err);
  }
  absl::StatusOr<struct stat> st = StatOpenFile(*fd, path);  // closes it on failure
  if (!st.ok()) return st.status();
  if (!S_ISREG(st->st_mode)) {
    close(*fd);
    return StoreFailure(absl::StatusCode::kInternal,
                        absl::StrCat(path, " is not a regular file: cannot use it"));
  }
  return st;
}

absl::StatusOr<int64_t> PlanStore::AppendJoin(const std::string& job_id, int rank) {
  if (absl::Status s = CheckJobId(job_id); !s.ok()) return s;
  state::v1::JoinRecord join;
  join.set_rank(rank);
  const std::string record = EncodeRecord(join);
  const std::string job_dir = JobDir(job_id);
  const std::string path = JoinsPath(job_dir);
  // Not kept open: a rank joins once.
  absl::MutexLock lock(&logs_mu_);  // no append while the folder moves (RetireJob, Quarantine)
  int fd = -1;
  absl::StatusOr<struct stat> st = OpenJoinsLog(job_id, O_WRONLY | O_CREAT | O_APPEND, &fd);
  if (!st.ok()) return st.status();
  const int err = WriteAllOrErrno(fd, record);
  // Counted, never refused: a job's joins.log holds a record per rank at most.
  if (err == 0) {
    close(fd);
    AddBytes(job_id, static_cast<int64_t>(record.size()));
    return static_cast<int64_t>(st->st_size) + static_cast<int64_t>(record.size());
  }
  absl::Status status = IoFailure("cannot write", path, err);
  // As for a report: the next append starts on a record boundary.
  if (ftruncate(fd, st->st_size) != 0) {
    status = WithMore(status, absl::StrCat("; then cannot cut ", path, " back to ", st->st_size,
                                           " bytes: ", std::strerror(errno)));
    struct stat now;
    if (fstat(fd, &now) == 0) AddBytes(job_id, now.st_size - st->st_size);
  }
  close(fd);
  return NoteWrite(std::move(status), static_cast<int64_t>(record.size()));
}

absl::Status PlanStore::SyncJoins(const std::string& job_id, int64_t end) {
  if (absl::Status s = CheckJobId(job_id); !s.ok()) return s;
  // Callers wait here while one syncs; the bytes a sync finds cover every append that ended
  // before it began, so most of them find their join synced already.
  absl::MutexLock lock(&joins_sync_mu_);
  const auto known = joins_synced_.find(job_id);
  int64_t synced = known != joins_synced_.end() ? known->second : 0;
  if (synced >= end) return absl::OkStatus();
  const std::string path = JoinsPath(JobDir(job_id));
  int fd = -1;
  absl::StatusOr<struct stat> st = OpenJoinsLog(job_id, O_RDONLY, &fd);
  if (!st.ok()) return st.status();
  // The joins appended are in the log, which a restart loads, while their callers would be
  // refused and their ranks taken as not joined; and after a failed fsync no later one proves
  // them durable (ExitOnUnsyncedChange): the process ends.
  if (fsync(fd) != 0) {
    const int err = errno;
    ExitOnUnsyncedChange("cannot fsync", path, err,
                         absl::StrCat("joins were appended to it up to byte ", st->st_size));
  }
  close(fd);
  synced = std::max<int64_t>(synced, st->st_size);
  joins_synced_[job_id] = synced;  // only for a folder that was there (RetireJob forgets it)
  if (synced < end) {              // shorter than an append said it ended: it was cut back
    return StoreFailure(absl::StatusCode::kInternal,
                        absl::StrCat(path, " holds ", st->st_size, " bytes, not the ", end,
                                     " its last join ended at"));
  }
  return absl::OkStatus();
}

PlanStore::~PlanStore() {
  absl::MutexLock lock(&logs_mu_);
  for (const auto& [key, log] : report_logs_) close(log.fd);
}

void PlanStore::CloseReportLogsLocked(const std::string& job_id, int64_t step) {
  for (auto it = report_logs_.begin(); it != report_logs_.end();) {
    if (it->first.first == job_id && (step < 0 || it->first.second == step)) {
      close(it->second.fd);
      it = report_logs_.erase(it);
    } else {
      ++it;
    }
  }
}

absl::Status PlanStore::DropStep(const std::string& job_id, int64_t step) {
  if (absl::Status s = CheckJobId(job_id); !s.ok()) return s;
  if (absl::Status s = CheckStep(step); !s.ok()) return s;
  absl::MutexLock lock(&logs_mu_);
  CloseReportLogsLocked(job_id, step);
  const std::string job_dir = JobDir(job_id);
  // The report log first: a crash between the two leaves a record without reports, which the
  // next restart loads and drops again, where a log left without its record was never loaded
  // nor removed.
  const std::string reports = StepPath(job_dir, step, ".reports");
  const int64_t report_bytes = FileBytes(reports);
  if (unlink(reports.c_str()) != 0) {
    if (errno != ENOENT) return IoFailure("cannot remove", reports, errno);
  } else {
    AddBytes(job_id, -report_bytes);
  }
  // The record becomes the job's spare (kSpareStepName), to be written over by a later step;
  // one that cannot be moved there is removed. Either way the job holds one record less: the
  // spare's old one, or this one.
  const std::string record = StepPath(job_dir, step, ".pb");
  const std::string spare = SparePath(job_dir);
  const int64_t record_bytes = FileBytes(record);
  const int64_t spare_bytes = FileBytes(spare);
  if (rename(record.c_str(), spare.c_str()) == 0) {
    AddBytes(job_id, -spare_bytes);
  } else if (errno != ENOENT) {
    if (unlink(record.c_str()) != 0 && errno != ENOENT) {
      return IoFailure("cannot remove", record, errno);
    }
    AddBytes(job_id, -record_bytes);
  }
  return absl::OkStatus();
}

absl::Status PlanStore::RetireJob(const std::string& job_id) {
  if (absl::Status s = CheckJobId(job_id); !s.ok()) return s;
  {
    absl::MutexLock lock(&joins_sync_mu_);
    joins_synced_.erase(job_id);
  }
  const std::string from = JobDir(job_id);
  const std::string retired_name = absl::StrCat(kDeletedPrefix, job_id);
  {
    absl::MutexLock lock(&logs_mu_);
    CloseReportLogsLocked(job_id, -1);
    if (IsGone(from)) {
      ForgetBytes(job_id);
      return absl::OkStatus();
    }
    // A folder of an earlier job with this id whose removal never finished.
    if (absl::Status s = RemoveTree(dir_, retired_name); !s.ok()) return s;
    const std::string to = absl::StrCat(dir_, "/", retired_name);
    if (rename(from.c_str(), to.c_str()) != 0) {
      return IoFailure(absl::StrCat("cannot rename ", from, " to"), to, errno);
    }
    ForgetBytes(job_id);  // its files are on their way out
    // Renamed: refused now, the job would be served until a restart, which never loads it.
    SyncDirAfter(dir_, absl::StrCat("renaming ", from, " to ", to));
  }
  return absl::OkStatus();
}

void PlanStore::RemoveRetired(const std::string& job_id) {
  if (!IsValidJobId(job_id)) return;
  RemoveTree(dir_, absl::StrCat(kDeletedPrefix, job_id)).IgnoreError();  // else Open() will
}

absl::Status PlanStore::Quarantine(const std::string& job_id, const std::string& reason) {
  if (absl::Status s = CheckJobId(job_id); !s.ok()) return s;
  const std::string from = JobDir(job_id);
  const std::string quarantine = absl::StrCat(dir_, "/", kQuarantine);
  const std::string to = absl::StrCat(quarantine, "/", job_id);
  absl::MutexLock lock(&logs_mu_);
  CloseReportLogsLocked(job_id, -1);
  struct stat st;
  if (lstat(from.c_str(), &st) != 0) {
    if (errno == ENOENT) {
      return absl::NotFoundError(absl::StrCat("job ", job_id, " has no folder in ", dir_));
    }
    return IoFailure("cannot stat", from, errno);
  }
  if (!S_ISDIR(st.st_mode)) {
    return absl::FailedPreconditionError(absl::StrCat(from, " is not a folder: not moved"));
  }
  if (mkdir(quarantine.c_str(), 0700) != 0 && errno != EEXIST) {
    return IoFailure("cannot create", quarantine, errno);
  }
  if (!IsFolder(quarantine)) {
    return StoreFailure(absl::StatusCode::kInternal,
                        absl::StrCat(quarantine, " is not a folder (a symlink or a file)"));
  }
  // The reason goes in first, so that the rename moves the files and their reason at once. A
  // full disk may refuse it; the files are moved out of the way all the same.
  WriteFileDurably(from, from + "/REASON", reason + "\n", Durability::kDurable).IgnoreError();
  if (absl::Status s = RemoveTree(quarantine, job_id); !s.ok()) return s;  // an earlier one
  if (rename(from.c_str(), to.c_str()) != 0) {
    return IoFailure(absl::StrCat("cannot rename ", from, " to"), to, errno);
  }
  ForgetBytes(job_id);  // not served: DeleteJob removes its files
  const std::string change = absl::StrCat("renaming ", from, " to ", to);
  SyncDirAfter(quarantine, change);
  SyncDirAfter(dir_, change);
  return absl::OkStatus();
}

absl::Status PlanStore::DeleteQuarantined(const std::string& job_id) {
  if (absl::Status s = CheckJobId(job_id); !s.ok()) return s;
  const std::string quarantine = absl::StrCat(dir_, "/", kQuarantine);
  if (IsGone(absl::StrCat(quarantine, "/", job_id))) {
    return absl::NotFoundError(absl::StrCat("job ", job_id, " is not in ", quarantine));
  }
  return RemoveTree(quarantine, job_id);
}

absl::StatusOr<PlanStore::LoadedStep> PlanStore::LoadStep(const std::string& job_dir, int64_t step,
                                                          bool has_reports) const {
  const std::string record_path = StepPath(job_dir, step, ".pb");
  absl::StatusOr<std::string> bytes = ReadFile(record_path);
  if (!bytes.ok()) return bytes.status();
  // On an arena, as SaveStep writes it: a step of 65,536 samples is some 200,000 small
  // messages, and parsing them into heap blocks of their own took 0.9 s more of the restore of
  // a 4,096-rank job's 64 kept steps (LoadAll: 3.9 s against 3.0; see ParsedLog).
  google::protobuf::Arena arena;
  auto* record = google::protobuf::Arena::CreateMessage<state::v1::StepRecord>(&arena);
  bool legacy = false;
  absl::StatusOr<absl::string_view> body = StateFileBody(*bytes, record_path, &legacy);
  if (!body.ok()) return body.status();
  if (!record->ParseFromArray(body->data(), static_cast<int>(body->size()))) {
    return absl::DataLossError(
        absl::StrCat(record_path, " (", bytes->size(), " bytes) does not parse as a step record"));
  }
  if (record->step() != step) {
    return absl::DataLossError(
        absl::StrCat(record_path, " holds step ", record->step(), ", not ", step));
  }
  absl::StatusOr<LoadedStep> decoded = DecodeStep(*record);
  if (!decoded.ok()) {
    return absl::DataLossError(absl::StrCat(record_path, ": ", decoded.status().message()));
  }
  LoadedStep loaded = *std::move(decoded);
  if (has_reports) {
    absl::StatusOr<std::string> log = ReadFile(StepPath(job_dir, step, ".reports"));
    if (!log.ok()) return log.status();
    bool legacy = false;
    const ParsedLog parsed = ParseReportLog(*log, &legacy);
    for (const state::v1::ReportRecord* report : parsed.reports) {
      loaded.reports.push_back(DecodeReport(*report));
    }
    loaded.skipped_bytes = parsed.skipped_bytes;
  }
  return loaded;
}

absl::StatusOr<PlanStore::LoadedJob> PlanStore::LoadJob(const std::string& job_id,
                                                        PlanThreads* threads,
                                                        int64_t* bytes_held) const {
  const std::string job_dir = JobDir(job_id);
  absl::StatusOr<std::vector<std::string>> names = ListDir(job_dir);
  if (!names.ok()) return names.status();
  const std::set<std::string> files(names->begin(), names->end());
  // The job's bytes as each write and removal keeps them from here on: its regular files'
  // sizes (Open swept the `*.tmp` files a crash left).
  *bytes_held = 0;
  for (const std::string& file : files) {
    *bytes_held += FileBytes(absl::StrCat(job_dir, "/", file));
  }
  if (files.count("job.pb") == 0) {
    return absl::DataLossError(absl::StrCat(job_dir, "/job.pb is missing"));
  }
  LoadedJob job;
  job.job_id = job_id;
  absl::StatusOr<std::string> bytes = ReadFile(job_dir + "/job.pb");
  if (!bytes.ok()) return bytes.status();
  bool legacy = false;
  absl::StatusOr<absl::string_view> body = StateFileBody(*bytes, job_dir + "/job.pb", &legacy);
  if (!body.ok()) return body.status();
  state::v1::JobSnapshot snapshot;
  if (!snapshot.ParseFromArray(body->data(), static_cast<int>(body->size())) ||
      !snapshot.has_config()) {
    return absl::DataLossError(absl::StrCat(job_dir, "/job.pb (", bytes->size(),
                                            " bytes) does not parse as a job snapshot"));
  }
  absl::StatusOr<StoredJob> decoded = DecodeJob(snapshot);
  if (!decoded.ok()) return decoded.status();
  job.job = *std::move(decoded);
  if (files.count("joins.log") > 0) {
    absl::StatusOr<std::string> log = ReadFile(JoinsPath(job_dir));
    if (!log.ok()) return log.status();
    job.joins_log_bytes = static_cast<int64_t>(log->size());
    std::vector<bool>& joined = job.job.joined;
    const int ranks = job.job.settings.planner.ranks;
    if (joined.size() < static_cast<size_t>(ranks)) joined.resize(ranks, false);
    int framed = 0;
    job.joins_skipped_bytes = ScanFramedLog(
        *log,
        [&](absl::string_view body) {
          state::v1::JoinRecord join;
          if (!join.ParseFromArray(body.data(), static_cast<int>(body.size())) || join.rank() < 0 ||
              join.rank() >= ranks) {
            return false;
          }
          joined[join.rank()] = true;
          return true;
        },
        &framed);
  }
  // Steps below the snapshot's first kept step left the history before it was written: files of
  // theirs are what a removal that failed left, never loaded (their reports are in the model, or
  // never will be; loading a complete one folded it a second time).
  const int64_t first_kept = job.job.first_kept_step;
  if (first_kept < 0 || (job.job.next_step >= 0 && first_kept > job.job.next_step)) {
    return absl::DataLossError(absl::StrCat(job_dir, "/job.pb: first_kept_step ", first_kept,
                                            " is outside [0, next_step ", job.job.next_step, "]"));
  }
  std::vector<int64_t> steps;
  std::set<int64_t> leftovers;
  for (const std::string& file : files) {
    absl::string_view name = file;
    int64_t step = 0;
    const bool record = absl::ConsumeSuffix(&name, ".pb");
    if ((record || absl::ConsumeSuffix(&name, ".reports")) && absl::ConsumePrefix(&name, "step-") &&
        absl::SimpleAtoi(name, &step) && step >= 0 && absl::StrCat(step) == name) {
      if (step < first_kept) {
        leftovers.insert(step);
      } else if (record) {
        steps.push_back(step);
      }
    }
  }
  std::sort(steps.begin(), steps.end());
  // Removed once the snapshot that says so is durable (its folder synced): removed under one that
  // a machine crash could still take back, a step's fold would be lost with its report log. Left
  // for the next start when the sync or a removal fails; never loaded either way.
  if (!leftovers.empty() && SyncDir(job_dir).ok()) {
    for (int64_t step : leftovers) {
      for (absl::string_view suffix : {".reports", ".pb"}) {  // the log first, as DropStep
        const std::string path = StepPath(job_dir, step, suffix);
        const int64_t size = FileBytes(path);
        if (unlink(path.c_str()) == 0) *bytes_held -= size;
      }
    }
  }
  // The steps are read, parsed and decoded on the threads, each on its own (a 4,096-rank job's
  // kept steps took 1.8 s one after another); the first failing step in step order is the
  // job's error, as one pass would find it.
  std::vector<absl::StatusOr<LoadedStep>> loaded(steps.size(), absl::UnknownError("not loaded"));
  ParallelEach(threads, steps.size(), [&](size_t k) {
    loaded[k] =
        LoadStep(job_dir, steps[k], files.count(absl::StrCat("step-", steps[k], ".reports")) > 0);
  });
  for (absl::StatusOr<LoadedStep>& step : loaded) {
    if (!step.ok()) return step.status();
    job.steps.push_back(*std::move(step));
  }
  return job;
}

absl::StatusOr<PlanStore::Loaded> PlanStore::LoadAll(PlanThreads* threads) {
  absl::StatusOr<std::vector<std::string>> names = ListDir(dir_);
  if (!names.ok()) return names.status();
  Loaded loaded;
  std::map<std::string, std::string> quarantined_now;  // job id -> reason
  for (const std::string& id : *names) {               // sorted
    const std::string job_dir = JobDir(id);
    if (!IsValidJobId(id) || !IsFolder(job_dir)) continue;  // not ours: left alone
    absl::StatusOr<std::vector<std::string>> files = ListDir(job_dir);
    if (files.ok() && files->empty()) {  // a CreateJob that a crash interrupted
      rmdir(job_dir.c_str());
      continue;
    }
    int64_t bytes = 0;
    absl::StatusOr<LoadedJob> job = LoadJob(id, threads, &bytes);
    if (job.ok()) {
      loaded.jobs.push_back(*std::move(job));
      absl::MutexLock lock(&bytes_mu_);
      job_bytes_[id] = bytes;
      continue;
    }
    const std::string reason(job.status().message());
    if (absl::Status moved = Quarantine(id, reason); moved.ok()) {
      quarantined_now[id] = reason;
    } else {
      loaded.failed.push_back(
          {id, absl::StrCat(reason, " (not quarantined: ", moved.message(), ")"), job_dir});
    }
  }
  const std::string quarantine = absl::StrCat(dir_, "/", kQuarantine);
  absl::StatusOr<std::vector<std::string>> held =
      IsFolder(quarantine) ? ListDir(quarantine) : std::vector<std::string>{};
  for (const std::string& id : held.ok() ? *held : std::vector<std::string>{}) {
    const std::string path = absl::StrCat(quarantine, "/", id);
    if (!IsValidJobId(id) || !IsFolder(path)) continue;
    std::string reason;
    if (auto it = quarantined_now.find(id); it != quarantined_now.end()) {
      reason = it->second;
    } else if (absl::StatusOr<std::string> text = ReadFile(path + "/REASON"); text.ok()) {
      reason = std::string(absl::StripTrailingAsciiWhitespace(text->substr(0, 4096)));
    } else {
      reason = "unknown (no readable REASON file)";
    }
    loaded.failed.push_back({id, std::move(reason), path});
  }
  std::sort(loaded.failed.begin(), loaded.failed.end(),
            [](const FailedJob& a, const FailedJob& b) { return a.job_id < b.job_id; });
  return loaded;
}

}  // namespace sparsebalance
