// The restricted pickle interpreter; see unpickle.hpp for what it accepts and why. This file
// holds what the allow-listed calls build (tensors, containers, bytes, records) and the entry
// points; the opcodes are read in pickle_opcodes.cc, the allow-list is pickle_globals.cc.
#include "import/torch/unpickle.hpp"

#include <cstring>
#include <unordered_map>

#include "base/util.hpp"
#include "format/sniff.hpp"
#include "import/torch/pickle_machine.hpp"

namespace ferry::torch_import {

namespace pickle {

namespace {

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

}  // namespace

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

}  // namespace pickle

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
  pickle::Machine m(heap, data, size, options);
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
  uint64_t numel = pickle::LoadLE(data + pos, 8), nbytes;
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
