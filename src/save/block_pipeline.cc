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
  {
    std::lock_guard<std::mutex> lock(mu_);
    b.rec->pending++;
    blocks_.push_back(std::move(b));
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
  std::vector<uint8_t> scratch;
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    if (!write_queue_.empty()) {
      Block* b = write_queue_.front();
      write_queue_.pop_front();
      b->state = Block::State::kWriting;
      const bool skip = failed_;
      lock.unlock();
      Status st;
      if (!skip && sink_) {
        st = sink_->Put(b->offset - b->pad, nullptr, b->pad);
        if (st.ok()) st = sink_->Put(b->offset, b->data, b->stored);
      } else if (!skip && b->stored > 0) {
        st = file_->PWriteAll(b->data, b->stored, b->offset);
      }
      if (!skip && st.ok() && progress_) st = Report(b->n);
      if (b->pool != nullptr) b->pool->Release(b->piece);
      lock.lock();
      if (!st.ok()) FailLocked(std::move(st));
      if (b->out) free_bufs_.push_back(std::move(b->out));
      b->state = Block::State::kDone;
      b->rec->pending--;
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
      if (!skip && b->rec->encoding != Encoding::kRaw) {
        if (free_bufs_.empty()) {
          out = std::make_unique<std::vector<uint8_t>>();
        } else {
          out = std::move(free_bufs_.back());
          free_bufs_.pop_back();
        }
      }
      if (b->event != nullptr) device_->BindWorker(&bound);
      lock.unlock();
      Status st = Encode(*b, std::move(out), skip, scratch);
      lock.lock();
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

// Waits for the block's bytes, then checksums and encodes them. Runs without mu_.
Status BlockPipeline::Encode(Block& b, std::unique_ptr<std::vector<uint8_t>> out, bool skip,
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
  if (b.rec->encoding == Encoding::kPlanes) return EncodePlanes(b, std::move(out), scratch);
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
Status BlockPipeline::EncodePlanes(Block& b, std::unique_ptr<std::vector<uint8_t>> out,
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
    PipelineTensor& r = *b.rec;
    if (!failed_) {
      const uint64_t end = pos_;
      if (b.first) {
        pos_ = AlignUp(pos_, format::TensorAlignment(r.nbytes));
        r.data_offset = pos_;
      }
      b.offset = pos_;
      b.pad = pos_ - end;
      if (b.n > 0) r.checksums.push_back(b.checksum);
      if (r.encoding != Encoding::kRaw && b.n > 0) {
        r.chunks.push_back(ChunkRecord{pos_ - r.data_offset, b.stored,
                                       b.compressed ? b.codec : ChunkCodec::kStored});
      }
      pos_ += b.stored;
      if (b.last) {
        r.data_size = pos_ - r.data_offset;
        if (r.data_size == 0) r.data_offset = 0;
      }
    }
    b.state = Block::State::kAssigned;
    write_queue_.push_back(&b);
    any = true;
  }
  if (any) work_cv_.notify_all();
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
