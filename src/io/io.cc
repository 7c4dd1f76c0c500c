#include "io/io.hpp"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <mutex>

#include "base/util.hpp"

namespace ferry {

namespace {
// A full disk, a quota or a file size limit (ENOSPC, EDQUOT, EFBIG) stays an IoError, its
// errno in the message: it is the operating system refusing a write, which callers (Python's
// OSError) tell apart from the library running out of memory.
Status ErrnoStatus(int err, const std::string& path, const char* what) {
  StatusCode code = StatusCode::kIoError;
  if (err == ENOENT) code = StatusCode::kNotFound;
  if (err == ENOMEM) code = StatusCode::kResourceExhausted;
  return Error(code, path, ": ", what, " failed ", ErrnoText(err));
}

}  // namespace

int PReadLoop(int fd, void* dst, uint64_t size, uint64_t offset, uint64_t* done) {
  auto* p = static_cast<uint8_t*>(dst);
  *done = 0;
  while (*done < size) {
    ssize_t r = ::pread(fd, p + *done, size - *done, static_cast<off_t>(offset + *done));
    if (r < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    if (r == 0) break;
    *done += static_cast<uint64_t>(r);
  }
  return 0;
}

File::File(File&& other) noexcept : fd_(other.fd_), path_(std::move(other.path_)) {
  other.fd_ = -1;
}

File& File::operator=(File&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = other.fd_;
    path_ = std::move(other.path_);
    other.fd_ = -1;
  }
  return *this;
}

File::~File() {
  if (fd_ >= 0) ::close(fd_);
}

Status CheckPath(const std::string& path) {
  // The system calls take NUL-terminated strings: "a\0.bak" would name "a".
  if (path.find('\0') != std::string::npos) {
    return Error(StatusCode::kInvalidArgument, Quote(path), ": path contains a NUL byte");
  }
  return Status::Ok();
}

Result<File> File::OpenRead(const std::string& path) {
  FERRY_RETURN_IF_ERROR(CheckPath(path));
  int fd;
  // O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer, forever. It is
  // cleared again once the file is known to be regular.
  do {
    fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
  } while (fd < 0 && errno == EINTR);
  if (fd < 0) return ErrnoStatus(errno, path, "open");
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    int err = errno;
    ::close(fd);
    return ErrnoStatus(err, path, "fstat");
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return Error(StatusCode::kInvalidArgument, path, ": not a regular file");
  }
  int flags = ::fcntl(fd, F_GETFL);
  if (flags < 0 || ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) != 0) {
    int err = errno;
    ::close(fd);
    return ErrnoStatus(err, path, "fcntl");
  }
  return File(fd, path);
}

Result<File> File::CreateExclusive(const std::string& path) {
  FERRY_RETURN_IF_ERROR(CheckPath(path));
  int fd;
  do {
    fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  } while (fd < 0 && errno == EINTR);
  if (fd < 0) return ErrnoStatus(errno, path, "create");
  return File(fd, path);
}

Status File::WriteAll(const void* data, size_t size) {
  const char* p = static_cast<const char*>(data);
  while (size > 0) {
    // Large single writes are split so a signal costs little progress.
    size_t n = size < (size_t{1} << 30) ? size : (size_t{1} << 30);
    ssize_t w = ::write(fd_, p, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus(errno, path_, "write");
    }
    if (w == 0) return Error(StatusCode::kIoError, path_, ": write made no progress");
    p += w;
    size -= static_cast<size_t>(w);
  }
  return Status::Ok();
}

Status File::PReadAll(void* dst, size_t size, uint64_t offset) const {
  uint64_t done = 0;
  if (int err = PReadLoop(fd_, dst, size, offset, &done); err != 0) {
    return ErrnoStatus(err, path_, StrCat("read at offset ", offset + done).c_str());
  }
  if (done < size) {
    return Error(StatusCode::kDataLoss, path_, ": unexpected end of file at offset ",
                 offset + done);
  }
  return Status::Ok();
}

Status File::Sync() {
  if (::fsync(fd_) != 0) return ErrnoStatus(errno, path_, "fsync");
  return Status::Ok();
}

Status File::PWriteAll(const void* data, size_t size, uint64_t offset) {
  const char* p = static_cast<const char*>(data);
  while (size > 0) {
    size_t n = size < (size_t{1} << 30) ? size : (size_t{1} << 30);
    ssize_t w = ::pwrite(fd_, p, n, static_cast<off_t>(offset));
    if (w < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus(errno, path_, StrCat("write at offset ", offset).c_str());
    }
    if (w == 0) return Error(StatusCode::kIoError, path_, ": write made no progress");
    p += w;
    size -= static_cast<size_t>(w);
    offset += static_cast<uint64_t>(w);
  }
  return Status::Ok();
}

Result<uint64_t> File::Size() const {
  struct stat st;
  if (::fstat(fd_, &st) != 0) return ErrnoStatus(errno, path_, "fstat");
  return static_cast<uint64_t>(st.st_size);
}

Status File::Close() {
  if (fd_ < 0) return Status::Ok();
  int fd = fd_;
  fd_ = -1;
  // close() is not retried on EINTR: on Linux the descriptor is gone either way.
  if (::close(fd) != 0 && errno != EINTR) return ErrnoStatus(errno, path_, "close");
  return Status::Ok();
}

DirectFile DirectFile::Open(const std::string& path) {
  DirectFile out;
  int fd;
  do {
    fd = ::open(path.c_str(), O_RDONLY | O_DIRECT | O_CLOEXEC);
  } while (fd < 0 && errno == EINTR);
  if (fd >= 0) out.file_ = File(fd, path);
  return out;
}

Status DirectFile::ReadAligned(uint8_t* dst, uint64_t offset, uint64_t len, uint64_t need) const {
  uint64_t done = 0;
  if (int err = PReadLoop(file_.fd(), dst, len, offset, &done); err != 0) {
    return Error(StatusCode::kIoError, path(), ": direct read at offset ", offset + done,
                 " failed ", ErrnoText(err));
  }
  if (done < need) {
    return Error(StatusCode::kDataLoss, path(), ": direct read at offset ", offset, " got ", done,
                 " of ", need, " bytes (file truncated?)");
  }
  return Status::Ok();
}

Result<const uint8_t*> DirectFile::ReadThrough(uint64_t offset, uint64_t size) const {
  struct Buffer {
    uint8_t* p = nullptr;
    uint64_t n = 0;
    ~Buffer() { std::free(p); }
  };
  thread_local Buffer buf;
  const uint64_t begin = offset / kDirectAlign * kDirectAlign;
  const uint64_t end = AlignUp(offset + size, kDirectAlign);
  if (buf.n < end - begin) {
    std::free(buf.p);
    buf.n = end - begin;
    buf.p = static_cast<uint8_t*>(std::aligned_alloc(kDirectAlign, buf.n));
    if (buf.p == nullptr) {
      buf.n = 0;
      return Error(StatusCode::kResourceExhausted, path(), ": direct read buffer of ", end - begin,
                   " bytes");
    }
  }
  FERRY_RETURN_IF_ERROR(ReadAligned(buf.p, begin, end - begin, offset + size - begin));
  return buf.p + (offset - begin);
}

uint64_t AvailableMemory() {
  FILE* f = std::fopen("/proc/meminfo", "r");
  if (f == nullptr) return 0;
  char line[256];
  uint64_t kib = 0;
  while (std::fgets(line, sizeof(line), f) != nullptr) {
    if (std::sscanf(line, "MemAvailable: %lu kB", &kib) == 1) break;
  }
  std::fclose(f);
  return kib * 1024;
}

Result<std::shared_ptr<Mapping>> Mapping::Map(const std::string& path) {
  FERRY_ASSIGN_OR_RETURN(File file, File::OpenRead(path));
  return Map(std::move(file));
}

Result<std::shared_ptr<Mapping>> Mapping::Map(File file) {
  const std::string& path = file.path();
  FERRY_ASSIGN_OR_RETURN(uint64_t size, file.Size());
  std::shared_ptr<Mapping> m(new Mapping());
  m->path_ = path;
  m->size_ = size;
  if (size > 0) {
    void* p = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, file.fd(), 0);
    if (p == MAP_FAILED) return ErrnoStatus(errno, path, "mmap");
    m->data_ = static_cast<const uint8_t*>(p);
  }
  m->file_ = std::move(file);
  return m;
}

Mapping::~Mapping() {
  if (data_ != nullptr) ::munmap(const_cast<uint8_t*>(data_), size_);
}

double Mapping::ResidentFraction(const std::vector<std::pair<uint64_t, uint64_t>>& ranges) const {
  uint64_t total = 0;
  for (const auto& r : ranges) total += r.second;
  if (total == 0 || size_ == 0) return 1.0;
  const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  const uint64_t samples = std::min<uint64_t>(2048, total / page + 1);
  const uint64_t stride = std::max<uint64_t>(total / samples, 1);
  uint64_t seen = 0, resident = 0, acc = 0;
  for (const auto& [offset, len] : ranges) {
    for (uint64_t off = acc % stride == 0 ? 0 : stride - acc % stride; off < len; off += stride) {
      uint64_t at = (offset + off) / page * page;
      unsigned char vec = 0;
      if (::mincore(const_cast<uint8_t*>(data_) + at, page, &vec) == 0) {
        ++seen;
        resident += vec & 1;
      }
    }
    acc += len;
  }
  return seen == 0 ? 1.0 : static_cast<double>(resident) / seen;
}

Result<std::shared_ptr<PrivateRegion>> PrivateRegion::Map(const Mapping& file, uint64_t offset,
                                                          uint64_t size) {
  if (offset > file.size() || size > file.size() - offset) {
    return Error(StatusCode::kInvalidArgument, file.path(), ": bytes [", offset, ", +", size,
                 ") lie outside the file of ", file.size(), " bytes");
  }
  std::shared_ptr<PrivateRegion> r(new PrivateRegion());
  if (size == 0) return r;
  static const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  const uint64_t start = offset / page * page;
  r->length_ = static_cast<size_t>(offset + size - start);
  // MAP_NORESERVE: the pages are the file's until written, so no swap is set aside for them.
  void* p = ::mmap(nullptr, r->length_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_NORESERVE,
                   file.fd(), static_cast<off_t>(start));
  if (p == MAP_FAILED) return ErrnoStatus(errno, file.path(), "mmap (private view)");
  r->base_ = p;
  r->data_ = static_cast<uint8_t*>(p) + (offset - start);
  return r;
}

PrivateRegion::~PrivateRegion() {
  if (base_ != nullptr) ::munmap(base_, length_);
}

// ---- SIGBUS guard ---------------------------------------------------------------------------
// A page of a shared file mapping past the file's current end raises SIGBUS when touched.
// Checking the size with fstat before each read would leave a window between the check and
// the copy; the guard closes it: the fault itself becomes an error for the read that hit it.

namespace {

// Innermost guarded read of this thread. Set before any fault can happen, so the handler's
// access never has to allocate the thread's TLS block.
thread_local BusGuardFrame* t_bus_top = nullptr;

struct sigaction g_previous_bus;

void PassOn(int sig, siginfo_t* info, void* context) {
  const struct sigaction& prev = g_previous_bus;
  if (prev.sa_flags & SA_SIGINFO) {
    if (prev.sa_sigaction != nullptr) {
      prev.sa_sigaction(sig, info, context);
      return;
    }
  } else if (prev.sa_handler != SIG_DFL && prev.sa_handler != SIG_IGN) {
    prev.sa_handler(sig);
    return;
  }
  // Default (or ignored, which cannot apply to a fault): die of SIGBUS as without us. Our
  // handler has SA_NODEFER, so the signal is not blocked here and raise() delivers at once.
  struct sigaction dfl = {};
  dfl.sa_handler = SIG_DFL;
  sigemptyset(&dfl.sa_mask);
  ::sigaction(sig, &dfl, nullptr);
  ::raise(sig);
}

void OnBus(int sig, siginfo_t* info, void* context) {
  const auto* at = static_cast<const uint8_t*>(info->si_addr);
  // Only faults of a guarded mapping's pages, on the thread reading it, are ours.
  for (BusGuardFrame* f = t_bus_top; f != nullptr; f = f->prev) {
    if (info->si_code != SI_USER && at >= f->begin && at < f->end) {
      t_bus_top = f;  // frames inside f are abandoned; f's own destructor pops f
      // SA_NODEFER should leave SIGBUS unblocked, but a runtime that wraps handlers (TSan
      // does) may block it anyway, and the jump does not restore the mask: a later fault
      // while blocked would kill the process. Unblocking costs a system call on this error
      // path only, where saving the mask in every sigsetjmp would cost one per read.
      sigset_t bus;
      sigemptyset(&bus);
      sigaddset(&bus, SIGBUS);
      ::pthread_sigmask(SIG_UNBLOCK, &bus, nullptr);
      siglongjmp(f->env, 1);
    }
  }
  PassOn(sig, info, context);
}

void InstallBusHandler() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction sa = {};
    sa.sa_sigaction = OnBus;
    sigemptyset(&sa.sa_mask);
    // SA_NODEFER: leaving the handler by siglongjmp must not leave SIGBUS blocked (a later
    // fault while blocked kills the process outright); OnBus unblocks it too, in case a
    // wrapper blocked it. SA_ONSTACK: use the thread's alternate stack if it has one.
    sa.sa_flags = SA_SIGINFO | SA_NODEFER | SA_ONSTACK | SA_RESTART;
    ::sigaction(SIGBUS, &sa, &g_previous_bus);
  });
}

}  // namespace

BusGuardFrame::BusGuardFrame(const uint8_t* data, uint64_t size)
    : begin(data), end(data + size), prev(t_bus_top) {
  InstallBusHandler();
  t_bus_top = this;
}

BusGuardFrame::~BusGuardFrame() { t_bus_top = prev; }

Status SyncParentDir(const std::string& path) {
  auto slash = path.find_last_of('/');
  std::string dir = slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash));
  int fd;
  do {
    fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  } while (fd < 0 && errno == EINTR);
  if (fd < 0) return ErrnoStatus(errno, dir, "open directory");
  int rc = ::fsync(fd);
  int err = errno;
  ::close(fd);
  // Some file systems (tmpfs on old kernels) refuse fsync on directories; durability is then
  // not ours to give, and the rename itself is still atomic.
  if (rc != 0 && err != EINVAL) return ErrnoStatus(err, dir, "fsync directory");
  return Status::Ok();
}

namespace {

const char* FileKind(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a regular file";
}

// An atomic replacement renames a new regular file over `dest`: over a FIFO, a device node
// (/dev/null) or a socket that would delete it and leave a plain file in its place (as root,
// for the whole machine), and a directory cannot be renamed over at all. So only a regular
// file is replaced; anything else is refused before a byte is written, naming what is there.
// `shown` is the path the caller gave (`dest` differs when a symbolic link led there).
Status CheckReplaceable(const std::string& shown, const std::string& dest, const struct stat& st) {
  if (S_ISREG(st.st_mode)) return Status::Ok();
  return Error(StatusCode::kInvalidArgument, shown, ": ",
               shown == dest ? std::string("is ") : StrCat("leads to ", dest, ", which is "),
               FileKind(st.st_mode),
               ", not a regular file; a checkpoint replaces only a regular file: write to a "
               "file path");
}

}  // namespace

Result<std::string> ReplaceTarget(const std::string& path) {
  FERRY_RETURN_IF_ERROR(CheckPath(path));
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0) return path;  // nothing there yet (or creating says why)
  if (!S_ISLNK(st.st_mode)) {
    FERRY_RETURN_IF_ERROR(CheckReplaceable(path, path, st));
    return path;
  }
  // A link is written through, as open() would: its target is replaced, in the target's own
  // directory (a rename cannot cross file systems), and the link keeps pointing at it.
  char* resolved = ::realpath(path.c_str(), nullptr);
  if (resolved == nullptr) {
    return Error(StatusCode::kInvalidArgument, path, ": symbolic link does not resolve to a file ",
                 ErrnoText(errno), "; remove it or point it at a file");
  }
  std::string target(resolved);
  std::free(resolved);
  if (::stat(target.c_str(), &st) == 0) FERRY_RETURN_IF_ERROR(CheckReplaceable(path, target, st));
  return target;
}

Status KeepPermissions(const File& tmp, const std::string& dest) {
  struct stat st;
  if (::stat(dest.c_str(), &st) != 0) {
    if (errno == ENOENT) return Status::Ok();  // nothing replaced: the creation mode stands
    return ErrnoStatus(errno, dest, "stat");
  }
  // Checked again just before the rename: something else may have appeared at `dest` since
  // ReplaceTarget looked.
  FERRY_RETURN_IF_ERROR(CheckReplaceable(dest, dest, st));
  // Owner first: chown clears set-id bits, and a file another user owned keeps its owner
  // where the caller may give it (root; a group the caller is in). Where not, the caller
  // owns the new file, with the old mode bits.
  if (st.st_uid != ::geteuid() || st.st_gid != ::getegid()) {
    if (::fchown(tmp.fd(), st.st_uid, st.st_gid) != 0 &&
        ::fchown(tmp.fd(), static_cast<uid_t>(-1), st.st_gid) != 0) {
      // EPERM: not ours to give; the permission bits below still apply.
    }
  }
  // Read/write/execute bits only: set-id and sticky bits make no sense on a checkpoint.
  if (::fchmod(tmp.fd(), st.st_mode & 0777) != 0) return ErrnoStatus(errno, dest, "fchmod");
  return Status::Ok();
}

Status RenameFile(const std::string& from, const std::string& to) {
  FERRY_RETURN_IF_ERROR(CheckPath(to));
  if (::rename(from.c_str(), to.c_str()) != 0) {
    return ErrnoStatus(errno, to, StrCat("rename from ", from).c_str());
  }
  return Status::Ok();
}

}  // namespace ferry
