// The O_DIRECT sink of a save (src/save/direct_sink.hpp).
#include "save/direct_sink.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "base/util.hpp"
#include "format/format.hpp"

namespace ferry {

std::unique_ptr<DirectSink> DirectSink::Open(const std::string& path, File* fallback) {
  int fd = ::open(path.c_str(), O_WRONLY | O_DIRECT | O_CLOEXEC);
  if (fd < 0) return nullptr;
  auto sink = std::unique_ptr<DirectSink>(new DirectSink(fd, fallback->path()));
  if (sink->mem_ == nullptr) return nullptr;
  std::memset(sink->mem_, 0, format::kFirstDataOffset);
  std::memcpy(sink->mem_, format::kMagic, format::kMagicSize);
  // The probe: some file systems accept O_DIRECT at open and refuse it at write.
  ssize_t w = ::pwrite(fd, sink->mem_, format::kFirstDataOffset, 0);
  if (w != static_cast<ssize_t>(format::kFirstDataOffset)) return nullptr;
  sink->filled_[0] = format::kFirstDataOffset;
  sink->fallback_ = fallback;
  return sink;
}

std::unique_ptr<DirectSink> DirectSink::OpenUpload(std::unique_ptr<RemoteSink> upload) {
  auto sink = std::unique_ptr<DirectSink>(new DirectSink(-1, upload->name()));
  if (sink->mem_ == nullptr) return nullptr;
  std::memset(sink->mem_, 0, format::kFirstDataOffset);
  std::memcpy(sink->mem_, format::kMagic, format::kMagicSize);
  sink->filled_[0] = format::kFirstDataOffset;
  sink->upload_ = std::move(upload);
  return sink;
}

DirectSink::DirectSink(int fd, std::string name) : fd_(fd), name_(std::move(name)) {
  mem_ = static_cast<uint8_t*>(std::aligned_alloc(kAlign, kSegment * kRing));
}

DirectSink::~DirectSink() {
  if (fd_ >= 0) ::close(fd_);
  std::free(mem_);
}

void DirectSink::Cancel(const Status& st) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (failed_.ok()) failed_ = st;
  }
  cv_.notify_all();
}

Status DirectSink::Put(uint64_t offset, const uint8_t* data, uint64_t n) {
  for (uint64_t at = offset; at < offset + n;) {
    const uint64_t seg = at / kSegment, in = at % kSegment;
    const uint64_t len = std::min(kSegment - in, offset + n - at);
    const uint64_t slot = seg % kRing;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return seg < base_ + kRing || !failed_.ok(); });
      if (!failed_.ok()) return failed_;
    }
    uint8_t* dst = mem_ + slot * kSegment + in;
    if (data != nullptr) {
      std::memcpy(dst, data + (at - offset), len);
    } else {
      std::memset(dst, 0, len);
    }
    bool full;
    {
      std::lock_guard<std::mutex> lock(mu_);
      filled_[slot] += len;
      full = filled_[slot] == kSegment;
    }
    if (full) FERRY_RETURN_IF_ERROR(WriteSegment(seg));
    at += len;
  }
  return Status::Ok();
}

Status DirectSink::Finish(uint64_t end, File& tail) {
  const uint64_t last = end / kSegment, bytes = end % kSegment;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!failed_.ok()) return failed_;
    if (base_ != last || filled_[last % kRing] != bytes) {
      return Error(StatusCode::kInternal, name_, ": direct writer out of step at ", end);
    }
  }
  const uint8_t* src = mem_ + (last % kRing) * kSegment;
  if (upload_) {
    if (bytes > 0) FERRY_RETURN_IF_ERROR(upload_->Append(src, bytes));
    return upload_->Commit();
  }
  const uint64_t head = bytes / kAlign * kAlign;
  if (head > 0) FERRY_RETURN_IF_ERROR(PWrite(src, head, last * kSegment));
  if (bytes > head)
    FERRY_RETURN_IF_ERROR(tail.PWriteAll(src + head, bytes - head, last * kSegment + head));
  return Status::Ok();
}

Status DirectSink::PWrite(const uint8_t* src, uint64_t n, uint64_t offset) {
  for (uint64_t done = 0; done < n;) {
    ssize_t w = ::pwrite(fd_, src + done, n - done, static_cast<off_t>(offset + done));
    if (w < 0 && errno == EINTR) continue;
    if (w < 0 && errno == EINVAL) {
      // Refused as direct I/O (an unaligned remainder, e.g. a write cut short by a file size
      // limit): the buffered descriptor writes it, or reports the real cause.
      return fallback_->PWriteAll(src + done, n - done, offset + done);
    }
    if (w <= 0) {
      // IoError whatever the errno (a full disk included), as the buffered writes report it.
      return Error(StatusCode::kIoError, name_, ": direct write at offset ", offset + done,
                   " failed ", ErrnoText(w < 0 ? errno : EIO));
    }
    done += static_cast<uint64_t>(w);
  }
  return Status::Ok();
}

Status DirectSink::WriteSegment(uint64_t seg) {
  if (upload_) return AppendSegments(seg);
  Status st = PWrite(mem_ + (seg % kRing) * kSegment, kSegment, seg * kSegment);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!st.ok()) {
      if (failed_.ok()) failed_ = st;
    } else {
      done_[seg % kRing] = true;
      while (done_[base_ % kRing]) {
        done_[base_ % kRing] = false;
        filled_[base_ % kRing] = 0;
        ++base_;
      }
    }
  }
  cv_.notify_all();
  return st;
}

// Marks `seg` full, then appends every full segment from base_ on. A segment filled out of
// order waits in the ring for the thread that completes the one before it.
Status DirectSink::AppendSegments(uint64_t seg) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    done_[seg % kRing] = true;
  }
  std::lock_guard<std::mutex> order(append_mu_);
  for (;;) {
    uint64_t next;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!failed_.ok()) return failed_;
      if (!done_[base_ % kRing]) return Status::Ok();
      next = base_;
    }
    // Puts into this slot wait until base_ moves past it, so it is read unlocked.
    Status st = upload_->Append(mem_ + (next % kRing) * kSegment, kSegment);
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!st.ok()) {
        if (failed_.ok()) failed_ = st;
      } else {
        done_[next % kRing] = false;
        filled_[next % kRing] = 0;
        ++base_;
      }
    }
    cv_.notify_all();
    if (!st.ok()) return st;
  }
}

}  // namespace ferry
