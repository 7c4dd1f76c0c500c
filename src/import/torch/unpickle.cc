// The restricted pickle interpreter; see unpickle.hpp for what it accepts and why.
#include "import/torch/unpickle.hpp"

#include <cstring>
#include <unordered_map>

#include "base/util.hpp"
#include "format/recipe.hpp"
#include "format/sniff.hpp"

namespace ferry::torch_import {

namespace {

using Kind = Value::Kind;

struct DTypeRow {
  const char* name;
  const char* alias;    // torch's other name for it, or ""
  const char* storage;  // legacy storage class, or ""
  std::optional<DType> dtype;
  int itemsize;
};

// Every dtype torch.save can name. Those without a TensorFerry type are listed so that the
// error says which dtype a tensor has instead of calling it unknown.
const DTypeRow kDTypes[] = {
    {"float32", "float", "FloatStorage", DType::kF32, 4},
    {"float64", "double", "DoubleStorage", DType::kF64, 8},
    {"float16", "half", "HalfStorage", DType::kF16, 2},
    {"bfloat16", "", "BFloat16Storage", DType::kBF16, 2},
    {"int8", "", "CharStorage", DType::kI8, 1},
    {"int16", "short", "ShortStorage", DType::kI16, 2},
    {"int32", "int", "IntStorage", DType::kI32, 4},
    {"int64", "long", "LongStorage", DType::kI64, 8},
    {"uint8", "", "ByteStorage", DType::kU8, 1},
    {"uint16", "", "", DType::kU16, 2},
    {"uint32", "", "", DType::kU32, 4},
    {"uint64", "", "", DType::kU64, 8},
    {"bool", "", "BoolStorage", DType::kBool, 1},
    {"complex64", "cfloat", "ComplexFloatStorage", DType::kC64, 8},
    {"complex128", "cdouble", "ComplexDoubleStorage", DType::kC128, 16},
    {"float8_e4m3fn", "", "", DType::kF8_E4M3FN, 1},
    {"float8_e5m2", "", "", DType::kF8_E5M2, 1},
    {"float8_e4m3fnuz", "", "", DType::kF8_E4M3FNUZ, 1},
    {"float8_e5m2fnuz", "", "", DType::kF8_E5M2FNUZ, 1},
    {"float8_e8m0fnu", "", "", DType::kF8_E8M0FNU, 1},
    {"float4_e2m1fn_x2", "", "", DType::kF4_E2M1FN, 1},
    {"complex32", "chalf", "", std::nullopt, 4},
    {"qint8", "", "QInt8Storage", std::nullopt, 1},
    {"quint8", "", "QUInt8Storage", std::nullopt, 1},
    {"qint32", "", "QInt32Storage", std::nullopt, 4},
    {"quint4x2", "", "QUInt4x2Storage", std::nullopt, 1},
    {"quint2x4", "", "QUInt2x4Storage", std::nullopt, 1},
    {"bits1x8", "", "", std::nullopt, 1},
    {"bits2x4", "", "", std::nullopt, 1},
    {"bits4x2", "", "", std::nullopt, 1},
    {"bits8", "", "", std::nullopt, 1},
    {"bits16", "", "", std::nullopt, 2},
};

TorchDType FromRow(const DTypeRow& r) {
  TorchDType t;
  t.name = r.name;
  t.dtype = r.dtype;
  t.itemsize = r.itemsize;
  t.packed_x2 = std::string_view(r.name) == "float4_e2m1fn_x2";
  return t;
}

// Record-only classes: never instantiated, their arguments and state kept as values. The
// recipe classes (format::RecipeNamed) are records too.
const char* const kRecordClasses[] = {
    "transformer_engine.common.recipe.Format",
    "transformer_engine.common.recipe._FormatHelper",
    "transformer_engine.common.recipe._FormatHelperFP4",
    "transformer_engine.common.recipe._OverrideLinearPrecision",
    "transformer_engine.common.recipe.QParams",
    "transformer_engine.common.recipe.MMParams",
    "torch.distributed.checkpoint.metadata.Metadata",
    "torch.distributed.checkpoint.metadata.TensorStorageMetadata",
    "torch.distributed.checkpoint.metadata.BytesStorageMetadata",
    "torch.distributed.checkpoint.metadata.ChunkStorageMetadata",
    "torch.distributed.checkpoint.metadata.TensorProperties",
    "torch.distributed.checkpoint.metadata.MetadataIndex",
    "torch.distributed.checkpoint.metadata.StorageMeta",
    "torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING",
    "torch.distributed.checkpoint.filesystem._StorageInfo",
    "torch.distributed.checkpoint._extension.ExtensionRegistry",
    "torch.device",
    // torch.layout pickles as _get_layout("torch.strided") (DCP's TensorProperties).
    "torch.serialization._get_layout",
    "pathlib.PosixPath",
    "pathlib.PurePosixPath",
    "pathlib._local.PosixPath",
    "pathlib._local.PurePosixPath",
};

const char* const kConstants[] = {
    "torch.strided",       "torch.sparse_coo",      "torch.contiguous_format",
    "torch.channels_last", "torch.preserve_format", "torch.channels_last_3d",
};

std::optional<Global> Resolve(std::string_view module, std::string_view name) {
  std::string full = StrCat(module, ".", name);
  struct Named {
    const char* name;
    Global g;
  };
  static const Named kNamed[] = {
      {"collections.OrderedDict", Global::kOrderedDict},
      {"torch._utils._rebuild_tensor", Global::kRebuildTensor},
      {"torch._utils._rebuild_tensor_v2", Global::kRebuildTensorV2},
      {"torch._utils._rebuild_tensor_v3", Global::kRebuildTensorV3},
      {"torch._utils._rebuild_parameter", Global::kRebuildParameter},
      {"torch._utils._rebuild_parameter_with_state", Global::kRebuildParameterWithState},
      {"torch._tensor._rebuild_from_type_v2", Global::kRebuildFromTypeV2},
      {"torch.Size", Global::kTorchSize},
      {"_codecs.encode", Global::kCodecsEncode},
      {"builtins.bytearray", Global::kBytearray},
      {"builtins.set", Global::kSet},
      {"builtins.frozenset", Global::kFrozenset},
      {"torch.storage._load_from_bytes", Global::kLoadFromBytes},
      {"_io.BytesIO", Global::kBytesIO},
      {"io.BytesIO", Global::kBytesIO},
      {"torch.Tensor", Global::kTensorClass},
      {"torch._tensor.Tensor", Global::kTensorClass},
      {"torch.nn.parameter.Parameter", Global::kTensorClass},
  };
  for (const Named& n : kNamed) {
    if (full == n.name) return n.g;
  }
  for (const char* c : kRecordClasses) {
    if (full == c) return Global::kRecord;
  }
  for (const char* c : kConstants) {
    if (full == c) return Global::kConstant;
  }
  if (module == "transformer_engine.common.recipe" && name != "none" && format::RecipeNamed(name)) {
    return Global::kRecord;
  }
  // Enum members pickled by qualified name (Format.E4M3) when their value does not pickle.
  if (module == "transformer_engine.common.recipe" && name.starts_with("Format.") &&
      (format::Fp8FormatNamed(name.substr(7)) || name == "Format.E2M1")) {
    return Global::kRecord;
  }
  if (module == "torch" && TorchDTypeByName(name)) return Global::kDtype;
  if ((module == "torch" || module == "torch.storage") && TorchDTypeByStorage(name)) {
    return Global::kStorageType;
  }
  return std::nullopt;
}

uint64_t LoadLE(const uint8_t* p, int n) {
  uint64_t v = 0;
  for (int k = n - 1; k >= 0; --k) v = (v << 8) | p[k];
  return v;
}

class Machine {
 public:
  Machine(Heap* heap, const uint8_t* data, uint64_t size, const UnpickleOptions& options)
      : heap_(heap), data_(data), size_(size), opt_(options) {}

  Result<Value*> Run(uint64_t* consumed);

 private:
  template <typename... Args>
  Status Fail(const Args&... args) const {
    return Error(StatusCode::kDataLoss, opt_.where, ": ", args..., " at byte ",
                 opt_.offset_base + op_pos_);
  }
  Result<Value*> New(Kind k) {
    if (heap_->values() >= kMaxPickleValues) {
      return Error(StatusCode::kResourceExhausted, opt_.where, ": more than ", kMaxPickleValues,
                   " values at byte ", opt_.offset_base + op_pos_);
    }
    return heap_->New(k);
  }
  Status Need(uint64_t n) const {
    if (size_ - pos_ < n) return Fail("truncated pickle: ", n, " more bytes needed");
    return Status::Ok();
  }
  Status Push(Value* v) {
    if (stack_.size() >= kMaxPickleStack) {
      return Error(StatusCode::kResourceExhausted, opt_.where, ": pickle stack deeper than ",
                   kMaxPickleStack, " at byte ", opt_.offset_base + op_pos_);
    }
    stack_.push_back(v);
    return Status::Ok();
  }
  Result<Value*> Pop() {
    if (stack_.size() <= MarkFloor()) return Fail("pickle stack underflow");
    Value* v = stack_.back();
    stack_.pop_back();
    return v;
  }
  size_t MarkFloor() const { return marks_.empty() ? 0 : marks_.back(); }
  // Pops everything above the last MARK, and the mark.
  Result<std::vector<Value*>> PopMark() {
    if (marks_.empty()) return Fail("pickle opcode needs a MARK and there is none");
    size_t m = marks_.back();
    marks_.pop_back();
    std::vector<Value*> out(stack_.begin() + m, stack_.end());
    stack_.resize(m);
    return out;
  }
  Status Memo(uint64_t idx, Value* v) {
    if (memo_.size() >= kMaxPickleMemo && !memo_.count(idx)) {
      return Error(StatusCode::kResourceExhausted, opt_.where, ": pickle memo larger than ",
                   kMaxPickleMemo, " at byte ", opt_.offset_base + op_pos_);
    }
    memo_[idx] = v;
    return Status::Ok();
  }
  // Counts `n` container items about to be copied against the pickle's size.
  Status Charge(uint64_t n) {
    copied_ += n;
    heap_->copied += n;
    if (copied_ > kPickleCopiesPerByte * size_ + kPickleCopySlack) {
      return Error(StatusCode::kResourceExhausted, opt_.where, ": the pickle copies more than ",
                   kPickleCopiesPerByte, " container items per byte of its ", size_,
                   " bytes (the same container rebuilt over and over) at byte ",
                   opt_.offset_base + op_pos_);
    }
    return Status::Ok();
  }
  Status PushString(Kind k, uint64_t n) {
    FERRY_RETURN_IF_ERROR(Need(n));
    FERRY_ASSIGN_OR_RETURN(Value * v, New(k));
    v->s.assign(reinterpret_cast<const char*>(data_ + pos_), n);
    pos_ += n;
    return Push(v);
  }
  // One step per opcode family (Step dispatches); each reads its operands after the opcode.
  Status Step(uint8_t op);
  Result<Value*> Stop(uint64_t* consumed);
  Status Framing(uint8_t op);
  Status StackOp(uint8_t op);
  Status Scalar(uint8_t op);
  Status String(uint8_t op);
  Status Container(uint8_t op);
  Status Fill(uint8_t op);
  Status MemoOp(uint8_t op);
  Status GlobalOp(uint8_t op);
  Status ObjectOp(uint8_t op);
  Status Refuse(uint8_t op);
  Status Reduce(Value* callable, Value* args);
  Result<Value*> ReduceContainer(Global g, const std::vector<Value*>& args);
  Result<Value*> ReduceBytes(Global g, const std::vector<Value*>& args);
  Status NewObj(Value* cls, Value* args, Value* kwargs);
  Status Build(Value* obj, Value* state);
  Result<Value*> RebuildTensor(Global g, const std::vector<Value*>& args);

  Heap* heap_;
  const uint8_t* data_;
  uint64_t size_;
  const UnpickleOptions& opt_;
  uint64_t pos_ = 0, op_pos_ = 0;
  std::vector<Value*> stack_;
  std::vector<size_t> marks_;
  std::unordered_map<uint64_t, Value*> memo_;
  uint64_t copied_ = 0;
  // _codecs.encode and _load_from_bytes results by their argument value: a memoized argument
  // converted again (a few bytes of pickle each time) gives the value converted the first time.
  std::unordered_map<const Value*, Value*> converted_;
};

Result<int64_t> AsInt(const Value* v, const char* what, const std::string& where) {
  if (v->is(Kind::kInt)) return v->i;
  if (v->is(Kind::kBool)) return int64_t{v->b};
  return Error(StatusCode::kDataLoss, where, ": ", what, " is not an integer");
}

// A tensor's size or stride: at most kMaxTensorDims integers, counted before anything is
// copied (the tuple may be shared by every tensor of the pickle).
Result<std::vector<int64_t>> AsDims(const Value* v, const char* what, const std::string& where) {
  if (!v->is(Kind::kTuple) && !v->is(Kind::kList)) {
    return Error(StatusCode::kDataLoss, where, ": ", what, " is not a tuple of integers");
  }
  if (v->items.size() > kMaxTensorDims) {
    return Error(StatusCode::kDataLoss, where, ": ", what, " has ", v->items.size(),
                 " dimensions (limit ", kMaxTensorDims, ")");
  }
  std::vector<int64_t> out;
  for (const Value* x : v->items) {
    FERRY_ASSIGN_OR_RETURN(int64_t i, AsInt(x, what, where));
    out.push_back(i);
  }
  return out;
}

std::string DimsText(const std::vector<int64_t>& dims) {
  std::string out = "[";
  for (size_t d = 0; d < dims.size(); ++d) out += StrCat(d ? ", " : "", dims[d]);
  return out + "]";
}

// Checks that the last element any index can reach lies inside the storage. Every product
// and sum is checked before it is used: a view whose counts overflow 64 bits (or exceed
// INT64_MAX, as element and byte counts are signed downstream) is refused here, so the
// element and byte counts computed from it later (TensorBytes) cannot wrap around.
Status CheckView(TensorRef* t, const std::string& where) {
  if (t->shape.size() != t->stride.size()) {
    return Error(StatusCode::kDataLoss, where, ": size has ", t->shape.size(),
                 " dimensions and stride ", t->stride.size());
  }
  if (t->storage_offset < 0) {
    return Error(StatusCode::kDataLoss, where, ": negative storage offset ", t->storage_offset);
  }
  uint64_t numel = 1, last = static_cast<uint64_t>(t->storage_offset);
  bool reach_overflows = false;
  for (size_t d = 0; d < t->shape.size(); ++d) {
    if (t->shape[d] < 0 || t->stride[d] < 0) {
      return Error(StatusCode::kDataLoss, where, ": negative size or stride in dimension ", d,
                   " (size ", DimsText(t->shape), ", stride ", DimsText(t->stride), ")");
    }
    if (MulOverflows(numel, static_cast<uint64_t>(t->shape[d]), &numel)) {
      return Error(StatusCode::kDataLoss, where, ": size ", DimsText(t->shape),
                   " has more elements than 64 bits count");
    }
    uint64_t step;
    if (t->shape[d] > 0) {
      reach_overflows |= MulOverflows(static_cast<uint64_t>(t->shape[d] - 1),
                                      static_cast<uint64_t>(t->stride[d]), &step) ||
                         AddOverflows(last, step, &last);
    }
  }
  const auto itemsize = static_cast<uint64_t>(t->dtype.itemsize);
  uint64_t nbytes, end = 0;
  if (MulOverflows(numel, itemsize, &nbytes) || nbytes > uint64_t{INT64_MAX}) {
    return Error(StatusCode::kDataLoss, where, ": size ", DimsText(t->shape), " of ", t->dtype.name,
                 " is more than 2^63 bytes");
  }
  reach_overflows |= AddOverflows(last, 1, &last) || MulOverflows(last, itemsize, &end);
  if (reach_overflows) {
    return Error(StatusCode::kDataLoss, where, ": storage offset ", t->storage_offset, ", size ",
                 DimsText(t->shape), " and stride ", DimsText(t->stride), " reach past 64 bits");
  }
  if (numel > 0 && end > t->storage->nbytes) {
    return Error(StatusCode::kDataLoss, where, ": reaches byte ", end, " of storage ",
                 Quote(t->storage->key), ", which holds ", t->storage->nbytes);
  }
  return Status::Ok();
}

Result<Value*> Machine::RebuildTensor(Global g, const std::vector<Value*>& a) {
  const std::string where =
      StrCat(opt_.where, ": tensor rebuilt at byte ", opt_.offset_base + op_pos_);
  size_t need = g == Global::kRebuildTensor ? 4 : g == Global::kRebuildTensorV3 ? 7 : 6;
  if (a.size() < need || a.size() > need + 1 || (g == Global::kRebuildTensor && a.size() != 4)) {
    return Error(StatusCode::kDataLoss, where, ": ", a.size(), " arguments");
  }
  if (!a[0]->is(Kind::kStorage)) {
    return Error(StatusCode::kDataLoss, where, ": the first argument is not a storage");
  }
  TensorRef* t = heap_->NewTensor();
  t->storage = a[0]->storage;
  t->dtype = t->storage->dtype;
  if (g == Global::kRebuildTensorV3) {
    if (!a[6]->is(Kind::kGlobal) || a[6]->global != Global::kDtype) {
      return Error(StatusCode::kDataLoss, where, ": the dtype argument is not a torch dtype");
    }
    t->dtype = *TorchDTypeByName(a[6]->s.substr(a[6]->s.rfind('.') + 1));
  }
  FERRY_ASSIGN_OR_RETURN(t->storage_offset, AsInt(a[1], "storage offset", where));
  FERRY_ASSIGN_OR_RETURN(t->shape, AsDims(a[2], "size", where));
  FERRY_ASSIGN_OR_RETURN(t->stride, AsDims(a[3], "stride", where));
  FERRY_RETURN_IF_ERROR(CheckView(t, where));
  FERRY_ASSIGN_OR_RETURN(Value * v, New(Kind::kTensor));
  v->tensor = t;
  return v;
}

Status Machine::Reduce(Value* callable, Value* args) {
  if (!callable->is(Kind::kGlobal)) {
    return Fail("REDUCE of a ", callable->is(Kind::kObject) ? callable->ShortClass() : "value",
                " that is not an allowed global");
  }
  if (!args->is(Kind::kTuple)) return Fail("REDUCE arguments are not a tuple");
  const std::vector<Value*>& a = args->items;
  Result<Value*> out = nullptr;
  switch (callable->global) {
    case Global::kRebuildTensor:
    case Global::kRebuildTensorV2:
    case Global::kRebuildTensorV3:
      out = RebuildTensor(callable->global, a);
      break;
    case Global::kRebuildParameter:
    case Global::kRebuildParameterWithState:
      if (a.size() < 3 || !a[0]->is(Kind::kTensor)) {
        return Fail("_rebuild_parameter without a tensor");
      }
      out = a[0];
      break;
    case Global::kRebuildFromTypeV2: {
      // (func, type, args, state): a plain tensor or parameter whose Python attributes
      // (`state`) are dropped.
      if (a.size() != 4 || !a[0]->is(Kind::kGlobal) || !a[1]->is(Kind::kGlobal) ||
          a[1]->global != Global::kTensorClass || !a[2]->is(Kind::kTuple)) {
        return Fail("_rebuild_from_type_v2 of something other than torch.Tensor or Parameter");
      }
      Global f = a[0]->global;
      if (f != Global::kRebuildTensor && f != Global::kRebuildTensorV2 &&
          f != Global::kRebuildTensorV3 && f != Global::kRebuildParameter &&
          f != Global::kRebuildParameterWithState) {
        return Fail("_rebuild_from_type_v2 with the function ", Quote(a[0]->s));
      }
      return Reduce(a[0], a[2]);
    }
    case Global::kOrderedDict:
    case Global::kTorchSize:
    case Global::kSet:
    case Global::kFrozenset:
      out = ReduceContainer(callable->global, a);
      break;
    case Global::kCodecsEncode:
    case Global::kBytearray:
    case Global::kLoadFromBytes:
      out = ReduceBytes(callable->global, a);
      break;
    case Global::kRecord:
    case Global::kBytesIO:
      out = New(Kind::kObject);
      if (out.ok()) {
        (*out)->s = callable->s;
        (*out)->global = callable->global;
        (*out)->args = args;
      }
      break;
    default:
      return Fail("REDUCE of ", Quote(callable->s), ", which is not callable here");
  }
  if (!out.ok()) return out.status();
  return Push(*out);
}

// OrderedDict(pairs), torch.Size(tuple), set(list), frozenset(list).
Result<Value*> Machine::ReduceContainer(Global g, const std::vector<Value*>& a) {
  if (g == Global::kOrderedDict) {
    FERRY_ASSIGN_OR_RETURN(Value * out, New(Kind::kDict));
    if (a.size() == 1 && (a[0]->is(Kind::kList) || a[0]->is(Kind::kTuple))) {
      FERRY_RETURN_IF_ERROR(Charge(a[0]->items.size()));
      for (Value* pair : a[0]->items) {
        if (!pair->is(Kind::kTuple) || pair->items.size() != 2) {
          return Fail("OrderedDict item is not a pair");
        }
        out->dict.emplace_back(pair->items[0], pair->items[1]);
      }
    } else if (!a.empty()) {
      return Fail("OrderedDict with unexpected arguments");
    }
    return out;
  }
  if (g == Global::kTorchSize) {
    if (a.size() != 1 || (!a[0]->is(Kind::kTuple) && !a[0]->is(Kind::kList))) {
      return Fail("torch.Size without a tuple");
    }
    // A tuple never changes: the size is the tuple itself. A list may grow after the call.
    if (a[0]->is(Kind::kTuple)) return a[0];
    FERRY_RETURN_IF_ERROR(Charge(a[0]->items.size()));
    FERRY_ASSIGN_OR_RETURN(Value * out, New(Kind::kTuple));
    out->items = a[0]->items;
    return out;
  }
  FERRY_ASSIGN_OR_RETURN(Value * out, New(Kind::kSet));
  if (a.size() == 1 && (a[0]->is(Kind::kList) || a[0]->is(Kind::kTuple))) {
    FERRY_RETURN_IF_ERROR(Charge(a[0]->items.size()));
    out->items = a[0]->items;
  } else if (!a.empty()) {
    return Fail("set of something other than a list");
  }
  return out;
}

// _codecs.encode(str, "latin1"), bytearray(bytes), torch.storage._load_from_bytes(bytes).
Result<Value*> Machine::ReduceBytes(Global g, const std::vector<Value*>& a) {
  if (g == Global::kCodecsEncode) {
    // Protocol 2 pickles bytes as _codecs.encode(<latin-1 text as str>, "latin1").
    if (a.size() != 2 || !a[0]->is_str() || !a[1]->is_str() ||
        (a[1]->s != "latin1" && a[1]->s != "latin-1")) {
      return Fail("_codecs.encode other than (str, 'latin1')");
    }
    Value*& out = converted_[a[0]];
    if (out != nullptr) return out;
    FERRY_ASSIGN_OR_RETURN(out, New(Kind::kBytes));
    const std::string& in = a[0]->s;
    for (size_t k = 0; k < in.size(); ++k) {
      unsigned char c = static_cast<unsigned char>(in[k]);
      if (c < 0x80) {
        out->s += static_cast<char>(c);
      } else if ((c == 0xC2 || c == 0xC3) && k + 1 < in.size()) {
        out->s += static_cast<char>(((c & 0x1F) << 6) | (in[++k] & 0x3F));
      } else {
        return Fail("_codecs.encode of text outside latin-1");
      }
    }
    return out;
  }
  if (g == Global::kBytearray) {
    // Nothing changes bytes once built: bytearray(b) is b.
    if (a.size() == 1 && a[0]->is(Kind::kBytes)) return a[0];
    if (!a.empty()) return Fail("bytearray of something other than bytes");
    return New(Kind::kBytes);
  }
  if (a.size() != 1 || !a[0]->is(Kind::kBytes)) {
    return Fail("torch.storage._load_from_bytes without bytes");
  }
  Value*& out = converted_[a[0]];
  if (out != nullptr) return out;
  const std::string& b = a[0]->s;
  FERRY_ASSIGN_OR_RETURN(
      Storage * st, ParseLegacyStorage(heap_, reinterpret_cast<const uint8_t*>(b.data()), b.size(),
                                       StrCat(opt_.where, ": storage pickled at byte ",
                                              opt_.offset_base + op_pos_)));
  FERRY_ASSIGN_OR_RETURN(out, New(Kind::kStorage));
  out->storage = st;
  return out;
}

Status Machine::Build(Value* obj, Value* state) {
  if (obj->is(Kind::kObject)) {
    obj->state = state;
    return Status::Ok();
  }
  // OrderedDict state (a state_dict's `_metadata`) and tensor attributes are dropped.
  if (obj->is(Kind::kDict) || obj->is(Kind::kTensor)) return Status::Ok();
  return Fail("BUILD on a value that is not an allowed object");
}

Result<Value*> Machine::Run(uint64_t* consumed) {
  if (size_ < 2 || data_[0] != 0x80) {
    op_pos_ = 0;
    return Fail("not a pickle of protocol 2 or later (only protocols 2 to 5 are read)");
  }
  if (++heap_->nesting > kMaxPickleNesting) {
    --heap_->nesting;
    return Fail("pickles nested more than ", kMaxPickleNesting, " deep");
  }
  struct Unnest {
    Heap* h;
    ~Unnest() { --h->nesting; }
  } unnest{heap_};
  while (true) {
    op_pos_ = pos_;
    if (pos_ >= size_) return Fail("pickle ends without STOP");
    uint8_t op = data_[pos_++];
    if (op == '.') return Stop(consumed);
    FERRY_RETURN_IF_ERROR(Step(op));
  }
}

Result<Value*> Machine::Stop(uint64_t* consumed) {
  if (stack_.size() != 1 || !marks_.empty()) {
    return Fail("STOP with ", stack_.size(), " values on the stack");
  }
  if (consumed) {
    *consumed = pos_;
  } else if (pos_ != size_) {
    return Fail(size_ - pos_, " bytes after STOP");
  }
  return stack_.back();
}

// Each opcode family has its own step; the refused opcodes are named here.
Status Machine::Step(uint8_t op) {
  switch (op) {
    case 0x80:  // PROTO
    case 0x95:  // FRAME
      return Framing(op);
    case '(':  // MARK
    case '0':  // POP
    case '1':  // POP_MARK
    case '2':  // DUP
      return StackOp(op);
    case 'N':
    case 0x88:  // NEWTRUE
    case 0x89:  // NEWFALSE
    case 'J':   // BININT
    case 'K':   // BININT1
    case 'M':   // BININT2
    case 0x8a:  // LONG1
    case 0x8b:  // LONG4
    case 'G':   // BINFLOAT
      return Scalar(op);
    case 'X':   // BINUNICODE
    case 0x8c:  // SHORT_BINUNICODE
    case 0x8d:  // BINUNICODE8
    case 'T':   // BINSTRING
    case 'U':   // SHORT_BINSTRING
    case 'B':   // BINBYTES
    case 'C':   // SHORT_BINBYTES
    case 0x8e:  // BINBYTES8
    case 0x96:  // BYTEARRAY8
      return String(op);
    case ')':   // EMPTY_TUPLE
    case 0x85:  // TUPLE1
    case 0x86:  // TUPLE2
    case 0x87:  // TUPLE3
    case 't':   // TUPLE
    case 'l':   // LIST
    case 0x91:  // FROZENSET
    case ']':   // EMPTY_LIST
    case '}':   // EMPTY_DICT
    case 0x8f:  // EMPTY_SET
    case 'd':   // DICT
      return Container(op);
    case 'a':   // APPEND
    case 'e':   // APPENDS
    case 0x90:  // ADDITEMS
    case 's':   // SETITEM
    case 'u':   // SETITEMS
      return Fill(op);
    case 'h':   // BINGET
    case 'j':   // LONG_BINGET
    case 'q':   // BINPUT
    case 'r':   // LONG_BINPUT
    case 0x94:  // MEMOIZE
      return MemoOp(op);
    case 'c':   // GLOBAL
    case 0x93:  // STACK_GLOBAL
      return GlobalOp(op);
    case 'R':   // REDUCE
    case 0x81:  // NEWOBJ
    case 0x92:  // NEWOBJ_EX
    case 'b':   // BUILD
    case 'Q':   // BINPERSID
      return ObjectOp(op);
    default:
      return Refuse(op);
  }
}

Status Machine::Framing(uint8_t op) {
  if (op == 0x80) {  // PROTO
    FERRY_RETURN_IF_ERROR(Need(1));
    uint8_t v = data_[pos_++];
    if (v < 2 || v > 5) return Fail("pickle protocol ", int{v}, " (only 2 to 5 are read)");
    return Status::Ok();
  }
  // FRAME: a length hint, nothing to do but check it
  FERRY_RETURN_IF_ERROR(Need(8));
  if (LoadLE(data_ + pos_, 8) > size_ - pos_ - 8) return Fail("FRAME past the end");
  pos_ += 8;
  return Status::Ok();
}

Status Machine::StackOp(uint8_t op) {
  switch (op) {
    case '(':  // MARK
      if (marks_.size() >= kMaxPickleMarks) {
        return Error(StatusCode::kResourceExhausted, opt_.where, ": MARKs nested deeper than ",
                     kMaxPickleMarks, " at byte ", opt_.offset_base + op_pos_);
      }
      marks_.push_back(stack_.size());
      return Status::Ok();
    case '0':  // POP
      if (stack_.size() > MarkFloor()) {
        stack_.pop_back();
      } else if (!marks_.empty() && stack_.size() == marks_.back()) {
        marks_.pop_back();  // POP of a MARK, as CPython allows
      } else {
        return Fail("POP of an empty stack");
      }
      return Status::Ok();
    case '1': {  // POP_MARK
      FERRY_ASSIGN_OR_RETURN(auto dropped, PopMark());
      (void)dropped;
      return Status::Ok();
    }
    default:  // DUP
      if (stack_.size() <= MarkFloor()) return Fail("DUP of an empty stack");
      return Push(stack_.back());
  }
}

Status Machine::Scalar(uint8_t op) {
  switch (op) {
    case 'N': {
      FERRY_ASSIGN_OR_RETURN(Value * v, New(Kind::kNone));
      return Push(v);
    }
    case 0x88:
    case 0x89: {  // NEWTRUE, NEWFALSE
      FERRY_ASSIGN_OR_RETURN(Value * v, New(Kind::kBool));
      v->b = op == 0x88;
      return Push(v);
    }
    case 'J':
    case 'K':
    case 'M': {  // BININT (i32), BININT1 (u8), BININT2 (u16)
      int n = op == 'J' ? 4 : op == 'K' ? 1 : 2;
      FERRY_RETURN_IF_ERROR(Need(n));
      FERRY_ASSIGN_OR_RETURN(Value * v, New(Kind::kInt));
      uint64_t raw = LoadLE(data_ + pos_, n);
      v->i = op == 'J' ? int64_t{static_cast<int32_t>(raw)} : static_cast<int64_t>(raw);
      pos_ += n;
      return Push(v);
    }
    case 0x8a:
    case 0x8b: {  // LONG1, LONG4: little-endian two's complement of a given length
      int lw = op == 0x8a ? 1 : 4;
      FERRY_RETURN_IF_ERROR(Need(lw));
      uint64_t n = LoadLE(data_ + pos_, lw);
      if (op == 0x8b && (n >> 31) != 0) return Fail("negative LONG4 length");
      pos_ += lw;
      FERRY_RETURN_IF_ERROR(Need(n));
      FERRY_ASSIGN_OR_RETURN(Value * v, New(n <= 8 ? Kind::kInt : Kind::kBigInt));
      if (n <= 8) {
        uint64_t raw = n ? LoadLE(data_ + pos_, static_cast<int>(n)) : 0;
        if (n > 0 && n < 8 && (data_[pos_ + n - 1] & 0x80)) raw |= ~uint64_t{0} << (8 * n);
        v->i = static_cast<int64_t>(raw);
      } else {
        v->s.assign(reinterpret_cast<const char*>(data_ + pos_), n);
      }
      pos_ += n;
      return Push(v);
    }
    default: {  // BINFLOAT, big-endian
      FERRY_RETURN_IF_ERROR(Need(8));
      uint64_t raw = 0;
      for (int k = 0; k < 8; ++k) raw = (raw << 8) | data_[pos_ + k];
      pos_ += 8;
      FERRY_ASSIGN_OR_RETURN(Value * v, New(Kind::kFloat));
      std::memcpy(&v->f, &raw, 8);
      return Push(v);
    }
  }
}

// BINUNICODE (u32), SHORT_BINUNICODE (u8), BINUNICODE8; BINSTRING (i32), SHORT_BINSTRING;
// BINBYTES (u32), SHORT_BINBYTES, BINBYTES8, BYTEARRAY8.
Status Machine::String(uint8_t op) {
  int lw = (op == 0x8c || op == 'U' || op == 'C')     ? 1
           : (op == 0x8d || op == 0x8e || op == 0x96) ? 8
                                                      : 4;
  FERRY_RETURN_IF_ERROR(Need(lw));
  uint64_t n = LoadLE(data_ + pos_, lw);
  if (op == 'T' && (n >> 31) != 0) return Fail("negative BINSTRING length");
  pos_ += lw;
  bool text = op == 'X' || op == 0x8c || op == 0x8d || op == 'T' || op == 'U';
  return PushString(text ? Kind::kStr : Kind::kBytes, n);
}

Status Machine::Container(uint8_t op) {
  switch (op) {
    case ')': {
      FERRY_ASSIGN_OR_RETURN(Value * v, New(Kind::kTuple));
      return Push(v);
    }
    case 0x85:
    case 0x86:
    case 0x87: {  // TUPLE1..3
      size_t n = op - 0x84;
      if (stack_.size() < MarkFloor() + n) return Fail("TUPLE", n, " of a short stack");
      FERRY_ASSIGN_OR_RETURN(Value * v, New(Kind::kTuple));
      v->items.assign(stack_.end() - n, stack_.end());
      stack_.resize(stack_.size() - n);
      return Push(v);
    }
    case 't':
    case 'l':
    case 0x91: {  // TUPLE, LIST, FROZENSET
      FERRY_ASSIGN_OR_RETURN(auto items, PopMark());
      FERRY_ASSIGN_OR_RETURN(Value * v, New(op == 't'   ? Kind::kTuple
                                            : op == 'l' ? Kind::kList
                                                        : Kind::kSet));
      v->items = std::move(items);
      return Push(v);
    }
    case ']':
    case '}':
    case 0x8f: {  // EMPTY_LIST, EMPTY_DICT, EMPTY_SET
      FERRY_ASSIGN_OR_RETURN(Value * v, New(op == ']'   ? Kind::kList
                                            : op == '}' ? Kind::kDict
                                                        : Kind::kSet));
      return Push(v);
    }
    default: {  // DICT
      FERRY_ASSIGN_OR_RETURN(auto items, PopMark());
      if (items.size() % 2) return Fail("DICT with an odd number of items");
      FERRY_ASSIGN_OR_RETURN(Value * v, New(Kind::kDict));
      for (size_t k = 0; k < items.size(); k += 2) v->dict.emplace_back(items[k], items[k + 1]);
      return Push(v);
    }
  }
}

// APPEND, APPENDS, ADDITEMS, SETITEM, SETITEMS: into the container below the arguments.
Status Machine::Fill(uint8_t op) {
  switch (op) {
    case 'a': {  // APPEND
      FERRY_ASSIGN_OR_RETURN(Value * x, Pop());
      if (stack_.size() <= MarkFloor() || !stack_.back()->is(Kind::kList)) {
        return Fail("APPEND to something that is not a list");
      }
      stack_.back()->items.push_back(x);
      return Status::Ok();
    }
    case 'e':
    case 0x90: {  // APPENDS, ADDITEMS
      FERRY_ASSIGN_OR_RETURN(auto items, PopMark());
      Kind want = op == 'e' ? Kind::kList : Kind::kSet;
      if (stack_.size() <= MarkFloor() || !stack_.back()->is(want)) {
        return Fail(op == 'e' ? "APPENDS to something that is not a list"
                              : "ADDITEMS to something that is not a set");
      }
      auto& dst = stack_.back()->items;
      dst.insert(dst.end(), items.begin(), items.end());
      return Status::Ok();
    }
    case 's': {  // SETITEM
      FERRY_ASSIGN_OR_RETURN(Value * val, Pop());
      FERRY_ASSIGN_OR_RETURN(Value * key, Pop());
      if (stack_.size() <= MarkFloor() || !stack_.back()->is(Kind::kDict)) {
        return Fail("SETITEM on something that is not a dict");
      }
      stack_.back()->dict.emplace_back(key, val);
      return Status::Ok();
    }
    default: {  // SETITEMS
      FERRY_ASSIGN_OR_RETURN(auto items, PopMark());
      if (items.size() % 2) return Fail("SETITEMS with an odd number of items");
      if (stack_.size() <= MarkFloor() || !stack_.back()->is(Kind::kDict)) {
        return Fail("SETITEMS on something that is not a dict");
      }
      for (size_t k = 0; k < items.size(); k += 2) {
        stack_.back()->dict.emplace_back(items[k], items[k + 1]);
      }
      return Status::Ok();
    }
  }
}

Status Machine::MemoOp(uint8_t op) {
  if (op == 0x94) {  // MEMOIZE
    if (stack_.size() <= MarkFloor()) return Fail("MEMOIZE of an empty stack");
    return Memo(memo_.size(), stack_.back());
  }
  // BINGET, LONG_BINGET, BINPUT, LONG_BINPUT
  int n = op == 'h' || op == 'q' ? 1 : 4;
  FERRY_RETURN_IF_ERROR(Need(n));
  uint64_t idx = LoadLE(data_ + pos_, n);
  pos_ += n;
  if (op == 'h' || op == 'j') {
    auto it = memo_.find(idx);
    if (it == memo_.end()) return Fail("memo entry ", idx, " read before it was written");
    return Push(it->second);
  }
  if (stack_.size() <= MarkFloor()) return Fail("PUT of an empty stack");
  return Memo(idx, stack_.back());
}

// GLOBAL "module\nname\n", STACK_GLOBAL: only allow-listed names (Resolve).
Status Machine::GlobalOp(uint8_t op) {
  std::string module, name;
  if (op == 'c') {
    for (std::string* part : {&module, &name}) {
      const void* nl =
          std::memchr(data_ + pos_, '\n', std::min<uint64_t>(size_ - pos_, kMaxGlobalName));
      if (nl == nullptr) return Fail("GLOBAL without a newline-terminated name");
      uint64_t end = static_cast<const uint8_t*>(nl) - data_;
      part->assign(reinterpret_cast<const char*>(data_ + pos_), end - pos_);
      pos_ = end + 1;
    }
  } else {
    FERRY_ASSIGN_OR_RETURN(Value * n, Pop());
    FERRY_ASSIGN_OR_RETURN(Value * m, Pop());
    if (!m->is_str() || !n->is_str()) return Fail("STACK_GLOBAL of non-strings");
    if (m->s.size() > kMaxGlobalName || n->s.size() > kMaxGlobalName) {
      return Fail("STACK_GLOBAL of a name longer than ", kMaxGlobalName, " bytes");
    }
    module = m->s;
    name = n->s;
  }
  auto g = Resolve(module, name);
  if (!g) {
    return Fail("refused global ", Quote(StrCat(module, ".", name)),
                " (not a tensor, container or recipe the importer knows; nothing was run)");
  }
  FERRY_ASSIGN_OR_RETURN(Value * v, New(Kind::kGlobal));
  v->s = StrCat(module, ".", name);
  v->global = *g;
  return Push(v);
}

// REDUCE, NEWOBJ, NEWOBJ_EX, BUILD, BINPERSID: calls, all answered by the allow-list.
Status Machine::ObjectOp(uint8_t op) {
  switch (op) {
    case 'R': {  // REDUCE
      FERRY_ASSIGN_OR_RETURN(Value * args, Pop());
      FERRY_ASSIGN_OR_RETURN(Value * fn, Pop());
      return Reduce(fn, args);
    }
    case 0x81:
    case 0x92: {  // NEWOBJ (cls, args), NEWOBJ_EX (cls, args, kwargs)
      Value* kwargs = nullptr;
      if (op == 0x92) {
        FERRY_ASSIGN_OR_RETURN(kwargs, Pop());
      }
      FERRY_ASSIGN_OR_RETURN(Value * args, Pop());
      FERRY_ASSIGN_OR_RETURN(Value * cls, Pop());
      return NewObj(cls, args, kwargs);
    }
    case 'b': {  // BUILD
      FERRY_ASSIGN_OR_RETURN(Value * state, Pop());
      if (stack_.size() <= MarkFloor()) return Fail("BUILD of an empty stack");
      return Build(stack_.back(), state);
    }
    default: {  // BINPERSID
      FERRY_ASSIGN_OR_RETURN(Value * pid, Pop());
      if (!opt_.persistent_load) return Fail("persistent id where none is expected");
      FERRY_ASSIGN_OR_RETURN(Value * v, opt_.persistent_load(pid, opt_.offset_base + op_pos_));
      return Push(v);
    }
  }
}

Status Machine::NewObj(Value* cls, Value* args, Value* kwargs) {
  if (!cls->is(Kind::kGlobal) ||
      (cls->global != Global::kRecord && cls->global != Global::kBytesIO)) {
    return Fail("NEWOBJ of ", cls->is(Kind::kGlobal) ? Quote(cls->s) : "a non-class",
                ", which is not an allowed class");
  }
  if (!args->is(Kind::kTuple)) return Fail("NEWOBJ arguments are not a tuple");
  FERRY_ASSIGN_OR_RETURN(Value * v, New(Kind::kObject));
  v->s = cls->s;
  v->global = cls->global;
  v->args = args;
  if (kwargs) v->state = kwargs;
  return Push(v);
}

Status Machine::Refuse(uint8_t op) {
  switch (op) {
    case 'i':
      return Fail("refused opcode INST (builds an arbitrary object)");
    case 'o':
      return Fail("refused opcode OBJ (builds an arbitrary object)");
    case 0x82:
    case 0x83:
    case 0x84:
      return Fail("refused opcode EXT (copyreg extension registry)");
    case 0x97:
    case 0x98:
      return Fail("refused out-of-band buffer opcode");
    case 'P':
    case 'I':
    case 'L':
    case 'F':
    case 'S':
    case 'V':
    case 'g':
    case 'p':
      return Fail("protocol 0 opcode ", Quote(std::string(1, static_cast<char>(op))),
                  " (only protocols 2 to 5 are read)");
    default:
      return Fail("unknown pickle opcode 0x", std::hex, int{op});
  }
}

}  // namespace

std::optional<TorchDType> TorchDTypeByName(std::string_view name) {
  for (const DTypeRow& r : kDTypes) {
    if (name == r.name || (*r.alias && name == r.alias)) return FromRow(r);
  }
  return std::nullopt;
}

std::optional<TorchDType> TorchDTypeByStorage(std::string_view name) {
  if (name == "UntypedStorage" || name == "TypedStorage") return FromRow(kDTypes[8]);  // uint8
  for (const DTypeRow& r : kDTypes) {
    if (*r.storage && name == r.storage) return FromRow(r);
  }
  return std::nullopt;
}

const std::vector<Value*>& Value::Elements() const {
  static const std::vector<Value*> kNone;
  if (kind == Kind::kObject) return args != nullptr ? args->items : kNone;
  return items;
}

const Value* Value::Get(std::string_view key) const {
  constexpr size_t kScanned = 16;  // smaller dicts are scanned
  if (dict.size() <= kScanned) {
    for (const auto& [k, v] : dict) {
      if (k->is_str() && k->s == key) return v;
    }
    return nullptr;
  }
  if (!index_) index_ = std::make_unique<std::unordered_map<std::string_view, const Value*>>();
  // Entries are only ever appended, and key strings never change once built.
  for (; indexed_ < dict.size(); ++indexed_) {
    const auto& [k, v] = dict[indexed_];
    if (k->is_str()) index_->emplace(k->s, v);  // the first of repeated keys wins, as above
  }
  auto it = index_->find(key);
  return it == index_->end() ? nullptr : it->second;
}

std::string Value::ShortClass() const { return s.substr(s.rfind('.') + 1); }

Value* Heap::New(Value::Kind kind) {
  values_.emplace_back();
  values_.back().kind = kind;
  return &values_.back();
}
Storage* Heap::NewStorage() { return &storages_.emplace_back(); }
TensorRef* Heap::NewTensor() { return &tensors_.emplace_back(); }

Result<Value*> Unpickle(Heap* heap, const uint8_t* data, uint64_t size,
                        const UnpickleOptions& options, uint64_t* consumed) {
  Machine m(heap, data, size, options);
  return m.Run(consumed);
}

bool LooksLikeLegacyTorch(const uint8_t* data, uint64_t size) {
  return SniffFile(data, size) == FileKind::kTorchLegacy;
}

Result<Storage*> ParseLegacyStorage(Heap* heap, const uint8_t* data, uint64_t size,
                                    const std::string& where) {
  auto fail = [&](const auto&... args) {
    return Error(StatusCode::kDataLoss, where, ": legacy torch.save stream: ", args...);
  };
  if (!LooksLikeLegacyTorch(data, size)) return fail("no magic number");
  uint64_t pos = 0;
  Storage* storage = nullptr;
  UnpickleOptions o;
  o.where = where;
  // magic, protocol version, system info, the object, the storage keys
  Value* parts[5] = {};
  for (int k = 0; k < 5; ++k) {
    o.offset_base = pos;
    o.persistent_load = nullptr;
    if (k == 3) {
      o.persistent_load = [&](Value* pid, uint64_t off) -> Result<Value*> {
        // ("storage", storage_type, key, location, numel, view_metadata)
        if (!pid->is(Value::Kind::kTuple) || pid->items.size() != 6 || storage != nullptr ||
            !pid->items[0]->is_str() || pid->items[0]->s != "storage" ||
            !pid->items[1]->is(Value::Kind::kGlobal) ||
            pid->items[1]->global != Global::kStorageType || !pid->items[2]->is_str() ||
            !pid->items[3]->is_str() || !pid->items[5]->is(Value::Kind::kNone)) {
          return fail("unexpected persistent id at byte ", off);
        }
        storage = heap->NewStorage();
        storage->dtype = *TorchDTypeByStorage(pid->items[1]->ShortClass());
        storage->key = pid->items[2]->s;
        storage->location = pid->items[3]->s;
        Value* v = heap->New(Value::Kind::kStorage);
        v->storage = storage;
        return v;
      };
    }
    uint64_t used = 0;
    FERRY_ASSIGN_OR_RETURN(parts[k], Unpickle(heap, data + pos, size - pos, o, &used));
    pos += used;
  }
  if (!parts[1]->is(Value::Kind::kInt) || parts[1]->i != 1001) {
    return fail("protocol version is not 1001");
  }
  const Value* le = parts[2]->is(Value::Kind::kDict) ? parts[2]->Get("little_endian") : nullptr;
  if (le == nullptr || !le->is(Value::Kind::kBool) || !le->b) {
    return fail("written on a big-endian machine or without system info");
  }
  if (storage == nullptr || !parts[3]->is(Value::Kind::kStorage)) {
    return fail("holds something other than one storage");
  }
  if (!parts[4]->is(Value::Kind::kList) || parts[4]->items.size() != 1 ||
      !parts[4]->items[0]->is_str() || parts[4]->items[0]->s != storage->key) {
    return fail("storage key list does not name the storage");
  }
  if (size - pos < 8) return fail("truncated before the storage size");
  uint64_t numel = LoadLE(data + pos, 8), nbytes;
  pos += 8;
  if (MulOverflows(numel, static_cast<uint64_t>(storage->dtype.itemsize), &nbytes) ||
      nbytes > size - pos) {
    return fail("storage of ", numel, " elements runs past the stream's ", size, " bytes");
  }
  storage->data = data + pos;
  storage->nbytes = nbytes;
  return storage;
}

}  // namespace ferry::torch_import
