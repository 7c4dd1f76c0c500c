// A restricted pickle interpreter for the pickles inside PyTorch checkpoints. It executes
// nothing: it builds inert values (None, bool, int, float, str, bytes, tuple, list, dict, set)
// and recognises a fixed allow-list of globals, each mapped to a fixed meaning:
//
// - tensor reconstruction: torch._utils._rebuild_tensor / _v2 / _v3, _rebuild_parameter
//   (and _with_state), torch._tensor._rebuild_from_type_v2 over torch.Tensor or
//   torch.nn.Parameter, the storage classes named in persistent ids, torch dtypes, torch.Size;
// - containers and bytes: collections.OrderedDict, builtins.set / frozenset / bytearray,
//   _codecs.encode(str, "latin1") (protocol 2 bytes), _io.BytesIO;
// - torch.storage._load_from_bytes (storages pickled outside torch.save, as plain pickle
//   writes them), parsed as the legacy torch.save stream it holds, never run;
// - record-only classes, never instantiated: TransformerEngine's recipe dataclasses and
//   Format enum (transformer_engine.common.recipe), PyTorch Distributed Checkpoint metadata
//   (torch.distributed.checkpoint.metadata / filesystem), torch.device, layouts
//   (torch.serialization._get_layout), memory formats, pathlib paths. NEWOBJ, REDUCE and
//   BUILD on them record the class name, the arguments and the state.
//
// Everything else (GLOBAL/STACK_GLOBAL of any other name, INST, OBJ, EXT*, protocol 0 text
// opcodes, out-of-band buffers, REDUCE/NEWOBJ/BUILD on anything not listed) is refused with a
// DataLoss error naming the global and the byte offset. Only protocols 2 to 5 are read.
//
// Bounds: time and memory are linear in the input. An opcode creates at most one value, and
// a value reached again through the memo (the same tuple, string or bytes used by many
// opcodes) is never rebuilt: an object keeps its argument tuple, torch.Size of a tuple is that
// tuple, bytearray of bytes is those bytes, and _codecs.encode and _load_from_bytes convert
// each argument value once. The copies that remain (OrderedDict, set, frozenset and
// torch.Size of a list, which may change after the call) are counted against the pickle's
// size (kPickleCopiesPerByte): a pickle that would copy more is refused. Strings are copied
// from the input at most once; names of globals are at most kMaxGlobalName bytes. The limits
// below cap what a pickle may build in absolute terms.
#ifndef FERRY_SRC_IMPORT_TORCH_UNPICKLE_HPP_
#define FERRY_SRC_IMPORT_TORCH_UNPICKLE_HPP_

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "ferry/ferry.hpp"

namespace ferry::torch_import {

inline constexpr uint64_t kMaxPickleStack = uint64_t{1} << 20;
inline constexpr uint64_t kMaxPickleMarks = 1024;  // nesting depth of MARK groups
inline constexpr uint64_t kMaxPickleMemo = uint64_t{1} << 20;
inline constexpr uint64_t kMaxPickleValues = uint64_t{1} << 24;
inline constexpr int kMaxPickleNesting = 4;  // pickles inside pickles (_load_from_bytes, BytesIO)
// Container items copied by REDUCE (see above): at most this many per byte of the pickle, plus
// kPickleCopySlack.
inline constexpr uint64_t kPickleCopiesPerByte = 2;
inline constexpr uint64_t kPickleCopySlack = uint64_t{1} << 16;
// "module" and "name" of a global: GLOBAL reads at most this far for each newline.
inline constexpr uint64_t kMaxGlobalName = 1024;
// Dimensions of a tensor (TensorFerry's own limit, format::kMaxDims).
inline constexpr size_t kMaxTensorDims = 64;

// A torch dtype: its name ("float32"), the TensorFerry type when there is one, its size in
// bytes per storage element. float4_e2m1fn_x2 holds two F4 elements per element.
struct TorchDType {
  std::string name;
  std::optional<DType> dtype;
  int itemsize = 1;
  bool packed_x2 = false;
};
// By torch name ("float32", "bfloat16", "float8_e4m3fn", ...); nullopt for unknown names.
std::optional<TorchDType> TorchDTypeByName(std::string_view name);
// By legacy storage class name ("FloatStorage"); "UntypedStorage" gives uint8.
std::optional<TorchDType> TorchDTypeByStorage(std::string_view name);

// Which allow-listed global a kGlobal value is.
enum class Global : uint8_t {
  kOrderedDict,
  kRebuildTensor,
  kRebuildTensorV2,
  kRebuildTensorV3,
  kRebuildParameter,
  kRebuildParameterWithState,
  kRebuildFromTypeV2,
  kTorchSize,
  kCodecsEncode,
  kBytearray,
  kSet,
  kFrozenset,
  kLoadFromBytes,
  kBytesIO,
  kDtype,        // torch.<dtype>
  kStorageType,  // torch.<X>Storage, torch.UntypedStorage
  kTensorClass,  // torch.Tensor, torch.nn.parameter.Parameter
  kRecord,       // a record-only class (see above)
  kConstant,     // an inert module-level constant: torch.strided, torch.contiguous_format, ...
};

struct Storage {
  std::string key;
  std::string location;  // "cpu", "cuda:0", ...: read, reported, never acted on
  TorchDType dtype;      // of the storage class; uint8 for untyped storages
  const uint8_t* data = nullptr;
  uint64_t nbytes = 0;
};

struct TensorRef {
  const Storage* storage = nullptr;
  TorchDType dtype;
  int64_t storage_offset = 0;  // in elements
  // Checked when the tensor is rebuilt: no negative entry, element count and dense byte
  // count (numel * itemsize) at most INT64_MAX, every reachable element inside the storage.
  std::vector<int64_t> shape, stride;
};

struct Value {
  enum class Kind : uint8_t {
    kNone,
    kBool,
    kInt,
    kBigInt,  // `s` holds the little-endian two's complement bytes
    kFloat,
    kStr,
    kBytes,
    kTuple,
    kList,
    kDict,
    kSet,
    kGlobal,  // `s` = "module.name", `global`
    kObject,  // a record-only instance: `s` = class "module.name", `items` = args, `state`
    kStorage,
    kTensor,
  };
  Kind kind = Kind::kNone;
  bool b = false;
  int64_t i = 0;
  double f = 0;
  std::string s;
  std::vector<Value*> items;                    // tuple, list, set
  std::vector<std::pair<Value*, Value*>> dict;  // insertion order; duplicates kept
  Value* args = nullptr;  // kObject: its argument tuple, shared with whatever else holds it
  Value* state = nullptr;
  Global global = Global::kRecord;
  Storage* storage = nullptr;
  TensorRef* tensor = nullptr;

  bool is(Kind k) const { return kind == k; }
  bool is_str() const { return kind == Kind::kStr; }
  // The items of a tuple, list or set; the arguments of an object; else empty.
  const std::vector<Value*>& Elements() const;
  // The first entry of a dict whose key is the string `key`, or nullptr. Large dicts are
  // indexed on first use (and the index extended as the dict grows), so looking fields up in
  // a dict shared by many objects costs its size once, not once per lookup. Not thread-safe:
  // lookups happen while a checkpoint is opened, by one thread.
  const Value* Get(std::string_view key) const;
  // "module.name" of an object's class, without the module for messages.
  std::string ShortClass() const;

 private:
  mutable std::unique_ptr<std::unordered_map<std::string_view, const Value*>> index_;
  mutable size_t indexed_ = 0;  // dict entries in index_
};

// Owns every value, storage and tensor of one or more pickles. Not copyable; values are
// referenced by raw pointer, so a self-referencing pickle makes a cycle, never a leak.
class Heap {
 public:
  Value* New(Value::Kind kind);
  Storage* NewStorage();
  TensorRef* NewTensor();
  uint64_t values() const { return values_.size(); }
  int nesting = 0;  // pickles being read right now, one inside another
  // Container items copied by every pickle read into this heap (see the bounds above).
  uint64_t copied = 0;

 private:
  std::deque<Value> values_;
  std::deque<Storage> storages_;
  std::deque<TensorRef> tensors_;
};

// Answers BINPERSID: the persistent id value and the byte offset of the opcode.
using PersistentLoad = std::function<Result<Value*>(Value* pid, uint64_t offset)>;

struct UnpickleOptions {
  // Names the pickle in messages: "model.bin: data.pkl".
  std::string where;
  // nullptr: persistent ids are refused.
  PersistentLoad persistent_load;
  // Offset added to byte offsets in messages (where the pickle lies in its file).
  uint64_t offset_base = 0;
};

// Runs the pickle at [data, data + size) up to its STOP opcode. `consumed`, when given,
// receives the number of bytes read (legacy torch streams hold several pickles in a row);
// without it, bytes after STOP are refused.
Result<Value*> Unpickle(Heap* heap, const uint8_t* data, uint64_t size,
                        const UnpickleOptions& options, uint64_t* consumed = nullptr);

// Parses a legacy (non-zip) torch.save stream that holds one storage, as
// torch.storage._load_from_bytes receives it, into a Storage pointing into `data`.
Result<Storage*> ParseLegacyStorage(Heap* heap, const uint8_t* data, uint64_t size,
                                    const std::string& where);

// True when the bytes start like a legacy torch.save file (a pickle of the magic number).
bool LooksLikeLegacyTorch(const uint8_t* data, uint64_t size);

}  // namespace ferry::torch_import

#endif  // FERRY_SRC_IMPORT_TORCH_UNPICKLE_HPP_
