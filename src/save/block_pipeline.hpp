// The block pipeline of a save. The caller's thread cuts every tensor into blocks and pushes
// them in file order; worker threads wait for a block's device copy (if any), checksum and
// encode it; a sequencer gives each encoded block its file offset in push order (compressed
// sizes are known only then), so the layout is the same whatever the thread count; and the
// workers write blocks at their offsets, through the direct sink or with pwrite, in parallel.
//
// Small tensors (AddSmall) are copied into a batch that travels as one unit: one hand-off to
// a worker, one sequencing step and one write for up to kBatchBytes of them, where each block
// would cost a dozen thread wake-ups (a save of 10^6 tiny tensors took 170 s, their load 5).
//
// Thread safety: Start, Push, AddSmall, WaitWritten, Drain, WriteTail and Close are called by
// one thread (the writer's caller, or the thread finishing a CommitAsync). Fail and status may
// be called from any thread.
#ifndef FERRY_SRC_SAVE_BLOCK_PIPELINE_HPP_
#define FERRY_SRC_SAVE_BLOCK_PIPELINE_HPP_

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "base/worker_pool.hpp"
#include "cuda/staging_pool.hpp"
#include "ferry/ferry.hpp"
#include "format/footer_builder.hpp"
#include "format/format.hpp"
#include "io/io.hpp"
#include "save/device_snapshot.hpp"
#include "save/direct_sink.hpp"

namespace ferry {

// A tensor's footer record while its blocks are on their way.
struct PipelineTensor : format::TensorRecord {
  uint64_t pending = 0;  // blocks not yet written (guarded by the pipeline's mutex)
};

// One block of one tensor on its way to the file, or a batch of small tensors' blocks.
struct Block {
  enum class State : uint8_t { kQueued, kEncoding, kEncoded, kAssigned, kWriting, kDone };
  PipelineTensor* rec = nullptr;
  uint64_t raw_off = 0;
  size_t n = 0;
  const uint8_t* raw = nullptr;       // caller memory or a staging piece
  StagingPool::Impl* pool = nullptr;  // set when `raw` is a staging piece
  uint64_t piece = 0;
  void* event = nullptr;  // recorded after the device-to-host copy into `raw`
  bool first = false, last = false;
  State state = State::kQueued;
  uint64_t checksum = 0;
  bool compressed = false;
  format::ChunkCodec codec = format::ChunkCodec::kStored;  // when compressed
  size_t stored = 0;
  const uint8_t* data = nullptr;  // the stored bytes: `raw` or `out`
  std::unique_ptr<std::vector<uint8_t>> out;
  uint64_t offset = 0;
  uint64_t pad = 0;  // zero bytes between the previous block's end and `offset`
  // A batch: its blocks (one per small tensor, `raw` in `batch_bytes`), placed and written
  // together. Empty for a single block.
  std::vector<Block> parts;
  std::unique_ptr<uint8_t[]> batch_bytes;
};

class BlockPipeline {
 public:
  // Tensors of at most this many bytes (and at most one block) go through AddSmall; a batch
  // holds up to kBatchBytes of them.
  static constexpr uint64_t kSmallBytes = uint64_t{64} << 10;
  static constexpr uint64_t kBatchBytes = uint64_t{1} << 20;

  // `path` names the save in messages. `file` is the file being written, `sink` its direct
  // writer or null, `device` the save's device copies; all outlive the pipeline.
  BlockPipeline(std::string path, const WriterOptions& options, File* file,
                std::unique_ptr<DirectSink> sink, DeviceSnapshot* device);
  // Fails and drains the pipeline if that has not happened yet.
  ~BlockPipeline();
  BlockPipeline(const BlockPipeline&) = delete;
  BlockPipeline& operator=(const BlockPipeline&) = delete;

  // Starts the workers, once. ResourceExhausted when the system refuses a thread.
  Status Start();
  // Queues a block (after the small tensors added before it); its tensor's `pending` counts
  // it until it is written.
  void Push(Block&& b);
  // Adds the one block of a small tensor (`n` <= kSmallBytes bytes) to the batch being
  // gathered; returns where the caller puts its `n` bytes before the next call. The batch
  // is queued when full, before the next Push, and by Drain.
  uint8_t* AddSmall(PipelineTensor* rec, size_t n);
  // Waits until every block of `rec` is written (or dropped after a failure).
  Status WaitWritten(const PipelineTensor& rec);
  // The first error wins; later blocks are dropped (their device copies still waited for and
  // their staging pieces given back).
  void Fail(Status st);
  // The first error, or OK.
  Status status();
  // Closes the pipeline and waits until every block is done and the workers have exited.
  void Drain();

  // After Drain: the end of the data section.
  uint64_t end() const { return pos_; }
  // After Drain: writes `n` bytes at `offset` (>= end()), zeros between end() and `offset`.
  Status WriteTail(uint64_t offset, const uint8_t* data, uint64_t n);
  // After the last WriteTail: flushes what the direct sink holds of the file's `size` bytes
  // and closes it. Close(0) closes it without flushing (the save failed).
  Status Close(uint64_t size);

 private:
  void FailLocked(Status st);
  Status Report(uint64_t n);
  void Work();
  Status Encode(Block& b, std::unique_ptr<std::vector<uint8_t>>& out, bool skip,
                std::vector<uint8_t>& scratch);
  Status EncodePlanes(Block& b, std::unique_ptr<std::vector<uint8_t>>& out,
                      std::vector<uint8_t>& scratch);
  void Sequence();
  void Place(Block& b);
  void FlushSmall();
  Status WriteBlock(Block& b, std::vector<uint8_t>& span);
  Status EncodeBatch(Block& batch, std::unique_ptr<std::vector<uint8_t>>& out, bool skip,
                     std::vector<uint8_t>& scratch, std::unique_ptr<std::vector<uint8_t>>& spare);

  const std::string path_;
  const int threads_;
  const int zstd_level_;
  const double min_savings_;
  const std::function<Status(uint64_t)> progress_;
  File* const file_;
  std::unique_ptr<DirectSink> sink_;  // O_DIRECT writes, where the file system has them
  DeviceSnapshot* const device_;

  // Everything below is guarded by mu_.
  std::mutex mu_;
  std::condition_variable work_cv_, done_cv_;
  std::deque<Block> blocks_;
  uint64_t next_encode_ = 0;  // first block no worker has taken for encoding
  uint64_t seq_ = 0;          // first block without a file offset
  uint64_t blocks_done_ = 0;
  std::deque<Block*> write_queue_;
  uint64_t pos_ = format::kFirstDataOffset;  // end of the data section assigned so far
  bool closed_ = false;
  bool failed_ = false;
  Status error_;
  std::vector<std::unique_ptr<std::vector<uint8_t>>> free_bufs_;
  std::vector<std::unique_ptr<uint8_t[]>> free_batches_;  // kBatchBytes each
  ThreadGroup workers_;
  uint64_t window_ = 8;  // blocks encoded ahead of the sequencer, at most

  Block gathering_;        // the batch AddSmall fills (caller's thread only)
  uint64_t gathered_ = 0;  // bytes of it used

  std::mutex progress_mu_;      // one progress call at a time, outside mu_
  uint64_t progress_done_ = 0;  // guarded by progress_mu_
};

}  // namespace ferry

#endif  // FERRY_SRC_SAVE_BLOCK_PIPELINE_HPP_
