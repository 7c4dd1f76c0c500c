// PyTorch checkpoints read without running their pickles: torch.save zip files (.pt, .bin),
// sharded pytorch_model.bin.index.json checkpoints, and Distributed Checkpoint (DCP) folders.
// Tensors are read straight from the mapped files (views materialised by a strided copy);
// TransformerEngine `_extra_state` entries become ScalingState tables (te_extra_state.hpp);
// other plain values (ints, floats, strings) become metadata.
//
// Thread safety: a TorchCheckpoint is immutable after Open; Read may be called from any
// number of threads at once.
#ifndef FERRY_SRC_IMPORT_TORCH_TORCH_CHECKPOINT_HPP_
#define FERRY_SRC_IMPORT_TORCH_TORCH_CHECKPOINT_HPP_

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "ferry/ferry.hpp"
#include "import/torch/unpickle.hpp"
#include "io/io.hpp"

namespace ferry::torch_import {

// Bytes [offset, offset + size) of the tensor's dense row-major image, gathered from its
// storage by shape, stride and storage offset. `guard` (may be null) is the mapping the
// storage lies in, so a file truncated under the reader gives DataLoss instead of SIGBUS.
Status CopyTensorBytes(const TensorRef& t, uint64_t offset, uint8_t* dst, uint64_t size,
                       const Mapping* guard, const std::string& where);
// Dense size in bytes of a tensor (numel * itemsize). The interpreter checked, when it
// rebuilt the tensor, that this fits in an int64.
uint64_t TensorBytes(const TensorRef& t);

// What reading a checkpoint's values may produce, in bytes: tensor names, metadata text,
// skipped-entry notes, TransformerEngine scaling tables and the pickles decoded for them.
// Counted against the input (kWalkBytesPerInputByte per byte of the files read, plus
// kWalkSlackBytes), so that values reached through many shared references (the same list
// twice in a list, nested k deep, is 2^k paths over k values) cost what the paths produce and
// stop at a bound proportional to the file, instead of hanging on a few hundred bytes. The
// factor leaves room for what real checkpoints legitimately produce from few bytes: long
// dotted names built from short memoized keys, numbers printed as text.
inline constexpr uint64_t kWalkBytesPerInputByte = 16;
inline constexpr uint64_t kWalkSlackBytes = uint64_t{32} << 20;
class WalkBudget {
 public:
  // More input read: `bytes` of files.
  void Grant(uint64_t bytes);
  // Counts `bytes` more; false (and nothing counted) when that would pass the bound.
  bool Take(uint64_t bytes);
  // The error for a Take that failed, naming `where`.
  Status Exhausted(const std::string& where) const;
  uint64_t spent() const { return spent_; }

 private:
  uint64_t granted_ = kWalkSlackBytes, spent_ = 0, input_ = 0;
};
// True when the elements lie contiguously, row-major, in the storage.
bool IsContiguous(const TensorRef& t);
// A float as Python's repr() spells it (1.0, 0.1, 1e+20, 1e-05, nan, -inf): the shortest text
// that reads back to the same double, always with a '.' or an exponent, so a plain value of a
// checkpoint keeps its type through metadata text.
std::string PythonFloatRepr(double f);

// Parses a torch.save zip archive held at [data, data + size) and returns the unpickled root
// object. Storages point into the span. `where` names it in messages. `guard`: the mapping
// holding the span (its headers and pickle are copied under its SIGBUS guard), or null.
Result<Value*> LoadTorchZip(Heap* heap, const uint8_t* data, uint64_t size,
                            const std::string& where, const Mapping* guard = nullptr);
// A copy of [data, data + size) owned by `heap`, taken under `guard` (may be null).
Result<const Value*> GuardedCopy(Heap* heap, const uint8_t* data, uint64_t size,
                                 const Mapping* guard, const std::string& where);

// One chunk of a tensor saved in several (DCP): where it starts in the whole tensor.
struct TensorPiece {
  const TensorRef* ref = nullptr;
  const Mapping* mapping = nullptr;
  std::vector<int64_t> offsets;
};

struct ImportedTensor {
  std::string name;
  DType dtype = DType::kU8;
  std::vector<int64_t> shape;  // TensorFerry's (float4_e2m1fn_x2: last dimension doubled)
  uint64_t nbytes = 0;
  const TensorRef* ref = nullptr;
  const Mapping* mapping = nullptr;  // the file the bytes are in
  std::string source;                // file, for messages
  std::string location;              // the device the storage was saved from (ignored)
  // Non-empty for a tensor assembled from chunks that cover it exactly (then `ref` is the
  // first chunk's, for its dtype); each read gathers the rows it needs from them.
  std::vector<TensorPiece> pieces;
  std::vector<int64_t> torch_shape;  // the whole tensor's shape, in torch elements
};

class TorchCheckpoint {
 public:
  // `path`: a torch.save file, a sharded index .json whose shards are torch.save files, or a
  // DCP folder (holding .metadata). Every error names the file and, where known, the entry.
  static Result<std::unique_ptr<TorchCheckpoint>> Open(const std::string& path);

  // True when `path` is one of the inputs Open reads (by content, not by name); a legacy
  // (non-zip) torch.save file also counts, so that Open can explain why it is refused.
  static bool Recognises(const std::string& path);

  const std::string& path() const { return path_; }
  // "torch.save", "torch.save, N shards" or "PyTorch DCP".
  const std::string& kind() const { return kind_; }
  const std::vector<ImportedTensor>& tensors() const { return tensors_; }
  const std::vector<ScalingState>& scaling() const { return scaling_; }
  const std::vector<std::pair<std::string, std::string>>& metadata() const { return metadata_; }
  // Entries that were not imported (objects other than tensors and plain values), one line
  // each; callers show them as warnings.
  const std::vector<std::string>& skipped() const { return skipped_; }

  Status Read(const ImportedTensor& t, uint64_t offset, void* dst, uint64_t size) const;

 private:
  TorchCheckpoint() = default;
  Status AddFile(const std::string& file);
  Status AddDcp(const std::string& dir);
  Status Walk(const Value* v, const std::string& name, int depth, const Mapping* mapping,
              const std::string& file);
  Status WalkItems(const Value* v, const std::string& name, int depth, const Mapping* mapping,
                   const std::string& file);
  Status AddTensor(const std::string& name, const Value* v, const Mapping* mapping,
                   const std::string& file);
  Status AddMetadata(const std::string& name, std::string text, const std::string& file);
  Status AddSkipped(std::string note);
  Status AddShards(const std::string& index_path);
  Status CheckUnique() const;
  struct Dcp;
  struct DcpItem;
  Status AddDcpTensor(Dcp& dcp, const std::string& fqn, const Value* md);
  Status AddDcpChunks(Dcp& dcp, const std::string& fqn, const Value* chunks,
                      const std::vector<int64_t>& global);
  Result<DcpItem> LoadDcpItem(Dcp& dcp, const std::string& fqn, size_t chunk, const Value* info);
  Result<std::shared_ptr<Mapping>> Map(const std::string& file);

  std::string path_, kind_;
  std::vector<std::shared_ptr<Mapping>> mappings_;
  std::unique_ptr<Heap> heap_ = std::make_unique<Heap>();
  std::vector<ImportedTensor> tensors_;
  std::vector<ScalingState> scaling_;
  std::vector<std::pair<std::string, std::string>> metadata_;
  std::vector<std::string> skipped_;
  WalkBudget budget_;
};

}  // namespace ferry::torch_import

#endif  // FERRY_SRC_IMPORT_TORCH_TORCH_CHECKPOINT_HPP_
