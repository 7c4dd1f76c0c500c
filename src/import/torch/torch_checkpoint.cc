// torch.save zip files, sharded .bin indexes and DCP folders into TorchCheckpoint.
#include "import/torch/torch_checkpoint.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <set>
#include <tuple>

#include "base/util.hpp"
#include "format/safetensors.hpp"
#include "import/torch/te_extra_state.hpp"
#include "import/torch/zip.hpp"

namespace ferry::torch_import {

namespace {

using Kind = Value::Kind;
namespace fs = std::filesystem;

constexpr int kMaxWalkDepth = 64;
// Chunks of one DCP tensor (overlap is checked pairwise).
constexpr size_t kMaxChunks = 4096;
// A storage's key and location in a persistent id ("0", "cuda:0"): bounded, since every
// storage and tensor record keeps a copy of both.
constexpr size_t kMaxStorageString = 1024;

bool EndsWith(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

std::string KindName(const Value* v) {
  switch (v->kind) {
    case Kind::kNone:
      return "None";
    case Kind::kBool:
      return "bool";
    case Kind::kInt:
    case Kind::kBigInt:
      return "int";
    case Kind::kFloat:
      return "float";
    case Kind::kStr:
      return "str";
    case Kind::kBytes:
      return "bytes";
    case Kind::kTuple:
      return "tuple";
    case Kind::kList:
      return "list";
    case Kind::kDict:
      return "dict";
    case Kind::kSet:
      return "set";
    case Kind::kGlobal:
      return v->s;
    case Kind::kObject:
      return v->s + " object";
    case Kind::kStorage:
      return "storage";
    case Kind::kTensor:
      return "tensor";
  }
  return "?";
}

bool IsScalar(const Value* v) {
  return v->is(Kind::kNone) || v->is(Kind::kBool) || v->is(Kind::kInt) || v->is(Kind::kFloat) ||
         v->is(Kind::kStr);
}

}  // namespace

std::string PythonFloatRepr(double f) {
  if (std::isnan(f)) return "nan";
  if (std::isinf(f)) return f < 0 ? "-inf" : "inf";
  // The shortest digits that read back to `f`, as "d.ddde[+-]XX".
  char sci[64];
  const auto r = std::to_chars(sci, sci + sizeof(sci), f, std::chars_format::scientific);
  std::string_view text(sci, static_cast<size_t>(r.ptr - sci));
  std::string out;
  if (text.front() == '-') {
    out = "-";
    text.remove_prefix(1);
  }
  const size_t e = text.find('e');
  std::string digits(text.substr(0, e));
  digits.erase(std::remove(digits.begin(), digits.end(), '.'), digits.end());
  int exp = 0;
  std::from_chars(text.data() + e + (text[e + 1] == '+' ? 2 : 1), text.data() + text.size(), exp);
  const int n = static_cast<int>(digits.size());
  // repr's rule: positional from 1e-4 up to (not including) 1e16, always with a '.'.
  if (exp >= -4 && exp < 16) {
    if (exp < 0) return out + "0." + std::string(static_cast<size_t>(-exp - 1), '0') + digits;
    if (n <= exp + 1)
      return out + digits + std::string(static_cast<size_t>(exp + 1 - n), '0') + ".0";
    return out + digits.substr(0, static_cast<size_t>(exp + 1)) + "." +
           digits.substr(static_cast<size_t>(exp + 1));
  }
  out += digits.substr(0, 1);
  if (n > 1) out += "." + digits.substr(1);
  char tail[16];
  std::snprintf(tail, sizeof(tail), "e%c%02d", exp < 0 ? '-' : '+', exp < 0 ? -exp : exp);
  return out + tail;
}

namespace {

// Plain values (IsScalar) as metadata text; nullopt for anything else.
std::optional<std::string> ScalarText(const Value* v) {
  switch (v->kind) {
    case Kind::kNone:
      return "None";
    case Kind::kBool:
      return v->b ? "True" : "False";
    case Kind::kInt:
      return std::to_string(v->i);
    case Kind::kFloat:
      return PythonFloatRepr(v->f);
    case Kind::kStr:
      return v->s;
    default:
      return std::nullopt;
  }
}

// Reads the first bytes of a file without mapping it.
std::string Head(const std::string& path, size_t n) {
  std::string out(n, '\0');
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) return {};
  struct stat st;
  ssize_t got = -1;
  if (::fstat(fd, &st) == 0 && S_ISREG(st.st_mode)) got = ::read(fd, out.data(), n);
  ::close(fd);
  out.resize(got > 0 ? static_cast<size_t>(got) : 0);
  return out;
}

bool IsTorchFileHead(const std::string& h) {
  const auto* p = reinterpret_cast<const uint8_t*>(h.data());
  return LooksLikeZip(p, h.size()) || LooksLikeLegacyTorch(p, h.size());
}

// Field `name` of a recorded dataclass: its BUILD state is a dict, or (None, slots dict).
const Value* Field(const Value* obj, std::string_view name) {
  if (obj == nullptr || !obj->is(Kind::kObject) || obj->state == nullptr) return nullptr;
  const Value* st = obj->state;
  if (st->is(Kind::kTuple) && st->items.size() == 2) {
    if (const Value* f = st->items[0]->is(Kind::kDict) ? st->items[0]->Get(name) : nullptr) {
      return f;
    }
    st = st->items[1];
  }
  return st->is(Kind::kDict) ? st->Get(name) : nullptr;
}

}  // namespace

uint64_t TensorBytes(const TensorRef& t) {
  uint64_t n = static_cast<uint64_t>(t.dtype.itemsize);
  for (int64_t d : t.shape) n *= static_cast<uint64_t>(d);
  return n;
}

bool IsContiguous(const TensorRef& t) {
  int64_t expect = 1;
  for (size_t d = t.shape.size(); d-- > 0;) {
    if (t.shape[d] == 0) return true;
    if (t.shape[d] != 1 && t.stride[d] != expect) return false;
    expect *= t.shape[d];
  }
  return true;
}

Status CopyTensorBytes(const TensorRef& t, uint64_t offset, uint8_t* dst, uint64_t size,
                       const Mapping* guard, const std::string& where) {
  const uint64_t total = TensorBytes(t);
  if (offset > total || size > total - offset) {
    return Error(StatusCode::kInvalidArgument, where, ": read of bytes [", offset, ", ",
                 offset + size, ") past the tensor's ", total);
  }
  if (size == 0) return Status::Ok();
  const uint64_t is = static_cast<uint64_t>(t.dtype.itemsize);
  const uint8_t* base = t.storage->data + static_cast<uint64_t>(t.storage_offset) * is;
  bool ok = true;
  if (IsContiguous(t)) {
    auto copy = [&] { std::memcpy(dst, base + offset, size); };
    ok = guard ? guard->Guard(copy) : (copy(), true);
  } else {
    // A strided view: walk the row-major index from the first element touched.
    const size_t nd = t.shape.size();
    std::vector<int64_t> idx(nd, 0);
    uint64_t first = offset / is, rem = first, src = 0;
    for (size_t d = nd; d-- > 0;) {
      idx[d] = static_cast<int64_t>(rem % static_cast<uint64_t>(t.shape[d]));
      rem /= static_cast<uint64_t>(t.shape[d]);
      src += static_cast<uint64_t>(idx[d]) * static_cast<uint64_t>(t.stride[d]);
    }
    auto gather = [&] {
      uint64_t done = 0, skip = offset - first * is;
      while (done < size) {
        uint64_t n = std::min(is - skip, size - done);
        std::memcpy(dst + done, base + src * is + skip, n);
        done += n;
        skip = 0;
        for (size_t d = nd; d-- > 0;) {
          src += static_cast<uint64_t>(t.stride[d]);
          if (++idx[d] < t.shape[d]) break;
          src -= static_cast<uint64_t>(t.stride[d]) * static_cast<uint64_t>(t.shape[d]);
          idx[d] = 0;
        }
      }
    };
    ok = guard ? guard->Guard(gather) : (gather(), true);
  }
  if (!ok) {
    return Error(StatusCode::kDataLoss, where, ": the file shrank while it was read");
  }
  return Status::Ok();
}

Result<const Value*> GuardedCopy(Heap* heap, const uint8_t* data, uint64_t size,
                                 const Mapping* guard, const std::string& where) {
  Value* v = heap->New(Kind::kBytes);
  if (size == 0) return v;  // an empty file's mapping has no address to copy from
  v->s.resize(size);
  auto fn = [&] { std::memcpy(v->s.data(), data, size); };
  if (guard != nullptr ? !guard->Guard(fn) : (fn(), false)) {
    return Error(StatusCode::kDataLoss, where, ": the file shrank while it was read");
  }
  return v;
}

Result<Value*> LoadTorchZip(Heap* heap, const uint8_t* data, uint64_t size,
                            const std::string& where, const Mapping* guard) {
  FERRY_ASSIGN_OR_RETURN(const Value* head,
                         GuardedCopy(heap, data, std::min<uint64_t>(size, 16), guard, where));
  if (LooksLikeLegacyTorch(reinterpret_cast<const uint8_t*>(head->s.data()), head->s.size())) {
    return Error(StatusCode::kUnimplemented, where,
                 ": a legacy torch.save file (_use_new_zipfile_serialization=False, or torch "
                 "older than 1.6); only zip checkpoints are read: load and save it again with "
                 "a current torch");
  }
  FERRY_ASSIGN_OR_RETURN(ZipArchive zip, ZipArchive::Open(data, size, where, guard));
  // torch.save names every entry "<archive>/...": find "<archive>/data.pkl".
  const ZipEntry* pkl = nullptr;
  for (const ZipEntry& e : zip.entries()) {
    size_t slash = e.name.find('/');
    if (slash != std::string::npos && e.name.compare(slash, std::string::npos, "/data.pkl") == 0) {
      if (pkl != nullptr) {
        return Error(StatusCode::kDataLoss, where, ": more than one data.pkl in the archive");
      }
      pkl = &e;
    }
  }
  if (pkl == nullptr) {
    return Error(StatusCode::kDataLoss, where,
                 ": a zip archive without <name>/data.pkl, so not a torch.save checkpoint");
  }
  const std::string prefix = pkl->name.substr(0, pkl->name.size() - std::strlen("data.pkl"));
  if (const ZipEntry* bo = zip.Find(prefix + "byteorder")) {
    FERRY_ASSIGN_OR_RETURN(const uint8_t* p, zip.Data(*bo));
    FERRY_ASSIGN_OR_RETURN(const Value* order,
                           GuardedCopy(heap, p, std::min<uint64_t>(bo->size, 64), guard, where));
    if (order->s != "little") {
      return Error(StatusCode::kUnimplemented, where,
                   ": written on a big-endian machine (byteorder ", Quote(order->s), ")");
    }
  }
  FERRY_ASSIGN_OR_RETURN(const uint8_t* pkl_mapped, zip.Data(*pkl));
  // The pickle is interpreted from a copy: a file shrinking under the reader cannot fault.
  FERRY_ASSIGN_OR_RETURN(const Value* pkl_copy,
                         GuardedCopy(heap, pkl_mapped, pkl->size, guard, where));
  const auto* pkl_data = reinterpret_cast<const uint8_t*>(pkl_copy->s.data());
  std::map<std::string, Storage*> storages;
  UnpickleOptions o;
  o.where = StrCat(where, ": ", pkl->name);
  o.offset_base = pkl->data_offset;
  o.persistent_load = [&](Value* pid, uint64_t off) -> Result<Value*> {
    // ("storage", storage_type, key, location, numel)
    const auto& it = pid->items;
    if (!pid->is(Kind::kTuple) || it.size() != 5 || !it[0]->is_str() || it[0]->s != "storage" ||
        !it[1]->is(Kind::kGlobal) || it[1]->global != Global::kStorageType || !it[2]->is_str() ||
        !it[3]->is_str() || !it[4]->is(Kind::kInt) || it[4]->i < 0) {
      return Error(StatusCode::kDataLoss, o.where, ": unexpected persistent id at byte ", off);
    }
    if (it[2]->s.size() > kMaxStorageString || it[3]->s.size() > kMaxStorageString) {
      return Error(StatusCode::kDataLoss, o.where, ": storage key or location longer than ",
                   kMaxStorageString, " bytes at byte ", off);
    }
    TorchDType dt = *TorchDTypeByStorage(it[1]->ShortClass());
    uint64_t need;
    if (MulOverflows(static_cast<uint64_t>(it[4]->i), static_cast<uint64_t>(dt.itemsize), &need)) {
      return Error(StatusCode::kDataLoss, o.where, ": storage size overflows at byte ", off);
    }
    Storage*& st = storages[it[2]->s];
    if (st == nullptr) {
      const ZipEntry* e = zip.Find(prefix + "data/" + it[2]->s);
      if (e == nullptr) {
        return Error(StatusCode::kDataLoss, o.where, ": storage ", Quote(it[2]->s), " (byte ", off,
                     ") has no entry ", Quote(prefix + "data/" + it[2]->s));
      }
      FERRY_ASSIGN_OR_RETURN(const uint8_t* p, zip.Data(*e));
      st = heap->NewStorage();
      st->key = it[2]->s;
      st->location = it[3]->s;
      st->dtype = dt;
      st->data = p;
      st->nbytes = e->size;
    }
    if (need > st->nbytes) {
      return Error(StatusCode::kDataLoss, o.where, ": storage ", Quote(it[2]->s), " claims ", need,
                   " bytes; its entry holds ", st->nbytes);
    }
    Value* v = heap->New(Kind::kStorage);
    if (st->dtype.name != dt.name) {
      // One untyped storage seen through two dtypes: same bytes, the later dtype.
      Storage* alias = heap->NewStorage();
      *alias = *st;
      alias->dtype = dt;
      v->storage = alias;
    } else {
      v->storage = st;
    }
    return v;
  };
  return Unpickle(heap, pkl_data, pkl->size, o);
}

bool TorchCheckpoint::Recognises(const std::string& path) {
  std::error_code ec;
  if (fs::is_directory(path, ec)) return fs::exists(fs::path(path) / ".metadata", ec);
  if (EndsWith(path, ".json")) {
    auto index = ReadSafetensorsIndex(path);
    return index.ok() && !index->shards.empty() && IsTorchFileHead(Head(index->shards[0], 16));
  }
  return IsTorchFileHead(Head(path, 16));
}

void WalkBudget::Grant(uint64_t bytes) {
  input_ += bytes;
  uint64_t more;
  if (MulOverflows(bytes, kWalkBytesPerInputByte, &more) ||
      AddOverflows(granted_, more, &granted_)) {
    granted_ = UINT64_MAX;
  }
}

bool WalkBudget::Take(uint64_t bytes) {
  uint64_t after;
  if (AddOverflows(spent_, bytes, &after) || after > granted_) return false;
  spent_ = after;
  return true;
}

Status WalkBudget::Exhausted(const std::string& where) const {
  return Error(StatusCode::kResourceExhausted, where,
               ": reading the checkpoint's values would produce more than ", granted_,
               " bytes of names, metadata and tables (", kWalkBytesPerInputByte,
               " per byte of the ", input_, " bytes read, plus ", kWalkSlackBytes >> 20,
               " MiB): values reached over and over through shared references?");
}

Result<std::unique_ptr<TorchCheckpoint>> TorchCheckpoint::Open(const std::string& path) {
  std::unique_ptr<TorchCheckpoint> ck(new TorchCheckpoint());
  ck->path_ = path;
  std::error_code ec;
  if (fs::is_directory(path, ec)) {
    ck->kind_ = "PyTorch DCP";
    FERRY_RETURN_IF_ERROR(ck->AddDcp(path));
  } else if (EndsWith(path, ".json")) {
    FERRY_RETURN_IF_ERROR(ck->AddShards(path));
  } else {
    ck->kind_ = "torch.save";
    FERRY_RETURN_IF_ERROR(ck->AddFile(path));
  }
  FERRY_RETURN_IF_ERROR(ck->CheckUnique());
  return ck;
}

Status TorchCheckpoint::AddShards(const std::string& path) {
  FERRY_ASSIGN_OR_RETURN(SafetensorsIndex index, ReadSafetensorsIndex(path));
  if (index.shards.empty()) {
    return Error(StatusCode::kInvalidArgument, path, ": the index's weight_map lists no tensors");
  }
  kind_ = StrCat("torch.save, ", index.shards.size(), " shards");
  // The shard each tensor (and each extra state) was found in; SIZE_MAX for extra state,
  // which the weight_map lists under its module's "<module>._extra_state".
  std::map<std::string, size_t> holder;
  for (size_t k = 0; k < index.shards.size(); ++k) {
    const size_t first = tensors_.size();
    FERRY_RETURN_IF_ERROR(AddFile(index.shards[k]));
    for (size_t i = first; i < tensors_.size(); ++i) {
      auto [it, added] = holder.emplace(tensors_[i].name, k);
      if (!added) {
        return Error(StatusCode::kDataLoss, path, ": tensor ", Quote(tensors_[i].name),
                     " is in two shards: ", index.shards[it->second], " and ", index.shards[k]);
      }
    }
  }
  for (const ScalingState& s : scaling_) holder.emplace(s.module + "._extra_state", SIZE_MAX);
  // The weight_map and the shards must agree in both directions.
  for (const auto& [name, k] : index.weight_map) {
    auto it = holder.find(name);
    if (it == holder.end() || (it->second != k && it->second != SIZE_MAX)) {
      return Error(StatusCode::kDataLoss, path, ": weight_map puts tensor ", Quote(name),
                   " in shard ", index.shards[k], ", which does not hold it",
                   it == holder.end() ? "" : StrCat(" (", index.shards[it->second], " does)"));
    }
  }
  std::set<std::string> listed;
  for (const auto& [name, k] : index.weight_map) listed.insert(name);
  for (const ImportedTensor& t : tensors_) {
    if (!listed.count(t.name)) {
      return Error(StatusCode::kDataLoss, path, ": shard ", t.source, " holds tensor ",
                   Quote(t.name), ", which the weight_map does not list");
    }
  }
  for (const auto& [k, v] : index.metadata) metadata_.emplace_back(k, v);
  return Status::Ok();
}

// Names must be unique across the whole checkpoint; a collision names both places.
Status TorchCheckpoint::CheckUnique() const {
  std::map<std::string_view, const ImportedTensor*> names;
  for (const ImportedTensor& t : tensors_) {
    auto [it, added] = names.emplace(t.name, &t);
    if (added) continue;
    const std::string& other = it->second->source;
    return Error(StatusCode::kDataLoss, path_, ": tensor ", Quote(t.name), " appears twice",
                 other == t.source ? StrCat(" in ", t.source)
                                   : StrCat(": in ", other, " and in ", t.source));
  }
  std::set<std::string_view> modules;
  for (const ScalingState& s : scaling_) {
    if (!modules.insert(s.module).second) {
      return Error(StatusCode::kDataLoss, path_, ": extra state of module ", Quote(s.module),
                   " appears twice");
    }
  }
  return Status::Ok();
}

Result<std::shared_ptr<Mapping>> TorchCheckpoint::Map(const std::string& file) {
  FERRY_ASSIGN_OR_RETURN(std::shared_ptr<Mapping> m, Mapping::Map(file));
  mappings_.push_back(m);
  budget_.Grant(m->size());
  return m;
}

Status TorchCheckpoint::AddFile(const std::string& file) {
  FERRY_ASSIGN_OR_RETURN(std::shared_ptr<Mapping> m, Map(file));
  FERRY_ASSIGN_OR_RETURN(Value * root,
                         LoadTorchZip(heap_.get(), m->data(), m->size(), file, m.get()));
  if (root->is(Kind::kTensor)) return AddTensor("tensor", root, m.get(), file);
  if (!root->is(Kind::kDict)) {
    return Error(StatusCode::kUnimplemented, file, ": holds a ", KindName(root),
                 ", not a dict of tensors");
  }
  return Walk(root, "", 0, m.get(), file);
}

Status TorchCheckpoint::AddTensor(const std::string& name, const Value* v, const Mapping* mapping,
                                  const std::string& file) {
  const TensorRef& t = *v->tensor;
  if (!t.dtype.dtype) {
    return Error(StatusCode::kUnimplemented, file, ": tensor ", Quote(name), " is torch.",
                 t.dtype.name, ", which TensorFerry cannot store");
  }
  // The record's fixed part, and what it copies from the pickle.
  if (!budget_.Take(64 + name.size() + t.storage->location.size() + 8 * t.shape.size())) {
    return budget_.Exhausted(StrCat(file, ": tensor ", Quote(name)));
  }
  ImportedTensor it;
  it.name = name;
  it.dtype = *t.dtype.dtype;
  it.shape = t.shape;
  if (t.dtype.packed_x2) {
    // TensorFerry counts F4 elements, two per torch element: the last dimension doubles.
    if (it.shape.empty()) it.shape.push_back(1);
    if (it.shape.back() > INT64_MAX / 2) {
      return Error(StatusCode::kDataLoss, file, ": tensor ", Quote(name), " of torch.",
                   t.dtype.name, " has more F4 elements than an int64 counts");
    }
    it.shape.back() *= 2;
  }
  it.nbytes = TensorBytes(t);
  it.ref = &t;
  it.mapping = mapping;
  it.source = file;
  it.location = t.storage->location;
  tensors_.push_back(std::move(it));
  return Status::Ok();
}

Status TorchCheckpoint::AddMetadata(const std::string& name, std::string text,
                                    const std::string& file) {
  if (!budget_.Take(name.size() + text.size())) {
    return budget_.Exhausted(StrCat(file, ": entry ", Quote(name)));
  }
  metadata_.emplace_back(name, std::move(text));
  return Status::Ok();
}

Status TorchCheckpoint::AddSkipped(std::string note) {
  if (!budget_.Take(note.size())) return budget_.Exhausted(note);
  skipped_.push_back(std::move(note));
  return Status::Ok();
}

// Every visit is paid for (one byte and its name's length): shared containers are walked
// once per path that reaches them, as their entries are imported under each path's names,
// and the budget stops a pickle whose paths multiply.
Status TorchCheckpoint::Walk(const Value* v, const std::string& name, int depth,
                             const Mapping* mapping, const std::string& file) {
  if (depth > kMaxWalkDepth) {
    return Error(StatusCode::kDataLoss, file, ": entry ", Quote(name), " nests deeper than ",
                 kMaxWalkDepth, " levels (or refers to itself)");
  }
  if (!budget_.Take(1 + name.size())) {
    return budget_.Exhausted(StrCat(file, ": entry ", Quote(name)));
  }
  if (EndsWith(name, "_extra_state") &&
      (name == "_extra_state" || EndsWith(name, "._extra_state"))) {
    std::string module = name.size() > 13 ? name.substr(0, name.size() - 13) : "";
    FERRY_ASSIGN_OR_RETURN(ScalingState s,
                           DecodeExtraState(heap_.get(), v, module, mapping,
                                            StrCat(file, ": ", Quote(name)), &metadata_, &budget_));
    scaling_.push_back(std::move(s));
    return Status::Ok();
  }
  switch (v->kind) {
    case Kind::kTensor:
      return AddTensor(name, v, mapping, file);
    case Kind::kDict:
      for (const auto& [k, x] : v->dict) {
        std::string part;
        if (k->is_str()) {
          part = k->s;
        } else if (k->is(Kind::kInt)) {
          part = std::to_string(k->i);
        } else {
          FERRY_RETURN_IF_ERROR(
              AddSkipped(StrCat(file, ": ", name.empty() ? "top level" : Quote(name),
                                ": an entry keyed by a ", KindName(k))));
          continue;
        }
        FERRY_RETURN_IF_ERROR(
            Walk(x, name.empty() ? part : name + "." + part, depth + 1, mapping, file));
      }
      return Status::Ok();
    case Kind::kList:
    case Kind::kTuple:
      return WalkItems(v, name, depth, mapping, file);
    default:
      if (auto text = ScalarText(v)) return AddMetadata(name, std::move(*text), file);
      return AddSkipped(StrCat(file, ": ", Quote(name), ": a ", KindName(v)));
  }
}

// A list or tuple: of plain values, one metadata entry "[a, b]" (each piece paid for as it is
// added, as the same long string may be listed many times); else each item under "name.i".
Status TorchCheckpoint::WalkItems(const Value* v, const std::string& name, int depth,
                                  const Mapping* mapping, const std::string& file) {
  bool plain = true;
  for (const Value* x : v->items) plain &= IsScalar(x);
  if (!plain) {
    for (size_t i = 0; i < v->items.size(); ++i) {
      const std::string part = std::to_string(i);
      FERRY_RETURN_IF_ERROR(
          Walk(v->items[i], name.empty() ? part : name + "." + part, depth + 1, mapping, file));
    }
    return Status::Ok();
  }
  std::string text = "[";
  for (size_t i = 0; i < v->items.size(); ++i) {
    const std::string piece = *ScalarText(v->items[i]);
    if (!budget_.Take(2 + piece.size())) {
      return budget_.Exhausted(StrCat(file, ": entry ", Quote(name)));
    }
    text += (i ? ", " : "") + piece;
  }
  return AddMetadata(name, text + "]", file);
}

Status TorchCheckpoint::Read(const ImportedTensor& t, uint64_t offset, void* dst,
                             uint64_t size) const {
  const std::string where = StrCat(t.source, ": tensor ", Quote(t.name));
  if (t.pieces.empty()) {
    return CopyTensorBytes(*t.ref, offset, static_cast<uint8_t*>(dst), size, t.mapping, where);
  }
  if (offset > t.nbytes || size > t.nbytes - offset) {
    return Error(StatusCode::kInvalidArgument, where, ": read past the tensor");
  }
  // Row by row (the last dimension), each row's bytes from the chunks that hold them; the
  // chunks were checked at open to cover the tensor exactly.
  const size_t nd = t.torch_shape.size();
  const uint64_t is = static_cast<uint64_t>(t.ref->dtype.itemsize);
  const uint64_t row_bytes = static_cast<uint64_t>(t.torch_shape[nd - 1]) * is;
  auto* out = static_cast<uint8_t*>(dst);
  std::vector<int64_t> idx(nd, 0);
  uint64_t pos = offset;
  while (pos < offset + size) {
    uint64_t row = pos / row_bytes, b0 = pos % row_bytes;
    uint64_t b1 = std::min(row_bytes, b0 + (offset + size - pos));
    uint64_t r = row;
    for (size_t d = nd - 1; d-- > 0;) {
      idx[d] = static_cast<int64_t>(r % static_cast<uint64_t>(t.torch_shape[d]));
      r /= static_cast<uint64_t>(t.torch_shape[d]);
    }
    for (const TensorPiece& p : t.pieces) {
      const std::vector<int64_t>& ps = p.ref->shape;
      bool inside = true;
      uint64_t prow = 0;
      for (size_t d = 0; d + 1 < nd; ++d) {
        int64_t local = idx[d] - p.offsets[d];
        inside &= local >= 0 && local < ps[d];
        prow = prow * static_cast<uint64_t>(ps[d]) +
               static_cast<uint64_t>(std::max<int64_t>(local, 0));
      }
      if (!inside) continue;
      uint64_t c0 = static_cast<uint64_t>(p.offsets[nd - 1]) * is;
      uint64_t c1 = c0 + static_cast<uint64_t>(ps[nd - 1]) * is;
      uint64_t x0 = std::max(b0, c0), x1 = std::min(b1, c1);
      if (x0 >= x1) continue;
      uint64_t src = (prow * static_cast<uint64_t>(ps[nd - 1])) * is + (x0 - c0);
      FERRY_RETURN_IF_ERROR(CopyTensorBytes(*p.ref, src, out + (row * row_bytes + x0 - offset),
                                            x1 - x0, p.mapping, where));
    }
    pos += b1 - b0;
  }
  return Status::Ok();
}

// ---- Distributed Checkpoint -------------------------------------------------------------

// What one DCP folder's import needs across its tensors.
struct TorchCheckpoint::Dcp {
  std::string dir, meta_path;
  // storage_data: fqn -> chunk offsets -> _StorageInfo.
  std::map<std::string_view, std::map<std::vector<int64_t>, const Value*>> infos;
  std::map<std::string, std::shared_ptr<Mapping>> files;  // by relative path
  // Per data file, the byte ranges items were read from: start -> (end, "tensor 'w' chunk 0").
  // Each byte is read at most once, so the parsing is bounded by the files' size however
  // many chunk entries a small .metadata lists.
  std::map<std::string, std::map<uint64_t, std::pair<uint64_t, std::string>>> claims;

  template <typename... Args>
  Status Bad(const Args&... args) const {
    return Error(StatusCode::kDataLoss, meta_path, ": ", args...);
  }
};

// One item of a data file: a torch.save archive at (relative_path, offset, length).
struct TorchCheckpoint::DcpItem {
  Value* value = nullptr;
  const Mapping* mapping = nullptr;
  std::string path;
};

namespace {

// A tuple of non-negative ints (DCP offsets, sizes): at most kMaxTensorDims, counted before
// anything is copied; nullopt otherwise.
std::optional<std::vector<int64_t>> DcpDims(const Value* v) {
  if (v == nullptr || !v->is(Kind::kTuple) || v->items.size() > kMaxTensorDims) {
    return std::nullopt;
  }
  std::vector<int64_t> out;
  for (const Value* x : v->items) {
    if (!x->is(Kind::kInt) || x->i < 0) return std::nullopt;
    out.push_back(x->i);
  }
  return out;
}

// The element count of non-negative dims, or nullopt when it passes INT64_MAX.
std::optional<uint64_t> CheckedCount(const std::vector<int64_t>& dims) {
  uint64_t n = 1;
  for (int64_t d : dims) {
    if (MulOverflows(n, static_cast<uint64_t>(d), &n) || n > uint64_t{INT64_MAX}) {
      return std::nullopt;
    }
  }
  return n;
}

}  // namespace

Status TorchCheckpoint::AddDcp(const std::string& dir) {
  Dcp dcp;
  dcp.dir = dir;
  dcp.meta_path = (fs::path(dir) / ".metadata").string();
  FERRY_ASSIGN_OR_RETURN(std::shared_ptr<Mapping> mm, Map(dcp.meta_path));
  UnpickleOptions o;
  o.where = dcp.meta_path;
  FERRY_ASSIGN_OR_RETURN(const Value* meta,
                         GuardedCopy(heap_.get(), mm->data(), mm->size(), mm.get(), dcp.meta_path));
  FERRY_ASSIGN_OR_RETURN(
      Value * root,
      Unpickle(heap_.get(), reinterpret_cast<const uint8_t*>(meta->s.data()), meta->s.size(), o));
  if (!root->is(Kind::kObject) || root->ShortClass() != "Metadata") {
    return dcp.Bad("holds a ", KindName(root), ", not DCP Metadata");
  }
  const Value* sdm = Field(root, "state_dict_metadata");
  const Value* sd = Field(root, "storage_data");
  if (sdm == nullptr || !sdm->is(Kind::kDict) || sd == nullptr || !sd->is(Kind::kDict)) {
    return dcp.Bad("Metadata without state_dict_metadata and storage_data dicts");
  }
  for (const auto& [k, info] : sd->dict) {
    const Value* fqn = Field(k, "fqn");
    const Value* off = Field(k, "offset");
    if (fqn == nullptr || !fqn->is_str()) return dcp.Bad("storage_data key without an fqn");
    std::optional<std::vector<int64_t>> offsets = std::vector<int64_t>{};
    if (off != nullptr && !off->is(Kind::kNone)) offsets = DcpDims(off);
    if (!offsets) return dcp.Bad("storage_data offset is not integers");
    dcp.infos[fqn->s][std::move(*offsets)] = info;
  }
  std::set<std::string_view> seen;
  for (const auto& [key, md] : sdm->dict) {
    if (!key->is_str()) return dcp.Bad("state_dict_metadata key is not a string");
    if (!seen.insert(key->s).second) {
      return dcp.Bad("tensor ", Quote(key->s), " appears twice in state_dict_metadata");
    }
    FERRY_RETURN_IF_ERROR(AddDcpTensor(dcp, key->s, md));
  }
  return Status::Ok();
}

Status TorchCheckpoint::AddDcpTensor(Dcp& dcp, const std::string& fqn, const Value* md) {
  if (md->is(Kind::kObject) && md->ShortClass() == "BytesStorageMetadata") {
    return AddSkipped(StrCat(dcp.dir, ": ", Quote(fqn), ": a pickled object (BytesIO item)"));
  }
  const Value* chunks = Field(md, "chunks");
  const Value* size = Field(md, "size");
  if (chunks == nullptr || !chunks->is(Kind::kList) || size == nullptr || !size->is(Kind::kTuple)) {
    return dcp.Bad("tensor ", Quote(fqn), ": no chunks or size");
  }
  auto global = DcpDims(size);
  if (!global) return dcp.Bad("tensor ", Quote(fqn), ": bad size");
  if (!CheckedCount(*global)) {
    return dcp.Bad("tensor ", Quote(fqn), ": size has more elements than an int64 counts");
  }
  if (chunks->items.empty() || chunks->items.size() > kMaxChunks) {
    return dcp.Bad("tensor ", Quote(fqn), ": ", chunks->items.size(), " chunks");
  }
  return AddDcpChunks(dcp, fqn, chunks, *global);
}

Status TorchCheckpoint::AddDcpChunks(Dcp& dcp, const std::string& fqn, const Value* chunks,
                                     const std::vector<int64_t>& global) {
  auto infos = dcp.infos.find(fqn);
  const bool extra_state = EndsWith(fqn, "_extra_state");
  if (extra_state && chunks->items.size() != 1) {
    return dcp.Bad("extra state ", Quote(fqn), " in chunks");
  }
  ImportedTensor whole;
  std::vector<std::vector<int64_t>> boxes_off, boxes_size;
  uint64_t covered = 0;
  for (size_t c = 0; c < chunks->items.size(); ++c) {
    const Value* chunk = chunks->items[c];
    auto offsets = DcpDims(Field(chunk, "offsets"));
    auto sizes = DcpDims(Field(chunk, "sizes"));
    if (!offsets || !sizes) return dcp.Bad("tensor ", Quote(fqn), ": bad chunk");
    if (offsets->size() != global.size() || sizes->size() != global.size()) {
      return dcp.Bad("tensor ", Quote(fqn), ": chunk ", c, " has the wrong rank");
    }
    for (size_t d = 0; d < global.size(); ++d) {
      if ((*offsets)[d] > global[d] || (*sizes)[d] > global[d] - (*offsets)[d]) {
        return dcp.Bad("tensor ", Quote(fqn), ": chunk ", c, " lies outside the tensor");
      }
    }
    const uint64_t numel = *CheckedCount(*sizes);  // inside the tensor, so it fits
    for (size_t o = 0; o < boxes_off.size(); ++o) {
      bool overlap = numel > 0;
      for (size_t d = 0; d < global.size() && overlap; ++d) {
        overlap = (*offsets)[d] < boxes_off[o][d] + boxes_size[o][d] &&
                  boxes_off[o][d] < (*offsets)[d] + (*sizes)[d];
      }
      if (overlap) return dcp.Bad("tensor ", Quote(fqn), ": chunks ", o, " and ", c, " overlap");
    }
    covered += numel;
    const Value* info = nullptr;
    if (infos != dcp.infos.end()) {
      auto it = infos->second.find(*offsets);
      if (it != infos->second.end()) info = it->second;
    }
    if (info == nullptr) {
      return dcp.Bad("tensor ", Quote(fqn), ": no storage_data entry for chunk ", c);
    }
    FERRY_ASSIGN_OR_RETURN(DcpItem item, LoadDcpItem(dcp, fqn, c, info));
    if (!item.value->is(Kind::kTensor) || item.value->tensor->shape != *sizes) {
      return Error(StatusCode::kDataLoss, item.path, ": tensor ", Quote(fqn), " chunk ", c,
                   " is not a tensor of the chunk's shape");
    }
    if (extra_state) return Walk(item.value, fqn, 0, item.mapping, item.path);
    if (c == 0) {
      FERRY_RETURN_IF_ERROR(AddTensor(fqn, item.value, item.mapping, item.path));
      whole = std::move(tensors_.back());
      tensors_.pop_back();
    } else if (item.value->tensor->dtype.name != whole.ref->dtype.name) {
      return Error(StatusCode::kDataLoss, item.path, ": tensor ", Quote(fqn), " chunk ", c,
                   " has another dtype than chunk 0");
    }
    whole.pieces.push_back(TensorPiece{item.value->tensor, item.mapping, *offsets});
    boxes_off.push_back(std::move(*offsets));
    boxes_size.push_back(std::move(*sizes));
  }
  const uint64_t total = *CheckedCount(global);
  if (covered != total) {
    return dcp.Bad("tensor ", Quote(fqn), ": its chunks cover ", covered, " of its ", total,
                   " elements");
  }
  whole.torch_shape = global;
  whole.shape = global;
  if (whole.ref->dtype.packed_x2) {
    if (whole.shape.empty()) whole.shape.push_back(1);
    if (whole.shape.back() > INT64_MAX / 2) {
      return dcp.Bad("tensor ", Quote(fqn), " has more F4 elements than an int64 counts");
    }
    whole.shape.back() *= 2;
  }
  uint64_t nbytes;
  if (MulOverflows(total, static_cast<uint64_t>(whole.ref->dtype.itemsize), &nbytes) ||
      nbytes > uint64_t{INT64_MAX}) {
    return dcp.Bad("tensor ", Quote(fqn), " is more than 2^63 bytes");
  }
  whole.nbytes = nbytes;
  if (whole.pieces.size() == 1 || global.empty()) {
    whole.pieces.clear();  // one chunk is the tensor: read it directly
  }
  tensors_.push_back(std::move(whole));
  return Status::Ok();
}

Result<TorchCheckpoint::DcpItem> TorchCheckpoint::LoadDcpItem(Dcp& dcp, const std::string& fqn,
                                                              size_t chunk, const Value* info) {
  const Value* rel = Field(info, "relative_path");
  const Value* off = Field(info, "offset");
  const Value* len = Field(info, "length");
  const Value* tds = Field(info, "transform_descriptors");
  if (rel == nullptr || !rel->is_str() || off == nullptr || !off->is(Kind::kInt) ||
      len == nullptr || !len->is(Kind::kInt) || off->i < 0 || len->i < 0) {
    return dcp.Bad("tensor ", Quote(fqn), ": bad storage info");
  }
  if (tds != nullptr && !tds->is(Kind::kNone) && !tds->Elements().empty()) {
    return Error(StatusCode::kUnimplemented, dcp.meta_path, ": tensor ", Quote(fqn),
                 " is stored through transforms (compression or encryption)");
  }
  if (rel->s.empty() || rel->s.find('/') != std::string::npos || rel->s[0] == '.') {
    return dcp.Bad("tensor ", Quote(fqn), ": data file ", Quote(rel->s),
                   " is not a plain name in the folder");
  }
  std::shared_ptr<Mapping>& m = dcp.files[rel->s];
  const std::string data_path = (fs::path(dcp.dir) / rel->s).string();
  if (!m) {
    FERRY_ASSIGN_OR_RETURN(m, Map(data_path));
  }
  uint64_t o64 = static_cast<uint64_t>(off->i), l64 = static_cast<uint64_t>(len->i);
  if (o64 > m->size() || l64 > m->size() - o64) {
    return Error(StatusCode::kDataLoss, data_path, ": tensor ", Quote(fqn), " at offset ", o64,
                 " (", l64, " bytes) lies outside the file's ", m->size(), " bytes");
  }
  std::string who = StrCat("tensor ", Quote(fqn), " chunk ", chunk);
  auto& claims = dcp.claims[rel->s];
  auto next = claims.lower_bound(o64);
  const auto* clash = next != claims.end() && next->first < o64 + l64 ? &*next : nullptr;
  if (clash == nullptr && next != claims.begin() && std::prev(next)->second.first > o64) {
    clash = &*std::prev(next);
  }
  if (l64 > 0 && clash != nullptr) {
    return Error(StatusCode::kDataLoss, data_path, ": ", who, " (bytes ", o64, " to ", o64 + l64,
                 ") and ", clash->second.second, " (bytes ", clash->first, " to ",
                 clash->second.first, ") overlap: each item of a data file is read once");
  }
  if (l64 > 0) claims.emplace(o64, std::pair{o64 + l64, std::move(who)});
  const std::string where = StrCat(data_path, " at offset ", o64);
  FERRY_ASSIGN_OR_RETURN(Value * v,
                         LoadTorchZip(heap_.get(), m->data() + o64, l64, where, m.get()));
  return DcpItem{v, m.get(), data_path};
}

}  // namespace ferry::torch_import
