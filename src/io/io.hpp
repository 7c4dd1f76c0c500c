// Files and mappings: every system call retried on EINTR and short transfers, every failure
// a Status naming the path.
#ifndef FERRY_SRC_IO_IO_HPP_
#define FERRY_SRC_IO_IO_HPP_

#include <csetjmp>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "ferry/ferry.hpp"

namespace ferry {

// pread until `size` bytes are in or the file ends, retrying EINTR; `*done` counts the bytes
// read. Returns 0, or the errno of a failed read.
int PReadLoop(int fd, void* dst, uint64_t size, uint64_t offset, uint64_t* done);

// An owned file descriptor.
class File {
 public:
  File() = default;
  File(int fd, std::string path) : fd_(fd), path_(std::move(path)) {}
  File(File&& other) noexcept;
  File& operator=(File&& other) noexcept;
  File(const File&) = delete;
  File& operator=(const File&) = delete;
  ~File();

  static Result<File> OpenRead(const std::string& path);
  // Creates a new file; fails if it exists.
  static Result<File> CreateExclusive(const std::string& path);

  int fd() const { return fd_; }
  const std::string& path() const { return path_; }
  bool is_open() const { return fd_ >= 0; }

  Status WriteAll(const void* data, size_t size);
  // Writes all `size` bytes at `offset` (pwrite: safe from several threads at once).
  Status PWriteAll(const void* data, size_t size, uint64_t offset);
  Status PReadAll(void* dst, size_t size, uint64_t offset) const;
  Status Sync();
  Result<uint64_t> Size() const;
  Status Close();

 private:
  int fd_ = -1;
  std::string path_;
};

// Page size and O_DIRECT alignment of offsets, lengths and buffers.
inline constexpr uint64_t kDirectAlign = 4096;

// A file opened with O_DIRECT, for reads that bypass the page cache. Immutable after Open:
// reads may run from any number of threads at once.
class DirectFile {
 public:
  DirectFile() = default;
  // Not open (and no error) where the file system refuses O_DIRECT (tmpfs): callers read
  // through the page cache instead.
  static DirectFile Open(const std::string& path);

  bool is_open() const { return file_.is_open(); }
  const std::string& path() const { return file_.path(); }

  // Reads file bytes [offset, offset + len) into dst; offset, len and dst are multiples of
  // kDirectAlign. A read that reaches the end of the file may stop short, but must cover
  // `need` bytes (DataLoss otherwise: the file was truncated).
  Status ReadAligned(uint8_t* dst, uint64_t offset, uint64_t len, uint64_t need) const;
  // Reads file bytes [offset, offset + size), at any alignment, through this thread's aligned
  // buffer; the pointer stays valid until this thread's next ReadThrough.
  Result<const uint8_t*> ReadThrough(uint64_t offset, uint64_t size) const;

 private:
  File file_;
};

// One active guarded read on this thread (see Mapping::Guard). Frames nest through `prev`.
struct BusGuardFrame {
  BusGuardFrame(const uint8_t* begin, uint64_t size);
  ~BusGuardFrame();
  BusGuardFrame(const BusGuardFrame&) = delete;
  BusGuardFrame& operator=(const BusGuardFrame&) = delete;

  sigjmp_buf env;
  const uint8_t* begin;
  const uint8_t* end;
  BusGuardFrame* prev;
};

// A read-only shared mapping of a whole file.
class Mapping {
 public:
  static Result<std::shared_ptr<Mapping>> Map(const std::string& path);
  // Maps a file already open for reading (File::OpenRead), and keeps it open.
  static Result<std::shared_ptr<Mapping>> Map(File file);
  ~Mapping();
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;

  const uint8_t* data() const { return data_; }
  uint64_t size() const { return size_; }
  const std::string& path() const { return path_; }
  int fd() const { return file_.fd(); }

  // Fraction of the sampled pages of the file ranges {offset, length} that are resident in
  // the page cache (mincore; at most 2048 samples spread evenly over the ranges' bytes).
  double ResidentFraction(const std::vector<std::pair<uint64_t, uint64_t>>& ranges) const;

  // Runs fn(), which reads this mapping, and returns false if the read faulted because the
  // file shrank after it was mapped (truncated, or rewritten in place). Such a read raises
  // SIGBUS; a process-wide handler, installed on first use and chained to whatever handler
  // was there before, jumps back here for faults inside this mapping on this thread, and
  // passes every other SIGBUS on. fn() is left by siglongjmp, so it must hold no object with
  // a destructor at the faulting read: pass a lambda around memcpy, a checksum or a decoder
  // call, nothing that builds messages or containers.
  template <typename Fn>
  [[nodiscard]] bool Guard(Fn&& fn) const {
    BusGuardFrame frame(data_, size_);
    // No signal mask saved: the handler runs with SA_NODEFER and an empty mask, so jumping
    // out of it leaves this thread's mask as it was, and the fast path makes no system call.
    if (sigsetjmp(frame.env, 0) != 0) return false;
    fn();
    return true;
  }

 private:
  Mapping() = default;
  File file_;
  const uint8_t* data_ = nullptr;
  uint64_t size_ = 0;
  std::string path_;
};

// Memory the kernel could give the page cache now (MemAvailable of /proc/meminfo), or 0 when
// unknown.
uint64_t AvailableMemory();

// Bytes [offset, offset + size) of a mapped file, mapped again privately and copy-on-write:
// readable and writable, but a write copies the page into this process and never reaches the
// file. Tensors exported through DLPack get these: consumers may ignore DLPack's read-only
// flag (torch does), and a write into the shared read-only mapping would fault. Untouched pages
// stay shared with the page cache, so the view costs no copy.
class PrivateRegion {
 public:
  static Result<std::shared_ptr<PrivateRegion>> Map(const Mapping& file, uint64_t offset,
                                                    uint64_t size);
  ~PrivateRegion();
  PrivateRegion(const PrivateRegion&) = delete;
  PrivateRegion& operator=(const PrivateRegion&) = delete;

  void* data() const { return data_; }

 private:
  PrivateRegion() = default;
  void* base_ = nullptr;
  size_t length_ = 0;
  void* data_ = nullptr;
};

// fsync of the directory holding `path`, so a rename inside it is durable.
Status SyncParentDir(const std::string& path);
// InvalidArgument when `path` holds a NUL byte (the system would see only the part before it).
Status CheckPath(const std::string& path);
// The file an atomic replacement of `path` must rename over: `path`, or the file a symbolic
// link at `path` resolves to (writing through the link, as open() does). InvalidArgument for
// a link that resolves to nothing (dangling, a loop), and for a destination that exists and is
// not a regular file (a directory, FIFO, device node or socket, or a link to one): every
// writer calls this before it creates its temporary file, so none ever replaces /dev/null.
Result<std::string> ReplaceTarget(const std::string& path);
// Gives the temporary file `tmp` the permission bits of the file at `dest`, and its owner and
// group where the caller may; nothing when `dest` does not exist. InvalidArgument when `dest`
// has meanwhile become something other than a regular file (checked again before the rename).
Status KeepPermissions(const File& tmp, const std::string& dest);
Status RenameFile(const std::string& from, const std::string& to);

}  // namespace ferry

#endif  // FERRY_SRC_IO_IO_HPP_
