// torch.save zip files, sharded .bin indexes and DCP folders into TorchCheckpoint.
#include "import/torch/torch_checkpoint.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <set>
#include <sstream>
#include <tuple>

#include "format/safetensors.hpp"
#include "import/torch/te_extra_state.hpp"
#include "import/torch/zip.hpp"
#include "base/util.hpp"

namespace ferry::torch_import {

namespace {

using Kind = Value::Kind;
namespace fs = std::filesystem;

constexpr int kMaxWalkDepth = 64;
// Chunks of one DCP tensor (overlap is checked pairwise).
constexpr size_t kMaxChunks = 4096;

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

// Plain values as metadata text; nullopt for anything else.
std::optional<std::string> ScalarText(const Value* v) {
  switch (v->kind) {
    case Kind::kNone:
      return "None";
    case Kind::kBool:
      return v->b ? "True" : "False";
    case Kind::kInt:
      return std::to_string(v->i);
    case Kind::kFloat: {
      std::ostringstream o;
      o.precision(17);
      o << v->f;
      return o.str();
    }
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

Result<std::unique_ptr<TorchCheckpoint>> TorchCheckpoint::Open(const std::string& path) {
  std::unique_ptr<TorchCheckpoint> ck(new TorchCheckpoint());
  ck->path_ = path;
  std::error_code ec;
  if (fs::is_directory(path, ec)) {
    ck->kind_ = "PyTorch DCP";
    FERRY_RETURN_IF_ERROR(ck->AddDcp(path));
  } else if (EndsWith(path, ".json")) {
    FERRY_ASSIGN_OR_RETURN(SafetensorsIndex index, ReadSafetensorsIndex(path));
    if (index.shards.empty()) {
      return Error(StatusCode::kInvalidArgument, path, ": the index's weight_map lists no tensors");
    }
    ck->kind_ = StrCat("torch.save, ", index.shards.size(), " shards");
    std::vector<size_t> first(index.shards.size());
    for (size_t k = 0; k < index.shards.size(); ++k) {
      first[k] = ck->tensors_.size();
      FERRY_RETURN_IF_ERROR(ck->AddFile(index.shards[k]));
    }
    // The weight_map and the shards must agree in both directions.
    std::map<std::string, size_t> holder;
    for (size_t k = 0; k < index.shards.size(); ++k) {
      size_t end = k + 1 < first.size() ? first[k + 1] : ck->tensors_.size();
      for (size_t i = first[k]; i < end; ++i) holder[ck->tensors_[i].name] = k;
    }
    for (const ScalingState& s : ck->scaling_) holder.emplace(s.module + "._extra_state", SIZE_MAX);
    for (const auto& [name, k] : index.weight_map) {
      auto it = holder.find(name);
      if (it == holder.end() || (it->second != k && it->second != SIZE_MAX)) {
        return Error(StatusCode::kDataLoss, path, ": weight_map puts tensor ", Quote(name),
                     " in shard ", index.shards[k], ", which does not hold it");
      }
    }
    std::set<std::string> listed;
    for (const auto& [name, k] : index.weight_map) listed.insert(name);
    for (const ImportedTensor& t : ck->tensors_) {
      if (!listed.count(t.name)) {
        return Error(StatusCode::kDataLoss, path, ": shard ", t.source, " holds tensor ",
                     Quote(t.name), ", which the weight_map does not list");
      }
    }
    for (const auto& [k, v] : index.metadata) ck->metadata_.emplace_back(k, v);
  } else {
    ck->kind_ = "torch.save";
    FERRY_RETURN_IF_ERROR(ck->AddFile(path));
  }
  std::set<std::string> names;
  for (const ImportedTensor& t : ck->tensors_) {
    if (!names.insert(t.name).second) {
      return Error(StatusCode::kDataLoss, path, ": tensor ", Quote(t.name), " appears twice");
    }
  }
  std::set<std::string> modules;
  for (const ScalingState& s : ck->scaling_) {
    if (!modules.insert(s.module).second) {
      return Error(StatusCode::kDataLoss, path, ": extra state of module ", Quote(s.module),
                   " appears twice");
    }
  }
  return ck;
}

Status TorchCheckpoint::AddFile(const std::string& file) {
  FERRY_ASSIGN_OR_RETURN(std::shared_ptr<Mapping> m, Mapping::Map(file));
  mappings_.push_back(m);
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
  ImportedTensor it;
  it.name = name;
  it.dtype = *t.dtype.dtype;
  it.shape = t.shape;
  if (t.dtype.packed_x2) {
    if (it.shape.empty()) it.shape.push_back(1);
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

Status TorchCheckpoint::Walk(const Value* v, const std::string& name, int depth,
                             const Mapping* mapping, const std::string& file) {
  if (depth > kMaxWalkDepth) {
    return Error(StatusCode::kDataLoss, file, ": entry ", Quote(name), " nests deeper than ",
                 kMaxWalkDepth, " levels (or refers to itself)");
  }
  auto child = [&](const std::string& part) { return name.empty() ? part : name + "." + part; };
  if (EndsWith(name, "_extra_state") &&
      (name == "_extra_state" || EndsWith(name, "._extra_state"))) {
    std::string module = name.size() > 13 ? name.substr(0, name.size() - 13) : "";
    FERRY_ASSIGN_OR_RETURN(ScalingState s,
                           DecodeExtraState(heap_.get(), v, module, mapping,
                                            StrCat(file, ": ", Quote(name)), &metadata_));
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
          skipped_.push_back(StrCat(file, ": ", name.empty() ? "top level" : Quote(name),
                                    ": an entry keyed by a ", KindName(k)));
          continue;
        }
        FERRY_RETURN_IF_ERROR(Walk(x, child(part), depth + 1, mapping, file));
      }
      return Status::Ok();
    case Kind::kList:
    case Kind::kTuple: {
      bool plain = true;
      for (const Value* x : v->items) plain &= ScalarText(x).has_value();
      if (plain) {
        std::string text = "[";
        for (size_t i = 0; i < v->items.size(); ++i) {
          text += (i ? ", " : "") + *ScalarText(v->items[i]);
        }
        metadata_.emplace_back(name, text + "]");
        return Status::Ok();
      }
      for (size_t i = 0; i < v->items.size(); ++i) {
        FERRY_RETURN_IF_ERROR(
            Walk(v->items[i], child(std::to_string(i)), depth + 1, mapping, file));
      }
      return Status::Ok();
    }
    default:
      if (auto text = ScalarText(v)) {
        metadata_.emplace_back(name, *text);
      } else {
        skipped_.push_back(StrCat(file, ": ", Quote(name), ": a ", KindName(v)));
      }
      return Status::Ok();
  }
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

Status TorchCheckpoint::AddDcp(const std::string& dir) {
  const std::string meta_path = (fs::path(dir) / ".metadata").string();
  FERRY_ASSIGN_OR_RETURN(std::shared_ptr<Mapping> mm, Mapping::Map(meta_path));
  mappings_.push_back(mm);
  UnpickleOptions o;
  o.where = meta_path;
  FERRY_ASSIGN_OR_RETURN(const Value* meta,
                         GuardedCopy(heap_.get(), mm->data(), mm->size(), mm.get(), meta_path));
  FERRY_ASSIGN_OR_RETURN(
      Value * root,
      Unpickle(heap_.get(), reinterpret_cast<const uint8_t*>(meta->s.data()), meta->s.size(), o));
  auto bad = [&](const auto&... args) {
    return Error(StatusCode::kDataLoss, meta_path, ": ", args...);
  };
  if (!root->is(Kind::kObject) || root->ShortClass() != "Metadata") {
    return bad("holds a ", KindName(root), ", not DCP Metadata");
  }
  const Value* sdm = Field(root, "state_dict_metadata");
  const Value* sd = Field(root, "storage_data");
  if (sdm == nullptr || !sdm->is(Kind::kDict) || sd == nullptr || !sd->is(Kind::kDict)) {
    return bad("Metadata without state_dict_metadata and storage_data dicts");
  }
  // (fqn, chunk offsets) -> storage info.
  std::map<std::pair<std::string, std::vector<int64_t>>, const Value*> infos;
  for (const auto& [k, info] : sd->dict) {
    const Value* fqn = Field(k, "fqn");
    const Value* off = Field(k, "offset");
    if (fqn == nullptr || !fqn->is_str()) return bad("storage_data key without an fqn");
    std::vector<int64_t> offsets;
    if (off != nullptr && !off->is(Kind::kNone)) {
      for (const Value* x : off->items) {
        if (!x->is(Kind::kInt)) return bad("storage_data offset is not integers");
        offsets.push_back(x->i);
      }
    }
    infos[{fqn->s, offsets}] = info;
  }
  std::map<std::string, std::shared_ptr<Mapping>> files;
  // One item of a data file: a torch.save archive at (relative_path, offset, length).
  using Item = std::tuple<Value*, const Mapping*, std::string>;
  auto load_item = [&](const std::string& fqn, const Value* info) -> Result<Item> {
    const Value* rel = Field(info, "relative_path");
    const Value* off = Field(info, "offset");
    const Value* len = Field(info, "length");
    const Value* tds = Field(info, "transform_descriptors");
    if (rel == nullptr || !rel->is_str() || off == nullptr || !off->is(Kind::kInt) ||
        len == nullptr || !len->is(Kind::kInt) || off->i < 0 || len->i < 0) {
      return bad("tensor ", Quote(fqn), ": bad storage info");
    }
    if (tds != nullptr && !tds->is(Kind::kNone) && !tds->items.empty()) {
      return Error(StatusCode::kUnimplemented, meta_path, ": tensor ", Quote(fqn),
                   " is stored through transforms (compression or encryption)");
    }
    if (rel->s.empty() || rel->s.find('/') != std::string::npos || rel->s[0] == '.') {
      return bad("tensor ", Quote(fqn), ": data file ", Quote(rel->s),
                 " is not a plain name in the folder");
    }
    std::shared_ptr<Mapping>& m = files[rel->s];
    const std::string data_path = (fs::path(dir) / rel->s).string();
    if (!m) {
      FERRY_ASSIGN_OR_RETURN(m, Mapping::Map(data_path));
      mappings_.push_back(m);
    }
    uint64_t o64 = static_cast<uint64_t>(off->i), l64 = static_cast<uint64_t>(len->i);
    if (o64 > m->size() || l64 > m->size() - o64) {
      return Error(StatusCode::kDataLoss, data_path, ": tensor ", Quote(fqn), " at offset ", o64,
                   " (", l64, " bytes) lies outside the file's ", m->size(), " bytes");
    }
    const std::string where = StrCat(data_path, " at offset ", o64);
    FERRY_ASSIGN_OR_RETURN(Value * v,
                           LoadTorchZip(heap_.get(), m->data() + o64, l64, where, m.get()));
    return Item{v, m.get(), data_path};
  };
  for (const auto& [key, md] : sdm->dict) {
    if (!key->is_str()) return bad("state_dict_metadata key is not a string");
    const std::string& fqn = key->s;
    if (md->is(Kind::kObject) && md->ShortClass() == "BytesStorageMetadata") {
      skipped_.push_back(StrCat(dir, ": ", Quote(fqn), ": a pickled object (BytesIO item)"));
      continue;
    }
    const Value* chunks = Field(md, "chunks");
    const Value* size = Field(md, "size");
    if (chunks == nullptr || !chunks->is(Kind::kList) || size == nullptr ||
        !size->is(Kind::kTuple)) {
      return bad("tensor ", Quote(fqn), ": no chunks or size");
    }
    std::vector<int64_t> global;
    for (const Value* x : size->items) {
      if (!x->is(Kind::kInt) || x->i < 0) return bad("tensor ", Quote(fqn), ": bad size");
      global.push_back(x->i);
    }
    if (chunks->items.empty() || chunks->items.size() > kMaxChunks) {
      return bad("tensor ", Quote(fqn), ": ", chunks->items.size(), " chunks");
    }
    ImportedTensor whole;
    std::vector<std::vector<int64_t>> boxes_off, boxes_size;
    uint64_t covered = 0;
    for (size_t c = 0; c < chunks->items.size(); ++c) {
      const Value* chunk = chunks->items[c];
      std::vector<int64_t> offsets, sizes;
      for (auto [field, out] : {std::pair{"offsets", &offsets}, std::pair{"sizes", &sizes}}) {
        const Value* f = Field(chunk, field);
        if (f == nullptr || !f->is(Kind::kTuple)) return bad("tensor ", Quote(fqn), ": bad chunk");
        for (const Value* x : f->items) {
          if (!x->is(Kind::kInt) || x->i < 0) return bad("tensor ", Quote(fqn), ": bad chunk");
          out->push_back(x->i);
        }
      }
      if (offsets.size() != global.size() || sizes.size() != global.size()) {
        return bad("tensor ", Quote(fqn), ": chunk ", c, " has the wrong rank");
      }
      uint64_t numel = 1;
      for (size_t d = 0; d < global.size(); ++d) {
        if (offsets[d] > global[d] || sizes[d] > global[d] - offsets[d]) {
          return bad("tensor ", Quote(fqn), ": chunk ", c, " lies outside the tensor");
        }
        numel *= static_cast<uint64_t>(sizes[d]);
      }
      for (size_t o = 0; o < boxes_off.size(); ++o) {
        bool overlap = numel > 0;
        for (size_t d = 0; d < global.size() && overlap; ++d) {
          overlap = offsets[d] < boxes_off[o][d] + boxes_size[o][d] &&
                    boxes_off[o][d] < offsets[d] + sizes[d];
        }
        if (overlap) return bad("tensor ", Quote(fqn), ": chunks ", o, " and ", c, " overlap");
      }
      covered += numel;
      boxes_off.push_back(offsets);
      boxes_size.push_back(sizes);
      auto it = infos.find({fqn, offsets});
      if (it == infos.end()) {
        return bad("tensor ", Quote(fqn), ": no storage_data entry for chunk ", c);
      }
      FERRY_ASSIGN_OR_RETURN(auto loaded, load_item(fqn, it->second));
      auto [v, m, data_path] = loaded;
      if (!v->is(Kind::kTensor) || v->tensor->shape != sizes) {
        return Error(StatusCode::kDataLoss, data_path, ": tensor ", Quote(fqn), " chunk ", c,
                     " is not a tensor of the chunk's shape");
      }
      if (EndsWith(fqn, "_extra_state")) {
        if (chunks->items.size() != 1) return bad("extra state ", Quote(fqn), " in chunks");
        FERRY_RETURN_IF_ERROR(Walk(v, fqn, 0, m, data_path));
        break;
      }
      if (c == 0) {
        FERRY_RETURN_IF_ERROR(AddTensor(fqn, v, m, data_path));
        whole = tensors_.back();
        tensors_.pop_back();
      } else if (v->tensor->dtype.name != whole.ref->dtype.name) {
        return Error(StatusCode::kDataLoss, data_path, ": tensor ", Quote(fqn), " chunk ", c,
                     " has another dtype than chunk 0");
      }
      whole.pieces.push_back(TensorPiece{v->tensor, m, offsets});
    }
    if (EndsWith(fqn, "_extra_state")) continue;
    uint64_t total = 1;
    for (int64_t g : global) total *= static_cast<uint64_t>(g);
    if (covered != total) {
      return bad("tensor ", Quote(fqn), ": its chunks cover ", covered, " of its ", total,
                 " elements");
    }
    whole.torch_shape = global;
    whole.shape = global;
    if (whole.ref->dtype.packed_x2) {
      if (whole.shape.empty()) whole.shape.push_back(1);
      whole.shape.back() *= 2;
    }
    whole.nbytes = total * static_cast<uint64_t>(whole.ref->dtype.itemsize);
    if (whole.pieces.size() == 1 || global.empty()) {
      whole.pieces.clear();  // one chunk is the tensor: read it directly
    }
    tensors_.push_back(std::move(whole));
  }
  return Status::Ok();
}

}  // namespace ferry::torch_import
