// Streaming writer. Every tensor is cut into blocks that flow through a pipeline: the caller's
// thread stages each block (points at host memory, copies it into the staging pool, pulls it
// from a FillFn, or enqueues a device-to-host copy on the caller's stream); worker threads
// wait for the copy's event, checksum and compress blocks in order; a sequencer gives each
// finished block its file offset in block order (compressed sizes are known only then); and
// workers write blocks at their offsets with pwrite, in parallel. The footer and the atomic
// rename happen in Finish, on the caller's thread (Commit) or in the background (CommitAsync).
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <system_error>
#include <thread>
#include <vector>

#include "base/util.hpp"
#include "codec/codec.hpp"
#include "codec/planes.hpp"
#include "cuda/staging_pool.hpp"
#include "format/footer_builder.hpp"
#include "format/format.hpp"
#include "io/io.hpp"
#include "save/device_snapshot.hpp"
#include "save/direct_sink.hpp"

namespace ferry {

namespace {

using format::ChunkCodec;
using format::ChunkRecord;

struct TensorRecord : format::TensorRecord {
  uint64_t pending = 0;  // blocks not yet written (guarded by the pipeline's mutex)
};

// One block of one tensor on its way to the file.
struct Block {
  enum class State : uint8_t { kQueued, kEncoding, kEncoded, kAssigned, kWriting, kDone };
  TensorRecord* rec = nullptr;
  uint64_t raw_off = 0;
  size_t n = 0;
  const uint8_t* raw = nullptr;       // caller memory or a staging piece
  StagingPool::Impl* pool = nullptr;  // set when `raw` is a staging piece
  uint64_t piece = 0;
  void* event = nullptr;  // cudaEvent_t recorded after the device-to-host copy
  bool first = false, last = false;
  State state = State::kQueued;
  uint64_t checksum = 0;
  bool compressed = false;
  ChunkCodec codec = ChunkCodec::kStored;  // when compressed
  size_t stored = 0;
  const uint8_t* data = nullptr;  // the stored bytes: `raw` or `out`
  std::unique_ptr<std::vector<uint8_t>> out;
  uint64_t offset = 0;
  uint64_t pad = 0;  // zero bytes between the previous block's end and `offset`
};

std::string TempPath(const std::string& path) {
  static std::atomic<uint64_t> counter{0};
  std::random_device rd;
  uint64_t r = (uint64_t{rd()} << 32) ^ rd() ^ counter.fetch_add(1);
  char buf[32];
  std::snprintf(buf, sizeof(buf), ".tmp.%d.%016llx", static_cast<int>(::getpid()),
                static_cast<unsigned long long>(r));
  return path + buf;
}

Status CheckKey(const std::string& path, std::string_view key, const char* kind) {
  if (key.empty()) return Error(StatusCode::kInvalidArgument, path, ": empty ", kind);
  if (key.size() > format::kMaxNameBytes) {
    return Error(StatusCode::kInvalidArgument, path, ": ", kind, " of ", key.size(),
                 " bytes (limit ", format::kMaxNameBytes, ")");
  }
  if (key.find('\0') != std::string_view::npos) {
    return Error(StatusCode::kInvalidArgument, path, ": ", kind, " ", Quote(key),
                 " contains a NUL byte");
  }
  return Status::Ok();
}

// Where a tensor's bytes come from.
struct Source {
  enum class Kind { kHost, kFill, kDevice } kind = Kind::kHost;
  const uint8_t* host = nullptr;
  uint64_t host_bytes = 0;
  const FillFn* fill = nullptr;
  const uint8_t* device = nullptr;
  Stream stream = nullptr;
};

// The internal pool of a writer without WriterOptions::staging.
constexpr uint64_t kDefaultStagingBytes = uint64_t{64} << 20;

}  // namespace

class SaveHandle::State {
 public:
  std::string path;
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  Status status;
};

class Writer::Impl {
 public:
  std::string path;
  std::string tmp_path;
  std::string dest;  // `path`, or the file a symbolic link at `path` resolves to
  File file;
  WriterOptions options;
  bool spent = false;  // Commit, CommitAsync or Abort was reached (caller's side)
  bool finished = false;
  std::deque<TensorRecord> tensors;  // stable addresses: blocks point into it
  std::set<std::string, std::less<>> names;
  format::FooterExtras extras;        // quantized tensors, scaling states, metadata, producer
  std::shared_ptr<StagingPool> pool;  // options.staging, or the internal one once needed

  // ---- the pipeline (everything below `mu` is guarded by it) ------------------------------
  std::mutex mu;
  std::condition_variable work_cv, done_cv;
  std::deque<Block> blocks;
  uint64_t next_encode = 0;  // first block no worker has taken for encoding
  uint64_t seq = 0;          // first block without a file offset
  uint64_t blocks_done = 0;
  std::deque<Block*> write_queue;
  uint64_t pos = format::kFirstDataOffset;  // end of the data section assigned so far
  std::unique_ptr<DirectSink> sink;         // O_DIRECT writes, where the file system has them
  bool closed = false;
  bool failed = false;
  Status error;
  std::vector<std::unique_ptr<std::vector<uint8_t>>> free_bufs;
  std::vector<std::thread> workers;
  uint64_t window = 8;         // blocks encoded ahead of the sequencer, at most
  std::mutex progress_mu;      // one options.progress call at a time, outside mu
  uint64_t progress_done = 0;  // guarded by progress_mu

  std::unique_ptr<DeviceSnapshot> device;  // device tensors' copies (made at the first one)

  ~Impl() {
    Abort();
    JoinWorkers();
  }

  int Threads() const {
    if (options.threads > 0) return options.threads;
    unsigned hw = std::thread::hardware_concurrency();
    return static_cast<int>(std::clamp<unsigned>(hw == 0 ? 4 : hw, 1, 16));
  }

  // First error wins. Called with mu held.
  void Fail(Status st) {
    if (!failed) {
      failed = true;
      if (sink) sink->Cancel(st);
      error = std::move(st);
    }
  }

  Status Report(uint64_t n) {
    std::lock_guard<std::mutex> lock(progress_mu);
    progress_done += n;
    return options.progress(progress_done);
  }

  Status PipelineStatus() {
    std::lock_guard<std::mutex> lock(mu);
    return failed ? error : Status::Ok();
  }

  void Abort() {
    if (spent) return;
    spent = true;
    {
      std::lock_guard<std::mutex> lock(mu);
      Fail(Error(StatusCode::kInvalidArgument, path, ": writer aborted"));
    }
    Drain();
    (void)file.Close();
    if (!tmp_path.empty()) ::unlink(tmp_path.c_str());
  }

  Status CheckUsable() const {
    if (spent) {
      return Error(StatusCode::kInvalidArgument, path, ": writer already committed or aborted");
    }
    return Status::Ok();
  }

  // ---- workers ----------------------------------------------------------------------------

  Status StartWorkers() {
    if (!workers.empty()) return Status::Ok();
    const int n = Threads();
    window = 2 * static_cast<uint64_t>(n) + 2;
    try {
      for (int i = 0; i < n; ++i) workers.emplace_back([this] { Work(); });
    } catch (const std::system_error& e) {
      {
        std::lock_guard<std::mutex> lock(mu);
        Fail(Error(StatusCode::kResourceExhausted, path, ": cannot start writer threads (",
                   e.what(), ")"));
        closed = true;
      }
      work_cv.notify_all();
      JoinWorkers();
      std::lock_guard<std::mutex> lock(mu);
      return error;
    }
    return Status::Ok();
  }

  void JoinWorkers() {
    for (auto& t : workers) {
      if (t.joinable()) t.join();
    }
    workers.clear();
  }

  // Closes the pipeline and waits until every block is done (written, or dropped after a
  // failure, its device copy complete and its staging piece back).
  void Drain() {
    {
      std::unique_lock<std::mutex> lock(mu);
      closed = true;
      work_cv.notify_all();
      done_cv.wait(lock, [&] { return blocks_done == blocks.size(); });
    }
    work_cv.notify_all();
    JoinWorkers();
  }

  void Work() {
    void* bound = nullptr;  // the CUDA context this thread has made current
    std::vector<uint8_t> scratch;
    std::unique_lock<std::mutex> lock(mu);
    for (;;) {
      if (!write_queue.empty()) {
        Block* b = write_queue.front();
        write_queue.pop_front();
        b->state = Block::State::kWriting;
        const bool skip = failed;
        lock.unlock();
        Status st;
        if (!skip && sink) {
          st = sink->Put(b->offset - b->pad, nullptr, b->pad);
          if (st.ok()) st = sink->Put(b->offset, b->data, b->stored);
        } else if (!skip && b->stored > 0) {
          st = file.PWriteAll(b->data, b->stored, b->offset);
        }
        if (!skip && st.ok() && options.progress) st = Report(b->n);
        if (b->pool != nullptr) b->pool->Release(b->piece);
        lock.lock();
        if (!st.ok()) Fail(std::move(st));
        if (b->out) free_bufs.push_back(std::move(b->out));
        b->state = Block::State::kDone;
        b->rec->pending--;
        ++blocks_done;
        done_cv.notify_all();
        if (closed && blocks_done == blocks.size()) work_cv.notify_all();
        continue;
      }
      if (next_encode < blocks.size() && next_encode < seq + window) {
        Block* b = &blocks[next_encode++];
        b->state = Block::State::kEncoding;
        const bool skip = failed;
        std::unique_ptr<std::vector<uint8_t>> out;
        if (!skip && b->rec->encoding != Encoding::kRaw) {
          if (free_bufs.empty()) {
            out = std::make_unique<std::vector<uint8_t>>();
          } else {
            out = std::move(free_bufs.back());
            free_bufs.pop_back();
          }
        }
        if (b->event != nullptr) device->BindWorker(&bound);
        lock.unlock();
        Status st = Encode(*b, std::move(out), skip, scratch);
        lock.lock();
        if (b->event != nullptr) {
          device->Recycle(b->event);
          b->event = nullptr;
        }
        if (!st.ok()) Fail(std::move(st));
        b->state = Block::State::kEncoded;
        Sequence();
        continue;
      }
      if (closed && blocks_done == blocks.size()) return;
      work_cv.wait(lock);
    }
  }

  // Waits for the block's bytes, then checksums and encodes them. Runs without mu.
  Status Encode(Block& b, std::unique_ptr<std::vector<uint8_t>> out, bool skip,
                std::vector<uint8_t>& scratch) {
    if (b.event != nullptr) {
      // Even a failed save waits: the copy writes into a staging piece that is about to be
      // handed out again.
      FERRY_RETURN_IF_ERROR(device->WaitCopy(b.event, b.rec->name));
    }
    if (skip || b.n == 0) return Status::Ok();
    b.checksum = Checksum64(b.raw, b.n);
    b.data = b.raw;
    b.stored = b.n;
    if (b.rec->encoding == Encoding::kRaw) return Status::Ok();
    const uint8_t* input = b.raw;
    size_t width = ShuffleWidth(b.rec->dtype);
    if (b.rec->encoding == Encoding::kPlanes) return EncodePlanes(b, std::move(out), scratch);
    b.codec = ChunkCodec::kZstd;
    if (b.rec->encoding == Encoding::kShuffleZstd && width > 1) {
      if (scratch.size() < b.n) scratch.resize(b.n);
      Shuffle(b.raw, scratch.data(), b.n, width);
      input = scratch.data();
    }
    size_t bound = CompressBound(b.n);
    if (out->size() < bound) out->resize(bound);
    auto csize = ZstdCompress(input, b.n, out->data(), bound, options.zstd_level);
    if (!csize.ok()) {
      return Error(csize.status().code(), path, ": tensor ", Quote(b.rec->name), ": ",
                   csize.status().message());
    }
    b.compressed =
        static_cast<double>(*csize) <= static_cast<double>(b.n) * (1.0 - options.min_savings);
    if (b.compressed) {
      b.stored = *csize;
    } else if (input != b.raw) {
      // Stored chunks of a shuffled tensor hold the shuffled bytes (the reader unshuffles).
      std::memcpy(out->data(), input, b.n);
    } else {
      out.reset();  // stored as they are: written straight from `raw`
    }
    if (out) {
      b.data = out->data();
      b.out = std::move(out);
    }
    return Status::Ok();
  }

  // Planes blocks that do not pay are stored raw and unshuffled: the loader then copies them
  // like raw data, straight from `raw`.
  Status EncodePlanes(Block& b, std::unique_ptr<std::vector<uint8_t>> out,
                      std::vector<uint8_t>& scratch) {
    if (scratch.size() < b.n) scratch.resize(b.n);
    const size_t bound = planes::Bound(b.n);
    if (out->size() < bound) out->resize(bound);
    const size_t n = planes::Encode(b.raw, b.n, ShuffleWidth(b.rec->dtype), out->data(),
                                    scratch.data(), options.min_savings);
    b.codec = ChunkCodec::kPlanes;
    b.compressed = n > 0;
    if (!b.compressed) return Status::Ok();
    b.stored = n;
    b.data = out->data();
    b.out = std::move(out);
    return Status::Ok();
  }

  // Gives offsets to the encoded blocks at the head of the sequence, in block order (the
  // file layout is the same as a one-thread writer's). Called with mu held.
  void Sequence() {
    bool any = false;
    while (seq < blocks.size() && blocks[seq].state == Block::State::kEncoded) {
      Block& b = blocks[seq++];
      TensorRecord& r = *b.rec;
      if (!failed) {
        const uint64_t end = pos;
        if (b.first) {
          pos = AlignUp(pos, format::TensorAlignment(r.nbytes));
          r.data_offset = pos;
        }
        b.offset = pos;
        b.pad = pos - end;
        if (b.n > 0) r.checksums.push_back(b.checksum);
        if (r.encoding != Encoding::kRaw && b.n > 0) {
          r.chunks.push_back(ChunkRecord{pos - r.data_offset, b.stored,
                                         b.compressed ? b.codec : ChunkCodec::kStored});
        }
        pos += b.stored;
        if (b.last) {
          r.data_size = pos - r.data_offset;
          if (r.data_size == 0) r.data_offset = 0;
        }
      }
      b.state = Block::State::kAssigned;
      write_queue.push_back(&b);
      any = true;
    }
    if (any) work_cv.notify_all();
  }

  void Push(Block&& b) {
    {
      std::lock_guard<std::mutex> lock(mu);
      b.rec->pending++;
      blocks.push_back(std::move(b));
    }
    work_cv.notify_one();
  }

  // ---- staging ----------------------------------------------------------------------------

  Result<StagingPool::Impl*> Pool() {
    if (!pool) {
      FERRY_ASSIGN_OR_RETURN(
          pool, StagingPool::Create(std::max(kDefaultStagingBytes, 2 * options.block_size)));
    }
    if (options.block_size > pool->bytes()) {
      return Error(StatusCode::kInvalidArgument, path, ": block_size ", options.block_size,
                   " exceeds the staging pool of ", pool->bytes(), " bytes");
    }
    return &pool->impl();
  }

  Status WaitSnapshot() {
    if (device) FERRY_RETURN_IF_ERROR(device->WaitAll());
    return PipelineStatus();
  }

  // ---- adding tensors ---------------------------------------------------------------------

  Status Add(std::string_view name, DType dtype, const std::vector<int64_t>& shape,
             const Source& src, Encoding encoding) {
    FERRY_RETURN_IF_ERROR(CheckUsable());
    FERRY_RETURN_IF_ERROR(CheckKey(path, name, "tensor name"));
    if (names.count(name)) {
      return Error(StatusCode::kInvalidArgument, path, ": duplicate tensor ", Quote(name));
    }
    if (!IsValidDType(static_cast<uint8_t>(dtype))) {
      return Error(StatusCode::kInvalidArgument, path, ": tensor ", Quote(name), ": unknown dtype ",
                   static_cast<int>(dtype));
    }
    if (static_cast<uint8_t>(encoding) > 3) {
      return Error(StatusCode::kInvalidArgument, path, ": tensor ", Quote(name),
                   ": unknown encoding ", static_cast<int>(encoding));
    }
    if (shape.size() > format::kMaxDims) {
      return Error(StatusCode::kInvalidArgument, path, ": tensor ", Quote(name), ": ", shape.size(),
                   " dims (limit ", format::kMaxDims, ")");
    }
    auto numel = NumElements(shape);
    auto nbytes = numel ? StorageBytes(dtype, *numel) : std::nullopt;
    if (!nbytes) {
      return Error(StatusCode::kInvalidArgument, path, ": tensor ", Quote(name),
                   ": shape has a negative dim or its size overflows");
    }
    if (src.kind != Source::Kind::kFill) {
      const bool null =
          src.kind == Source::Kind::kHost ? src.host == nullptr : src.device == nullptr;
      if (src.host_bytes != *nbytes || (null && *nbytes > 0)) {
        return Error(StatusCode::kInvalidArgument, path, ": tensor ", Quote(name), ": ",
                     DTypeName(dtype), " shape needs ", *nbytes, " bytes, got ", src.host_bytes);
      }
    }
    const std::string where = StrCat(path, ": tensor ", Quote(name));
    const bool staged = src.kind != Source::Kind::kHost || options.staging != nullptr;
    StagingPool::Impl* staging = nullptr;
    if (staged && *nbytes > 0) {
      FERRY_ASSIGN_OR_RETURN(staging, Pool());
    }
    if (src.kind == Source::Kind::kDevice) {
      if (!device) device = std::make_unique<DeviceSnapshot>(path);
      FERRY_RETURN_IF_ERROR(device->Bind(where, src.device, *nbytes));
      if (staging != nullptr) {
        Status st = staging->EnsurePinned();
        if (!st.ok()) return Error(st.code(), where, ": ", st.message());
      }
    }
    FERRY_RETURN_IF_ERROR(PipelineStatus());
    FERRY_RETURN_IF_ERROR(StartWorkers());

    tensors.emplace_back();
    TensorRecord& rec = tensors.back();
    rec.name = std::string(name);
    rec.dtype = dtype;
    rec.shape = shape;
    rec.nbytes = *nbytes;
    rec.encoding = *nbytes == 0 ? Encoding::kRaw : encoding;
    rec.block_size = *nbytes == 0 ? 0 : options.block_size;
    names.insert(rec.name);

    const uint64_t bs = options.block_size;
    uint64_t off = 0;
    do {
      Block b;
      b.rec = &rec;
      b.raw_off = off;
      b.n = static_cast<size_t>(std::min(bs, rec.nbytes - off));
      b.first = off == 0;
      b.last = off + b.n == rec.nbytes;
      Status st;
      if (b.n > 0 && staging != nullptr) {
        auto piece = staging->Acquire(b.n);
        if (!piece.ok()) {
          st = Error(piece.status().code(), where, ": ", piece.status().message());
        } else {
          b.pool = staging;
          b.piece = piece->id;
          b.raw = piece->data;
        }
      }
      if (st.ok() && b.n > 0) {
        switch (src.kind) {
          case Source::Kind::kHost:
            if (b.pool != nullptr) {
              std::memcpy(const_cast<uint8_t*>(b.raw), src.host + off, b.n);
            } else {
              b.raw = src.host + off;
            }
            break;
          case Source::Kind::kFill:
            st = (*src.fill)(off, const_cast<uint8_t*>(b.raw), b.n);
            if (!st.ok()) {
              st = Error(st.code(), where, ": source failed at byte ", off, ": ", st.message());
            }
            break;
          case Source::Kind::kDevice: {
            auto ev = device->Copy(const_cast<uint8_t*>(b.raw), src.device + off, b.n, src.stream,
                                   where, off);
            if (ev.ok()) {
              b.event = *ev;
            } else {
              st = ev.status();
            }
            break;
          }
        }
      }
      if (!st.ok()) {
        // The file now misses part of this tensor: the whole save is spoiled.
        if (b.pool != nullptr) b.pool->Release(b.piece);
        std::lock_guard<std::mutex> lock(mu);
        Fail(st);
        return st;
      }
      Push(std::move(b));
      off += bs;
    } while (off < rec.nbytes);
    if (src.kind == Source::Kind::kDevice && rec.nbytes > 0) {
      Status st = device->RecordTail(src.stream);
      if (!st.ok()) {
        std::lock_guard<std::mutex> lock(mu);
        Fail(st);
        return st;
      }
    }
    if (!staged) {
      // The blocks point into the caller's memory: return once they are in the file.
      std::unique_lock<std::mutex> lock(mu);
      done_cv.wait(lock, [&] { return rec.pending == 0; });
      return failed ? error : Status::Ok();
    }
    return PipelineStatus();
  }

  // Every tensor a quantized tensor names must have been added.
  Status CheckQuantizedRefs() const {
    for (const auto& [qname, q] : extras.quantized) {
      for (const auto* c : {&q.rowwise, &q.columnwise}) {
        if (!*c) continue;
        for (const std::string* ref : {&(*c)->data, &(*c)->scale_inv, &(*c)->amax}) {
          if (ref->empty() && ref != &(*c)->data) continue;
          if (!names.count(*ref)) {
            return Error(StatusCode::kInvalidArgument, path, ": quantized tensor ", Quote(qname),
                         " refers to tensor ", Quote(*ref), ", which was not added");
          }
        }
      }
    }
    return Status::Ok();
  }

  // Drains the pipeline, writes footer and trailer, fsyncs and renames. On failure the
  // temporary file is removed and `path` is untouched.
  Status Finish() {
    Drain();
    Status st = PipelineStatus();
    if (st.ok()) st = CheckQuantizedRefs();
    Result<std::vector<uint8_t>> footer = std::vector<uint8_t>();
    if (st.ok()) {
      std::vector<const format::TensorRecord*> records;
      records.reserve(tensors.size());
      for (const TensorRecord& t : tensors) records.push_back(&t);
      footer = format::BuildFooter(std::move(records), extras, path);
      st = footer.status();
    }
    if (st.ok()) {
      const uint64_t footer_at = AlignUp(pos, 8);
      const uint64_t footer_size = footer->size();
      const auto trailer = format::MakeTrailer(*footer);
      if (sink) {
        st = sink->Put(pos, nullptr, footer_at - pos);
        if (st.ok()) st = sink->Put(footer_at, footer->data(), footer_size);
        if (st.ok()) st = sink->Put(footer_at + footer_size, trailer.data(), trailer.size());
        if (st.ok()) st = sink->Finish(footer_at + footer_size + trailer.size(), file);
      } else {
        st = file.PWriteAll(footer->data(), footer_size, footer_at);
        if (st.ok()) st = file.PWriteAll(trailer.data(), trailer.size(), footer_at + footer_size);
      }
    }
    sink.reset();
    if (st.ok() && options.durable) st = file.Sync();
    if (st.ok()) st = KeepPermissions(file, dest);
    if (st.ok()) st = file.Close();
    if (st.ok()) st = RenameFile(tmp_path, dest);
    if (!st.ok()) {
      (void)file.Close();
      ::unlink(tmp_path.c_str());
      return st;
    }
    finished = true;
    if (options.durable) FERRY_RETURN_IF_ERROR(SyncParentDir(dest));
    return Status::Ok();
  }

  Status Commit() {
    FERRY_RETURN_IF_ERROR(CheckUsable());
    spent = true;
    return Finish();
  }
};

Writer::Writer(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
Writer::Writer(Writer&&) noexcept = default;
Writer& Writer::operator=(Writer&&) noexcept = default;
Writer::~Writer() = default;

Result<Writer> Writer::Create(const std::string& path, WriterOptions options) {
  if (path.empty()) return Error(StatusCode::kInvalidArgument, "empty checkpoint path");
  uint64_t bs = options.block_size;
  if (bs < format::kMinBlockSize || bs > format::kMaxBlockSize || (bs & (bs - 1)) != 0) {
    return Error(StatusCode::kInvalidArgument, path, ": block_size ", bs,
                 " must be a power of two in [", format::kMinBlockSize, ", ", format::kMaxBlockSize,
                 "]");
  }
  if (static_cast<uint8_t>(options.encoding) > 3) {
    return Error(StatusCode::kInvalidArgument, path, ": unknown encoding ",
                 static_cast<int>(options.encoding));
  }
  if (options.min_savings < 0 || options.min_savings >= 1) {
    return Error(StatusCode::kInvalidArgument, path, ": min_savings ", options.min_savings,
                 " outside [0, 1)");
  }
  if (options.staging && options.block_size > options.staging->bytes()) {
    return Error(StatusCode::kInvalidArgument, path, ": block_size ", options.block_size,
                 " exceeds the staging pool of ", options.staging->bytes(), " bytes");
  }
  auto impl = std::make_shared<Impl>();
  impl->path = path;
  impl->options = std::move(options);
  impl->pool = impl->options.staging;
  impl->extras.producer = impl->options.producer;
  FERRY_ASSIGN_OR_RETURN(impl->dest, ReplaceTarget(path));
  impl->tmp_path = TempPath(impl->dest);
  FERRY_ASSIGN_OR_RETURN(impl->file, File::CreateExclusive(impl->tmp_path));
  // Bytes between the magic and the first tensor, and between tensors, are never written:
  // they read as zeros (holes).
  if (impl->options.direct_io) impl->sink = DirectSink::Open(impl->tmp_path, &impl->file);
  if (!impl->sink) {
    FERRY_RETURN_IF_ERROR(impl->file.PWriteAll(format::kMagic, format::kMagicSize, 0));
  }
  return Writer(std::move(impl));
}

Status Writer::AddTensor(std::string_view name, DType dtype, const std::vector<int64_t>& shape,
                         const void* data, uint64_t nbytes) {
  return AddTensor(name, dtype, shape, data, nbytes, impl_->options.encoding);
}

Status Writer::AddTensor(std::string_view name, DType dtype, const std::vector<int64_t>& shape,
                         const void* data, uint64_t nbytes, Encoding encoding) {
  if (!impl_) return Error(StatusCode::kInvalidArgument, "moved-from Writer");
  Source src;
  src.host = static_cast<const uint8_t*>(data);
  src.host_bytes = nbytes;
  return impl_->Add(name, dtype, shape, src, encoding);
}

Status Writer::AddTensorFrom(std::string_view name, DType dtype, const std::vector<int64_t>& shape,
                             const FillFn& fill, Encoding encoding) {
  if (!impl_) return Error(StatusCode::kInvalidArgument, "moved-from Writer");
  if (!fill) return Error(StatusCode::kInvalidArgument, impl_->path, ": empty fill function");
  Source src;
  src.kind = Source::Kind::kFill;
  src.fill = &fill;
  return impl_->Add(name, dtype, shape, src, encoding);
}

Status Writer::AddDeviceTensor(std::string_view name, DType dtype,
                               const std::vector<int64_t>& shape, const void* device_data,
                               uint64_t nbytes, Stream stream) {
  if (!impl_) return Error(StatusCode::kInvalidArgument, "moved-from Writer");
  return AddDeviceTensor(name, dtype, shape, device_data, nbytes, stream, impl_->options.encoding);
}

Status Writer::AddDeviceTensor(std::string_view name, DType dtype,
                               const std::vector<int64_t>& shape, const void* device_data,
                               uint64_t nbytes, Stream stream, Encoding encoding) {
  if (!impl_) return Error(StatusCode::kInvalidArgument, "moved-from Writer");
  Source src;
  src.kind = Source::Kind::kDevice;
  src.device = static_cast<const uint8_t*>(device_data);
  src.host_bytes = nbytes;
  src.stream = stream;
  return impl_->Add(name, dtype, shape, src, encoding);
}

Status Writer::WaitSnapshot() {
  if (!impl_) return Error(StatusCode::kInvalidArgument, "moved-from Writer");
  FERRY_RETURN_IF_ERROR(impl_->CheckUsable());
  return impl_->WaitSnapshot();
}

Result<SaveHandle> Writer::CommitAsync() {
  if (!impl_) return Error(StatusCode::kInvalidArgument, "moved-from Writer");
  FERRY_RETURN_IF_ERROR(impl_->CheckUsable());
  Status st = impl_->WaitSnapshot();
  if (!st.ok()) {
    impl_->Abort();
    return st;
  }
  impl_->spent = true;
  auto state = std::make_shared<SaveHandle::State>();
  state->path = impl_->path;
  auto finish = [state](std::shared_ptr<Impl> impl) {
    Status result = impl->Finish();
    // Workers are joined by Finish; the rest goes with the last reference (this one, unless
    // the Writer still exists).
    impl.reset();
    {
      std::lock_guard<std::mutex> lock(state->mu);
      state->status = std::move(result);
      state->done = true;
    }
    state->cv.notify_all();
  };
  try {
    std::thread(finish, impl_).detach();
  } catch (const std::system_error&) {
    finish(impl_);  // no thread to spare: finish here, before returning
  }
  return SaveHandle(std::move(state));
}

Status Writer::SetGlobalSlice(std::string_view name, const std::vector<int64_t>& global_shape,
                              const std::vector<int64_t>& offset) {
  if (!impl_) return Error(StatusCode::kInvalidArgument, "moved-from Writer");
  FERRY_RETURN_IF_ERROR(impl_->CheckUsable());
  auto& tensors = impl_->tensors;
  // Usually called right after AddTensor: look at the newest record before searching.
  auto it = !tensors.empty() && tensors.back().name == name
                ? tensors.end() - 1
                : std::find_if(tensors.begin(), tensors.end(),
                               [&](const TensorRecord& t) { return t.name == name; });
  if (it == tensors.end()) {
    return Error(StatusCode::kNotFound, impl_->path, ": SetGlobalSlice of ", Quote(name),
                 ", which was not added");
  }
  const std::vector<int64_t>& shape = it->shape;
  if (global_shape.size() != shape.size() || offset.size() != shape.size()) {
    return Error(StatusCode::kInvalidArgument, impl_->path, ": tensor ", Quote(name), " has ",
                 shape.size(), " dims, but the global shape has ", global_shape.size(),
                 " and the offset ", offset.size());
  }
  if (!NumElements(global_shape)) {
    return Error(StatusCode::kInvalidArgument, impl_->path, ": tensor ", Quote(name),
                 ": global shape has a negative dim or its size overflows");
  }
  for (size_t d = 0; d < shape.size(); ++d) {
    if (offset[d] < 0 || offset[d] > global_shape[d] - shape[d]) {
      return Error(StatusCode::kInvalidArgument, impl_->path, ": tensor ", Quote(name), ": dim ", d,
                   " covers [", offset[d], ", ", offset[d] + shape[d], ") of a global extent of ",
                   global_shape[d]);
    }
  }
  it->global_shape = global_shape;
  it->shard_offset = offset;
  return Status::Ok();
}

Status Writer::AddQuantized(const QuantizedTensor& tensor) {
  if (!impl_) return Error(StatusCode::kInvalidArgument, "moved-from Writer");
  FERRY_RETURN_IF_ERROR(impl_->CheckUsable());
  FERRY_RETURN_IF_ERROR(CheckKey(impl_->path, tensor.name, "quantized tensor name"));
  if (!NumElements(tensor.shape) || tensor.shape.size() > format::kMaxDims) {
    return Error(StatusCode::kInvalidArgument, impl_->path, ": quantized tensor ",
                 Quote(tensor.name), ": bad shape");
  }
  for (const auto* c : {&tensor.rowwise, &tensor.columnwise}) {
    if (*c && (*c)->data.empty()) {
      return Error(StatusCode::kInvalidArgument, impl_->path, ": quantized tensor ",
                   Quote(tensor.name), ": a component needs a data tensor");
    }
  }
  if (!impl_->extras.quantized.emplace(tensor.name, tensor).second) {
    return Error(StatusCode::kInvalidArgument, impl_->path, ": duplicate quantized tensor ",
                 Quote(tensor.name));
  }
  return Status::Ok();
}

Status Writer::AddScalingState(const ScalingState& state) {
  if (!impl_) return Error(StatusCode::kInvalidArgument, "moved-from Writer");
  FERRY_RETURN_IF_ERROR(impl_->CheckUsable());
  FERRY_RETURN_IF_ERROR(CheckKey(impl_->path, state.module, "scaling state module"));
  if (const auto* c = std::get_if<CustomRecipe>(&state.recipe); c && c->name.empty()) {
    return Error(StatusCode::kInvalidArgument, impl_->path, ": scaling state ", Quote(state.module),
                 ": a custom recipe needs a name");
  }
  for (const DirectionState& d : state.states) {
    uint64_t slots = d.slot_roles.size();
    if (d.scale.size() != slots || d.history_len < 0 ||
        d.amax_history.size() != static_cast<uint64_t>(d.history_len) * slots) {
      return Error(StatusCode::kInvalidArgument, impl_->path, ": scaling state ",
                   Quote(state.module),
                   ": needs scale F32[S] and amax_history F32[L, S] with S=", slots,
                   " slot roles and L=", d.history_len, "; got ", d.scale.size(), " scales and ",
                   d.amax_history.size(), " history entries");
    }
  }
  if (!impl_->extras.scaling.emplace(state.module, state).second) {
    return Error(StatusCode::kInvalidArgument, impl_->path, ": duplicate scaling state ",
                 Quote(state.module));
  }
  return Status::Ok();
}

Status Writer::SetMetadata(std::string_view key, std::string_view value) {
  if (!impl_) return Error(StatusCode::kInvalidArgument, "moved-from Writer");
  FERRY_RETURN_IF_ERROR(impl_->CheckUsable());
  FERRY_RETURN_IF_ERROR(CheckKey(impl_->path, key, "metadata key"));
  impl_->extras.metadata[std::string(key)] = std::string(value);
  return Status::Ok();
}

Status Writer::Commit() {
  if (!impl_) return Error(StatusCode::kInvalidArgument, "moved-from Writer");
  return impl_->Commit();
}

void Writer::Abort() {
  if (impl_) impl_->Abort();
}

SaveHandle::SaveHandle() = default;
SaveHandle::SaveHandle(std::shared_ptr<State> state) : state_(std::move(state)) {}
SaveHandle::SaveHandle(SaveHandle&&) noexcept = default;
SaveHandle& SaveHandle::operator=(SaveHandle&& other) noexcept {
  if (this != &other) {
    (void)Wait();
    state_ = std::move(other.state_);
  }
  return *this;
}
SaveHandle::~SaveHandle() { (void)Wait(); }

Status SaveHandle::Wait() {
  if (!state_) return Error(StatusCode::kInvalidArgument, "SaveHandle without a save");
  std::unique_lock<std::mutex> lock(state_->mu);
  state_->cv.wait(lock, [&] { return state_->done; });
  return state_->status;
}

bool SaveHandle::done() const {
  if (!state_) return true;
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->done;
}

const std::string& SaveHandle::path() const {
  static const std::string kEmpty;
  return state_ ? state_->path : kEmpty;
}

const std::string& Writer::path() const {
  static const std::string kEmpty;
  return impl_ ? impl_->path : kEmpty;
}

}  // namespace ferry
