// Sharded checkpoints: one logical checkpoint stored as several files plus a JSON index.
//
// Index format ("<name>.ferry.index.json", the layout of safetensors'
// model.safetensors.index.json):
//
//   {
//     "metadata": {"total_size": 16106127360, "step": "1000"},
//     "weight_map": {"embed.weight": "model-00001-of-00002.ferry",
//                    "layers.0.attn.q.weight": "model-00001-of-00002.ferry", ...}
//   }
//
// - "weight_map" maps every tensor name to the file holding it, relative to the index's
//   directory (no absolute paths, no ".." components). Every tensor of every listed file appears
//   exactly once. Files may be TensorFerry or safetensors files (whatever Reader::Open accepts),
//   so an existing model.safetensors.index.json opens as it is.
// - "metadata" is optional; string values are kept as they are, other JSON values as their JSON
//   text. WriteShardIndex records "total_size" (the sum of raw tensor bytes) like safetensors.
// - Like the files themselves, the index stores no device, rank or placement. Tensor-parallel
//   slices carry their global shape and offset in the file (TensorInfo::global_shape).
//
// Handles and threads: a ShardedCheckpoint is shared (std::shared_ptr) and immutable after Open;
// every const method may be called from any number of threads. It keeps its shard Readers open
// (one mapping per file) until the last reference to it or to a shard Reader is dropped.
#ifndef FERRY_SHARDED_HPP_
#define FERRY_SHARDED_HPP_

#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ferry/ferry.hpp"

namespace ferry {

class FERRY_API ShardedCheckpoint {
 public:
  // Reads and validates the index, then opens every shard it names. Fails with NotFound for a
  // missing index or shard, DataLoss for a malformed index or one that disagrees with its shards
  // (a name mapped to a file that lacks it, a tensor in two files or in none of the entries).
  static Result<std::shared_ptr<ShardedCheckpoint>> Open(const std::string& index_path,
                                                         ReaderOptions options = {});
  // A single file as a one-shard checkpoint (so callers handle both forms alike).
  static std::shared_ptr<ShardedCheckpoint> FromReader(std::shared_ptr<Reader> reader);
  ~ShardedCheckpoint();

  // The index path, or the file's path for FromReader.
  const std::string& path() const;
  // Shards in the order of their relative names (byte order), so that every process that opens
  // the same index numbers them alike.
  size_t num_shards() const;
  const std::shared_ptr<Reader>& shard(size_t i) const;
  // The file name of shard i as the index spells it (relative to the index's directory).
  const std::string& shard_name(size_t i) const;

  size_t num_tensors() const;
  // Every tensor name, sorted.
  std::vector<std::string> names() const;
  struct Location {
    size_t shard = 0;
    TensorInfo info;  // info.index is the tensor's index inside that shard's Reader
  };
  // O(log n); NotFound names the index and the tensor.
  Result<Location> Find(std::string_view name) const;
  // The index's "metadata" entries, sorted by key.
  const std::vector<std::pair<std::string, std::string>>& metadata() const;

  class Impl;

 private:
  explicit ShardedCheckpoint(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Writes the index for shard files that already exist (committed), mapping each tensor of each
// file to it. `shard_files` are relative to the index's directory. Atomic like Writer::Commit
// (temporary file, fsync, rename, fsync of the directory). Fails with InvalidArgument when two
// files hold a tensor of the same name or a name is not a plain relative path.
FERRY_API Status
WriteShardIndex(const std::string& index_path, const std::vector<std::string>& shard_files,
                const std::vector<std::pair<std::string, std::string>>& metadata = {});

// ---- saving a sharded checkpoint from several processes ----------------------------------

// The ranks of a save and the one collective it needs. all_reduce_max replaces words[0, count)
// with their element-wise maximum over all ranks and returns once the result is there; every
// rank calls it the same number of times with the same count. A non-ok Status from it fails
// the save on this rank (the others then wait in their next call: make it fail them too, as a
// broken NCCL communicator does). distributed.hpp makes one from an NCCL communicator;
// torch.distributed callers use tensorferry.distributed.save_file.
struct SaveGroup {
  int rank = 0;
  int nranks = 1;
  std::function<Status(uint64_t* words, size_t count)> all_reduce_max;
};

struct ShardedSaveOptions {
  WriterOptions writer;  // for this rank's shard file
  // Entries of the index's "metadata" (with "total_size" added when absent).
  std::vector<std::pair<std::string, std::string>> metadata;
  // After the new index is committed, rank 0 deletes the shard files the replaced index named
  // that follow this class's naming ("<stem>-<16 hex digits>-<NNNNN>-of-<NNNNN>.ferry") and are
  // not part of the new checkpoint. Other files are never deleted.
  bool remove_replaced = true;
};

// One sharded checkpoint saved by every rank of a group at once: each rank writes its own shard
// file, in parallel, and rank 0 commits the index (ShardedCheckpoint's format) only after every
// shard is durable. Shard files get names no earlier save used ("<stem>-<save id>-<rank + 1>-of-
// <nranks>.ferry" beside the index, where "<stem>.ferry.index.json", "<stem>.index.json" or
// "<stem>.json" is the index's name and the save id is drawn by rank 0), so the files of the
// checkpoint the index names now are never touched before the new index replaces it: a crash at
// any point leaves the previous checkpoint complete and loadable, or the new one.
//
//   auto save = ferry::ShardedSave::Begin("ckpt/model.ferry.index.json", group).value();
//   save->writer().AddDeviceTensor(name, dtype, shape, ptr, nbytes, stream);   // this rank's
//   ferry::Status st = save->Commit();   // the same result on every rank
//
// Begin, Commit and Finish are collective (each calls all_reduce_max). A ShardedSave is owned
// by its creator and used by one thread at a time; `group` must stay usable until it is done.
class FERRY_API ShardedSave {
 public:
  static Result<std::unique_ptr<ShardedSave>> Begin(const std::string& index_path, SaveGroup group,
                                                    ShardedSaveOptions options = {});
  ~ShardedSave();
  ShardedSave(const ShardedSave&) = delete;
  ShardedSave& operator=(const ShardedSave&) = delete;

  // This rank's shard. Add its tensors (names unique across all ranks), metadata and scaling
  // state; do not call its Commit, CommitAsync or Abort.
  Writer& writer();
  const std::string& shard_path() const;
  const std::string& index_path() const;

  // Commits this rank's shard (fsynced), agrees with the other ranks that all shards are, then
  // rank 0 writes the index atomically. The same status on every rank; on failure every rank
  // removes its own new shard and the previous checkpoint stays as it was.
  Status Commit();
  // Starts this rank's shard commit in the background (Writer::CommitAsync) and returns once its
  // tensors are snapshotted; the source buffers may then be reused. The new checkpoint becomes
  // visible only in Finish, which every rank must call: it waits for this rank's shard, then
  // agrees and commits the index as Commit does.
  Status CommitAsync();
  Status Finish();
  // True once this rank's shard is no longer being written: Commit ran, or CommitAsync's
  // background commit has finished (or failed). No communication; never blocks.
  bool shard_done() const;

  class Impl;

 private:
  explicit ShardedSave(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace ferry

#endif  // FERRY_SHARDED_HPP_
