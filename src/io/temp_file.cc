// Temporary files of atomic saves (src/io/temp_file.hpp).
#include "io/temp_file.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <ctime>
#include <random>

#include "base/util.hpp"

namespace ferry {

namespace {

constexpr char kInfix[] = ".tmp.";
constexpr size_t kHexDigits = 16;
constexpr time_t kEmptyGraceSeconds = 60;

// "<pid>.<16 hex digits>" after "<base>.tmp.": the writer's pid, or -1 for another name.
pid_t WriterPid(const std::string& name, const std::string& base) {
  const std::string prefix = base + kInfix;
  if (name.size() <= prefix.size() || name.compare(0, prefix.size(), prefix) != 0) return -1;
  const std::string rest = name.substr(prefix.size());
  const size_t dot = rest.find('.');
  if (dot == 0 || dot == std::string::npos || dot > 10 || rest.size() - dot - 1 != kHexDigits) {
    return -1;
  }
  long long pid = 0;
  for (size_t i = 0; i < dot; ++i) {
    if (rest[i] < '0' || rest[i] > '9') return -1;
    pid = pid * 10 + (rest[i] - '0');
  }
  for (size_t i = dot + 1; i < rest.size(); ++i) {
    if (!std::isxdigit(static_cast<unsigned char>(rest[i]))) return -1;
  }
  return pid > 0 && pid <= INT32_MAX ? static_cast<pid_t>(pid) : -1;
}

bool ProcessExists(pid_t pid) { return ::kill(pid, 0) == 0 || errno == EPERM; }

int OpenRetrying(const char* path, int flags, mode_t mode = 0) {
  int fd;
  do {
    fd = ::open(path, flags, mode);
  } while (fd < 0 && errno == EINTR);
  return fd;
}

}  // namespace

Result<TempFile> BeginReplace(const std::string& path) {
  FERRY_ASSIGN_OR_RETURN(std::string dest, ReplaceTarget(path));
  SweepStaleTemps(dest);
  FERRY_ASSIGN_OR_RETURN(TempFile temp, CreateTempFile(dest));
  temp.dest = std::move(dest);
  return temp;
}

Result<TempFile> CreateTempFile(const std::string& dest) {
  FERRY_RETURN_IF_ERROR(CheckPath(dest));
  static std::atomic<uint64_t> counter{0};
  std::random_device rd;
  const uint64_t r = (uint64_t{rd()} << 32) ^ rd() ^ counter.fetch_add(1);
  char suffix[48];
  std::snprintf(suffix, sizeof(suffix), "%s%d.%016llx", kInfix, static_cast<int>(::getpid()),
                static_cast<unsigned long long>(r));
  TempFile t;
  t.path = dest + suffix;
  int fd = OpenRetrying(t.path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  // Named for the destination, and IoError whatever the errno (a missing folder is not a
  // missing checkpoint, a full disk not a memory shortage), which stays in the message.
  if (fd < 0) {
    return Error(StatusCode::kIoError, dest, ": creating its temporary file failed ",
                 ErrnoText(errno));
  }
  t.file = File(fd, dest);
  // The lock before the first byte: a sweep takes an unlocked file with data for garbage.
  // Where the file system has no locks the pid in the name still protects the file (and a
  // sweep there cannot lock, so it removes nothing).
  int lock = OpenRetrying(t.path.c_str(), O_RDONLY | O_CLOEXEC);
  if (lock >= 0) {
    t.lock = File(lock, t.path);
    while (::flock(lock, LOCK_EX | LOCK_NB) != 0 && errno == EINTR) {
    }
  }
  return t;
}

void SweepStaleTemps(const std::string& dest) {
  const size_t slash = dest.find_last_of('/');
  const std::string dir =
      slash == std::string::npos ? "." : (slash == 0 ? "/" : dest.substr(0, slash));
  const std::string base = slash == std::string::npos ? dest : dest.substr(slash + 1);
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return;
  const int dfd = ::dirfd(d);
  const time_t now = std::time(nullptr);
  while (struct dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    const pid_t pid = WriterPid(name, base);
    if (pid < 0 || pid == ::getpid() || ProcessExists(pid)) continue;
    const int fd = ::openat(dfd, name.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) continue;
    struct stat st;
    const bool stale = ::fstat(fd, &st) == 0 && S_ISREG(st.st_mode) &&
                       (st.st_size > 0 || now - st.st_mtime > kEmptyGraceSeconds) &&
                       ::flock(fd, LOCK_EX | LOCK_NB) == 0;
    if (stale) ::unlinkat(dfd, name.c_str(), 0);
    ::close(fd);
  }
  ::closedir(d);
}

}  // namespace ferry
