// The block pipeline of a save (src/save/block_pipeline.hpp).
#include "save/block_pipeline.hpp"

#include <algorithm>
#include <cstring>

#include "base/util.hpp"
#include "codec/codec.hpp"
#include "codec/planes.hpp"

namespace ferry {

namespace {

using format::ChunkCodec;
using format::ChunkRecord;

int Threads(const WriterOptions& options) {
  return options.threads > 0 ? options.threads : DefaultThreads();
}

}  // namespace

BlockPipeline::BlockPipeline(std::string path, const WriterOptions& options, File* file,
                             std::unique_ptr<DirectSink> sink, DeviceSnapshot* device)
    : path_(std::move(path)),
      threads_(Threads(options)),
      zstd_level_(options.zstd_level),
      min_savings_(options.min_savings),
      progress_(options.progress),
      file_(file),
      sink_(std::move(sink)),
      device_(device) {}

BlockPipeline::~BlockPipeline() { workers_.Join(); }

// First error wins. Called with mu_ held.
void BlockPipeline::FailLocked(Status st) {
  if (!failed_) {
    failed_ = true;
    if (sink_) sink_->Cancel(st);
    error_ = std::move(st);
  }
}

void BlockPipeline::Fail(Status st) {
  std::lock_guard<std::mutex> lock(mu_);
  FailLocked(std::move(st));
}

Status BlockPipeline::status() {
  std::lock_guard<std::mutex> lock(mu_);
  return failed_ ? error_ : Status::Ok();
}

Status BlockPipeline::Report(uint64_t n) {
  std::lock_guard<std::mutex> lock(progress_mu_);
  progress_done_ += n;
  return progress_(progress_done_);
}

Status BlockPipeline::Start() {
  if (workers_.size() > 0) return Status::Ok();
  window_ = 2 * static_cast<uint64_t>(threads_) + 2;
  Status st = workers_.Start(
      threads_, [this](int) { Work(); }, StrCat(path_, ": cannot start writer thread"));
  if (st.ok()) return st;
  {
    std::lock_guard<std::mutex> lock(mu_);
    FailLocked(std::move(st));
    closed_ = true;
  }
  work_cv_.notify_all();
  workers_.Join();
  std::lock_guard<std::mutex> lock(mu_);
  return error_;
}

void BlockPipeline::Drain() {
  FlushSmall();
  {
    std::unique_lock<std::mutex> lock(mu_);
    closed_ = true;
    work_cv_.notify_all();
    done_cv_.wait(lock, [&] { return blocks_done_ == blocks_.size(); });
  }
  work_cv_.notify_all();
  workers_.Join();
}

void BlockPipeline::Push(Block&& b) {
  FlushSmall();
  {
    std::lock_guard<std::mutex> lock(mu_);
    b.rec->pending++;
    blocks_.push_back(std::move(b));
  }
  work_cv_.notify_one();
}

uint8_t* BlockPipeline::AddSmall(PipelineTensor* rec, size_t n) {
  if (gathered_ + n > kBatchBytes) FlushSmall();
  if (!gathering_.batch_bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    if (free_batches_.empty()) {
      gathering_.batch_bytes.reset(new uint8_t[kBatchBytes]);
    } else {
      gathering_.batch_bytes = std::move(free_batches_.back());
      free_batches_.pop_back();
    }
  }
  Block b;
  b.rec = rec;
  b.n = n;
  b.raw = gathering_.batch_bytes.get() + gathered_;
  b.first = b.last = true;
  gathered_ += n;
  gathering_.parts.push_back(std::move(b));
  return const_cast<uint8_t*>(gathering_.parts.back().raw);
}

void BlockPipeline::FlushSmall() {
  if (gathering_.parts.empty()) return;
  Block batch = std::move(gathering_);
  gathering_ = Block();
  gathered_ = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    blocks_.push_back(std::move(batch));
  }
  work_cv_.notify_one();
}

Status BlockPipeline::WaitWritten(const PipelineTensor& rec) {
  std::unique_lock<std::mutex> lock(mu_);
  done_cv_.wait(lock, [&] { return rec.pending == 0; });
  return failed_ ? error_ : Status::Ok();
}

void BlockPipeline::Work() {
  void* bound = nullptr;  // the CUDA context this thread has made current
  std::vector<uint8_t> scratch, span;
  std::unique_ptr<std::vector<uint8_t>> spare;  // a batch's encode buffer, reused
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    if (!write_queue_.empty()) {
      Block* b = write_queue_.front();
      write_queue_.pop_front();
      b->state = Block::State::kWriting;
      const bool skip = failed_;
      lock.unlock();
      Status st = skip ? Status::Ok() : WriteBlock(*b, span);
      if (b->pool != nullptr) b->pool->Release(b->piece);
      lock.lock();
      if (!st.ok()) FailLocked(std::move(st));
      if (b->out) free_bufs_.push_back(std::move(b->out));
      if (b->batch_bytes) free_batches_.push_back(std::move(b->batch_bytes));
      b->parts = std::vector<Block>();
      b->state = Block::State::kDone;
      if (b->rec != nullptr) b->rec->pending--;
      ++blocks_done_;
      done_cv_.notify_all();
      if (closed_ && blocks_done_ == blocks_.size()) work_cv_.notify_all();
      continue;
    }
    if (next_encode_ < blocks_.size() && next_encode_ < seq_ + window_) {
      Block* b = &blocks_[next_encode_++];
      b->state = Block::State::kEncoding;
      const bool skip = failed_;
      std::unique_ptr<std::vector<uint8_t>> out;
      if (!skip && (b->rec == nullptr || b->rec->encoding != Encoding::kRaw)) {
        if (free_bufs_.empty()) {
          out = std::make_unique<std::vector<uint8_t>>();
        } else {
          out = std::move(free_bufs_.back());
          free_bufs_.pop_back();
        }
      }
      if (b->event != nullptr) device_->BindWorker(&bound);
      lock.unlock();
      Status st = b->rec == nullptr ? EncodeBatch(*b, out, skip, scratch, spare)
                                    : Encode(*b, out, skip, scratch);
      lock.lock();
      if (out) free_bufs_.push_back(std::move(out));
      if (b->event != nullptr) {
        device_->Recycle(b->event);
        b->event = nullptr;
      }
      if (!st.ok()) FailLocked(std::move(st));
      b->state = Block::State::kEncoded;
      Sequence();
      continue;
    }
    if (closed_ && blocks_done_ == blocks_.size()) return;
    work_cv_.wait(lock);
  }
}

// A block's stored bytes, or a batch's as one run (the zeros between its blocks included).
// Runs without mu_.
Status BlockPipeline::WriteBlock(Block& b, std::vector<uint8_t>& span) {
  uint64_t raw = b.n;
  if (b.parts.empty()) {
    if (sink_) {
      FERRY_RETURN_IF_ERROR(sink_->Put(b.offset - b.pad, nullptr, b.pad));
      FERRY_RETURN_IF_ERROR(sink_->Put(b.offset, b.data, b.stored));
    } else if (b.stored > 0) {
      FERRY_RETURN_IF_ERROR(file_->PWriteAll(b.data, b.stored, b.offset));
    }
  } else {
    const uint64_t begin = b.parts.front().offset - b.parts.front().pad;
    const uint64_t end = b.parts.back().offset + b.parts.back().stored;
    span.assign(end - begin, 0);
    raw = 0;
    for (const Block& p : b.parts) {
      if (p.stored > 0) std::memcpy(span.data() + (p.offset - begin), p.data, p.stored);
      raw += p.n;
    }
    if (sink_) {
      FERRY_RETURN_IF_ERROR(sink_->Put(begin, span.data(), span.size()));
    } else if (!span.empty()) {
      FERRY_RETURN_IF_ERROR(file_->PWriteAll(span.data(), span.size(), begin));
    }
  }
  return progress_ ? Report(raw) : Status::Ok();
}

// Encodes every block of a batch, one after another. The stored bytes of those that encoding
// changed are gathered in `out` (becoming the batch's), so a batch owns one buffer whatever
// its size; `spare` is the per-block buffer each is encoded into first. Runs without mu_.
Status BlockPipeline::EncodeBatch(Block& batch, std::unique_ptr<std::vector<uint8_t>>& out,
                                  bool skip, std::vector<uint8_t>& scratch,
                                  std::unique_ptr<std::vector<uint8_t>>& spare) {
  std::vector<size_t> at(batch.parts.size(), SIZE_MAX);
  size_t used = 0;
  for (size_t i = 0; i < batch.parts.size(); ++i) {
    Block& p = batch.parts[i];
    if (!skip && !spare && p.rec->encoding != Encoding::kRaw && p.n > 0) {
      spare = std::make_unique<std::vector<uint8_t>>();
    }
    FERRY_RETURN_IF_ERROR(Encode(p, spare, skip, scratch));
    if (p.out) {
      if (out->size() < used + p.stored) out->resize(std::max(used + p.stored, 2 * out->size()));
      std::memcpy(out->data() + used, p.data, p.stored);
      at[i] = used;
      used += p.stored;
      spare = std::move(p.out);
    }
  }
  if (used == 0) return Status::Ok();
  for (size_t i = 0; i < batch.parts.size(); ++i) {
    if (at[i] != SIZE_MAX) batch.parts[i].data = out->data() + at[i];
  }
  batch.out = std::move(out);
  return Status::Ok();
}

// Waits for the block's bytes, then checksums and encodes them. The block keeps `out` (as its
// `out`) when its stored bytes are there; otherwise `out` is left to the caller. Runs without
// mu_.
Status BlockPipeline::Encode(Block& b, std::unique_ptr<std::vector<uint8_t>>& out, bool skip,
                             std::vector<uint8_t>& scratch) {
  if (b.event != nullptr) {
    // Even a failed save waits: the copy writes into a staging piece that is about to be
    // handed out again.
    FERRY_RETURN_IF_ERROR(device_->WaitCopy(b.event, b.rec->name));
  }
  if (skip || b.n == 0) return Status::Ok();
  b.checksum = Checksum64(b.raw, b.n);
  b.data = b.raw;
  b.stored = b.n;
  if (b.rec->encoding == Encoding::kRaw) return Status::Ok();
  const uint8_t* input = b.raw;
  size_t width = ShuffleWidth(b.rec->dtype);
  if (b.rec->encoding == Encoding::kPlanes) return EncodePlanes(b, out, scratch);
  b.codec = ChunkCodec::kZstd;
  if (b.rec->encoding == Encoding::kShuffleZstd && width > 1) {
    if (scratch.size() < b.n) scratch.resize(b.n);
    Shuffle(b.raw, scratch.data(), b.n, width);
    input = scratch.data();
  }
  size_t bound = CompressBound(b.n);
  if (out->size() < bound) out->resize(bound);
  auto csize = ZstdCompress(input, b.n, out->data(), bound, zstd_level_);
  if (!csize.ok()) {
    return Error(csize.status().code(), path_, ": tensor ", Quote(b.rec->name), ": ",
                 csize.status().message());
  }
  b.compressed = static_cast<double>(*csize) <= static_cast<double>(b.n) * (1.0 - min_savings_);
  if (b.compressed) {
    b.stored = *csize;
  } else if (input != b.raw) {
    // Stored chunks of a shuffled tensor hold the shuffled bytes (the reader unshuffles).
    std::memcpy(out->data(), input, b.n);
  } else {
    return Status::Ok();  // stored as they are: written straight from `raw`
  }
  b.data = out->data();
  b.out = std::move(out);
  return Status::Ok();
}

// Planes blocks that do not pay are stored raw and unshuffled: the loader then copies them
// like raw data, straight from `raw`.
Status BlockPipeline::EncodePlanes(Block& b, std::unique_ptr<std::vector<uint8_t>>& out,
                                   std::vector<uint8_t>& scratch) {
  if (scratch.size() < b.n) scratch.resize(b.n);
  const size_t bound = planes::Bound(b.n);
  if (out->size() < bound) out->resize(bound);
  const size_t n = planes::Encode(b.raw, b.n, ShuffleWidth(b.rec->dtype), out->data(),
                                  scratch.data(), min_savings_);
  b.codec = ChunkCodec::kPlanes;
  b.compressed = n > 0;
  if (!b.compressed) return Status::Ok();
  b.stored = n;
  b.data = out->data();
  b.out = std::move(out);
  return Status::Ok();
}

// Gives offsets to the encoded blocks at the head of the sequence, in block order (the
// file layout is the same as a one-thread writer's). Called with mu_ held.
void BlockPipeline::Sequence() {
  bool any = false;
  while (seq_ < blocks_.size() && blocks_[seq_].state == Block::State::kEncoded) {
    Block& b = blocks_[seq_++];
    if (!failed_) {
      if (b.parts.empty()) {
        Place(b);
      } else {
        for (Block& p : b.parts) Place(p);
      }
    }
    b.state = Block::State::kAssigned;
    write_queue_.push_back(&b);
    any = true;
  }
  if (any) work_cv_.notify_all();
}

// The file offset of one encoded block, and its tensor's record. Called with mu_ held.
void BlockPipeline::Place(Block& b) {
  PipelineTensor& r = *b.rec;
  const uint64_t end = pos_;
  if (b.first) {
    pos_ = AlignUp(pos_, format::TensorAlignment(r.nbytes));
    r.data_offset = pos_;
  }
  b.offset = pos_;
  b.pad = pos_ - end;
  if (b.n > 0) r.checksums.push_back(b.checksum);
  if (r.encoding != Encoding::kRaw && b.n > 0) {
    r.chunks.push_back(
        ChunkRecord{pos_ - r.data_offset, b.stored, b.compressed ? b.codec : ChunkCodec::kStored});
  }
  pos_ += b.stored;
  if (b.last) {
    r.data_size = pos_ - r.data_offset;
    if (r.data_size == 0) r.data_offset = 0;
  }
}

Status BlockPipeline::WriteTail(uint64_t offset, const uint8_t* data, uint64_t n) {
  if (sink_) {
    FERRY_RETURN_IF_ERROR(sink_->Put(pos_, nullptr, offset - pos_));
    FERRY_RETURN_IF_ERROR(sink_->Put(offset, data, n));
  } else {
    FERRY_RETURN_IF_ERROR(file_->PWriteAll(data, n, offset));
  }
  pos_ = offset + n;
  return Status::Ok();
}

Status BlockPipeline::Close(uint64_t size) {
  Status st;
  if (sink_ && size > 0) st = sink_->Finish(size, *file_);
  sink_.reset();
  return st;
}

}  // namespace ferry
