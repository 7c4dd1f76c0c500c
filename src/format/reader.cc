// Host reader: trailer, footer verification, semantic validation, lookups and host reads.
#include <algorithm>
#include <atomic>
#include <cstring>
#include <functional>
#include <mutex>
#include <optional>
#include <vector>

#include "base/util.hpp"
#include "base/worker_pool.hpp"
#include "codec/codec.hpp"
#include "codec/planes.hpp"
#include "format/block_source.hpp"
#include "format/footer.hpp"
#include "format/format.hpp"
#include "format/recipe_table.hpp"
#include "format/safetensors.hpp"
#include "format/sniff.hpp"
#include "io/source.hpp"

namespace ferry {

namespace {

// The FlatBuffers verifier aligns a vector's length field to 4 bytes only; a non-empty vector
// of 8-byte elements must also be 8-byte aligned, or reading it is undefined behaviour. (The
// builder does not align empty vectors, so those are accepted as they are.)
template <typename V>
bool Aligned8(const V* v) {
  return v == nullptr || v->size() == 0 || reinterpret_cast<uintptr_t>(v->Data()) % 8 == 0;
}

// "tensor #i 'name'" for messages, rendered only when a message is built: formatting it for
// every tensor up front cost more than all other validation of a 100,000-tensor index.
struct TensorWhere {
  size_t index;
  const fb::Tensor* tensor;
  friend std::ostream& operator<<(std::ostream& out, const TensorWhere& w) {
    return out << "tensor #" << w.index << " " << Quote(Sv(w.tensor->name()));
  }
};

// Validation context: accumulates the position for messages.
struct Validator {
  const std::string& path;
  uint64_t footer_offset;
  const FooterRules& rules;

  Status Fail(const std::string& what) const {
    return Error(StatusCode::kDataLoss, path, ": corrupt footer (starts at offset ", footer_offset,
                 "): ", what);
  }

  Status CheckName(std::string_view name, std::string_view prev, bool first, const char* kind,
                   size_t index) const {
    if (name.empty()) return Fail(StrCat(kind, " #", index, " has an empty name"));
    if (name.size() > format::kMaxNameBytes) {
      return Fail(StrCat(kind, " #", index, " name is ", name.size(), " bytes (limit ",
                         format::kMaxNameBytes, ")"));
    }
    if (name.find('\0') != std::string_view::npos) {
      return Fail(StrCat(kind, " #", index, " name contains a NUL byte"));
    }
    if (!first && !(prev < name)) {
      return Fail(StrCat(kind, " #", index, " ", Quote(name),
                         prev == name ? " is a duplicate" : " is out of sorted order"));
    }
    return Status::Ok();
  }

  template <typename Where>
  Result<uint64_t> CheckShape(const flatbuffers::Vector<int64_t>* shape, const Where& where) const {
    if (shape == nullptr) return uint64_t{1};
    if (!Aligned8(shape)) return Fail(StrCat(where, ": misaligned shape"));
    if (shape->size() > format::kMaxDims) {
      return Fail(StrCat(where, ": ", shape->size(), " dims (limit ", format::kMaxDims, ")"));
    }
    uint64_t numel = 1;
    for (flatbuffers::uoffset_t d = 0; d < shape->size(); ++d) {
      int64_t dim = shape->Get(d);
      if (dim < 0) return Fail(StrCat(where, ": negative dim ", d, " (", dim, ")"));
      if (MulOverflows(numel, static_cast<uint64_t>(dim), &numel)) {
        return Fail(StrCat(where, ": element count overflows 64 bits"));
      }
    }
    return numel;
  }

  Status CheckTensor(const fb::Tensor* t, size_t i, uint64_t data_end) const {
    TensorWhere where{i, t};
    auto dtype_value = static_cast<uint8_t>(t->dtype());
    if (!IsValidDType(dtype_value)) {
      return Fail(StrCat(where, ": unknown dtype ", int{dtype_value}));
    }
    FERRY_ASSIGN_OR_RETURN(uint64_t numel, CheckShape(t->shape(), where));
    if (!Aligned8(t->checksums()) || !Aligned8(t->chunks())) {
      return Fail(StrCat(where, ": misaligned checksum or chunk table"));
    }
    auto expect = StorageBytes(static_cast<DType>(dtype_value), numel);
    if (!expect) return Fail(StrCat(where, ": byte size overflows 64 bits"));
    if (t->nbytes() != *expect) {
      return Fail(StrCat(where, ": nbytes ", t->nbytes(), " but shape and dtype give ", *expect));
    }
    FERRY_RETURN_IF_ERROR(CheckExtent(t, where, data_end));
    FERRY_ASSIGN_OR_RETURN(uint64_t nblocks, CheckBlocks(t, where));
    FERRY_RETURN_IF_ERROR(CheckEncoding(t, where, nblocks));
    return CheckGlobalSlice(t, where);
  }

  // The stored bytes lie inside the data section, after the magic, aligned as the rules say.
  Status CheckExtent(const fb::Tensor* t, const TensorWhere& where, uint64_t data_end) const {
    uint64_t end;
    if (AddOverflows(t->data_offset(), t->data_size(), &end) || end > data_end) {
      return Fail(StrCat(where, ": data extent at offset ", t->data_offset(), " size ",
                         t->data_size(), " runs past the data section end ", data_end));
    }
    if (t->data_size() > 0) {
      if (t->data_offset() < format::kMagicSize) {
        return Fail(StrCat(where, ": data offset ", t->data_offset(), " overlaps the magic"));
      }
      if (rules.alignment > 1 && t->data_offset() % rules.alignment != 0) {
        return Fail(StrCat(where, ": data offset ", t->data_offset(), " is not ", rules.alignment,
                           "-byte aligned"));
      }
    }
    return Status::Ok();
  }

  // Block size within limits and one checksum per block (none where the rules want none).
  // Returns the number of blocks.
  Result<uint64_t> CheckBlocks(const fb::Tensor* t, const TensorWhere& where) const {
    const uint64_t nbytes = t->nbytes();
    uint64_t nblocks = 0;
    if (nbytes > 0) {
      uint64_t bs = t->block_size();
      if (bs < format::kMinBlockSize || bs > format::kMaxBlockSize) {
        return Fail(StrCat(where, ": block size ", bs, " outside [", format::kMinBlockSize, ", ",
                           format::kMaxBlockSize, "]"));
      }
      nblocks = nbytes / bs + (nbytes % bs != 0);
    }
    uint64_t nsums = t->checksums() ? t->checksums()->size() : 0;
    if (!rules.checksums && nsums != 0) {
      return Fail(StrCat(where, ": ", nsums, " checksums where none are expected"));
    }
    if (rules.checksums && nsums != nblocks) {
      return Fail(StrCat(where, ": ", nsums, " checksums for ", nblocks, " blocks"));
    }
    return nblocks;
  }

  // A raw tensor stores its bytes as they are; an encoded one has one chunk per block.
  Status CheckEncoding(const fb::Tensor* t, const TensorWhere& where, uint64_t nblocks) const {
    uint64_t nchunks = t->chunks() ? t->chunks()->size() : 0;
    switch (t->encoding()) {
      case fb::Encoding::RAW:
        if (t->data_size() != t->nbytes()) {
          return Fail(
              StrCat(where, ": raw data size ", t->data_size(), " != nbytes ", t->nbytes()));
        }
        if (nchunks != 0) return Fail(StrCat(where, ": raw tensor with a chunk table"));
        return Status::Ok();
      case fb::Encoding::ZSTD:
      case fb::Encoding::SHUFFLE_ZSTD:
      case fb::Encoding::PLANES: {
        if (nchunks != nblocks) {
          return Fail(StrCat(where, ": ", nchunks, " chunks for ", nblocks, " blocks"));
        }
        uint64_t prev_end = 0;
        for (uint64_t c = 0; c < nchunks; ++c) {
          FERRY_RETURN_IF_ERROR(CheckChunk(t, where, c, &prev_end));
        }
        return Status::Ok();
      }
      default:
        return Fail(StrCat(where, ": unknown encoding ", static_cast<int>(t->encoding())));
    }
  }

  // Chunk c of an encoded tensor: after its predecessor (which ended at *prev_end), inside
  // the tensor's stored bytes, and of a size its codec can produce for its block.
  Status CheckChunk(const fb::Tensor* t, const TensorWhere& where, uint64_t c,
                    uint64_t* prev_end) const {
    const bool planes_tensor = t->encoding() == fb::Encoding::PLANES;
    const fb::Chunk* ch = t->chunks()->Get(static_cast<flatbuffers::uoffset_t>(c));
    uint64_t raw = std::min(t->block_size(), t->nbytes() - c * t->block_size());
    uint64_t cend;
    if (ch->offset() < *prev_end || AddOverflows(ch->offset(), ch->stored_size(), &cend) ||
        cend > t->data_size()) {
      return Fail(StrCat(where, ": chunk ", c, " at relative offset ", ch->offset(), " size ",
                         ch->stored_size(), " overlaps its predecessor or runs past the tensor's ",
                         t->data_size(), " stored bytes"));
    }
    *prev_end = cend;
    if (ch->codec() == fb::ChunkCodec::STORED) {
      if (ch->stored_size() != raw) {
        return Fail(StrCat(where, ": stored chunk ", c, " holds ", ch->stored_size(),
                           " bytes for a ", raw, "-byte block"));
      }
    } else if (planes_tensor || ch->codec() == fb::ChunkCodec::PLANES) {
      // PLANES chunks belong to PLANES tensors, which hold nothing else but STORED.
      if (!planes_tensor || ch->codec() != fb::ChunkCodec::PLANES ||
          ch->stored_size() < planes::kHeaderSize || ch->stored_size() > planes::Bound(raw)) {
        return Fail(StrCat(where, ": chunk ", c, " (codec ", static_cast<int>(ch->codec()), ", ",
                           ch->stored_size(), " bytes) impossible in a ",
                           EncodingName(static_cast<Encoding>(t->encoding())), " tensor's ", raw,
                           "-byte block"));
      }
    } else if (ch->codec() == fb::ChunkCodec::ZSTD) {
      if (ch->stored_size() == 0 || ch->stored_size() > CompressBound(raw)) {
        return Fail(StrCat(where, ": zstd chunk ", c, " size ", ch->stored_size(),
                           " impossible for a ", raw, "-byte block"));
      }
    } else {
      return Fail(
          StrCat(where, ": chunk ", c, " has unknown codec ", static_cast<int>(ch->codec())));
    }
    return Status::Ok();
  }

  // Tensor-parallel slice fields: both or neither, one entry per dim, and the slice inside the
  // global extent. Ordinary tensors pay two null tests.
  Status CheckGlobalSlice(const fb::Tensor* t, const TensorWhere& where) const {
    const flatbuffers::Vector<int64_t>* global = t->global_shape();
    const flatbuffers::Vector<int64_t>* offset = t->shard_offset();
    if (global == nullptr && offset == nullptr) return Status::Ok();
    if (global == nullptr || offset == nullptr) {
      return Fail(StrCat(where, ": has ", global ? "global_shape" : "shard_offset", " without ",
                         global ? "shard_offset" : "global_shape"));
    }
    FERRY_RETURN_IF_ERROR(CheckShape(global, where).status());
    // Read in place as 8-byte values; the FlatBuffers verifier guarantees 4-byte alignment only.
    if (offset->size() != 0 && reinterpret_cast<uintptr_t>(offset->Data()) % 8 != 0) {
      return Fail(StrCat(where, ": misaligned shard_offset"));
    }
    size_t ndim = t->shape() ? t->shape()->size() : 0;
    if (global->size() != ndim || offset->size() != ndim) {
      return Fail(StrCat(where, ": ", ndim, " dims, but global_shape has ", global->size(),
                         " and shard_offset ", offset->size()));
    }
    for (flatbuffers::uoffset_t d = 0; d < ndim; ++d) {
      int64_t off = offset->Get(d), dim = t->shape()->Get(d), total = global->Get(d);
      // dim and total are >= 0 here (CheckShape), so total - dim cannot overflow.
      if (off < 0 || off > total - dim) {
        return Fail(StrCat(where, ": slice dim ", d, " at offset ", off, " of extent ", dim,
                           " does not fit the global extent ", total));
      }
    }
    return Status::Ok();
  }
};

template <typename T>
size_t Count(const flatbuffers::Vector<flatbuffers::Offset<T>>* v) {
  return v == nullptr ? 0 : v->size();
}

Status CheckRecipe(const Validator& v, const fb::ScalingState* s, const std::string& where) {
  const std::string why = format::CheckRecipeTable(s);
  return why.empty() ? Status::Ok() : v.Fail(StrCat(where, ": ", why));
}

Status CheckScaling(const Validator& v, const fb::Checkpoint* ck) {
  auto* states = ck->scaling();
  std::string_view prev;
  for (size_t i = 0; i < Count(states); ++i) {
    auto* s = states->Get(static_cast<flatbuffers::uoffset_t>(i));
    std::string_view module = Sv(s->module_());
    FERRY_RETURN_IF_ERROR(v.CheckName(module, prev, i == 0, "scaling state", i));
    prev = module;
    std::string where = StrCat("scaling state ", Quote(module));
    FERRY_RETURN_IF_ERROR(CheckRecipe(v, s, where));
    for (size_t d = 0; d < Count(s->states()); ++d) {
      auto* ds = s->states()->Get(static_cast<flatbuffers::uoffset_t>(d));
      std::string dwhere = StrCat(where, " direction #", d);
      if (static_cast<uint8_t>(ds->direction()) > 1) return v.Fail(dwhere + ": bad direction");
      uint64_t slots = ds->slot_roles() ? ds->slot_roles()->size() : 0;
      if (ds->slot_roles()) {
        for (auto role : *ds->slot_roles()) {
          if (static_cast<uint8_t>(role) > 4) return v.Fail(dwhere + ": unknown slot role");
        }
      }
      uint64_t nscale = ds->scale() ? ds->scale()->size() : 0;
      if (nscale != slots) {
        return v.Fail(StrCat(dwhere, ": ", nscale, " scales for ", slots, " slots"));
      }
      if (ds->history_len() < 0) return v.Fail(dwhere + ": negative history length");
      uint64_t expect;
      if (MulOverflows(static_cast<uint64_t>(ds->history_len()), slots, &expect)) {
        return v.Fail(dwhere + ": history size overflows");
      }
      uint64_t nhist = ds->amax_history() ? ds->amax_history()->size() : 0;
      if (nhist != expect) {
        return v.Fail(StrCat(dwhere, ": amax_history has ", nhist, " entries, expected ",
                             ds->history_len(), " x ", slots));
      }
    }
  }
  return Status::Ok();
}

Status CheckQuantized(const Validator& v, const fb::Checkpoint* ck) {
  auto* qs = ck->quantized();
  std::string_view prev;
  auto tensor_exists = [&](const flatbuffers::String* name) {
    return FindSorted(ck->tensors(), Sv(name), [](const fb::Tensor* t) { return t->name(); }) >= 0;
  };
  for (size_t i = 0; i < Count(qs); ++i) {
    auto* q = qs->Get(static_cast<flatbuffers::uoffset_t>(i));
    std::string_view name = Sv(q->name());
    FERRY_RETURN_IF_ERROR(v.CheckName(name, prev, i == 0, "quantized tensor", i));
    prev = name;
    std::string where = StrCat("quantized tensor ", Quote(name));
    if (!IsValidDType(static_cast<uint8_t>(q->quantized_dtype())) ||
        !IsValidDType(static_cast<uint8_t>(q->logical_dtype()))) {
      return v.Fail(where + ": unknown dtype");
    }
    if (static_cast<uint8_t>(q->scaling_mode()) > 4) return v.Fail(where + ": bad scaling mode");
    FERRY_RETURN_IF_ERROR(v.CheckShape(q->shape(), where).status());
    for (const fb::QuantizedComponent* c : {q->rowwise(), q->columnwise()}) {
      if (c == nullptr) continue;
      if (static_cast<uint8_t>(c->scale_layout()) > 1) return v.Fail(where + ": bad layout");
      for (const flatbuffers::String* ref : {c->data(), c->scale_inv(), c->amax()}) {
        if (ref == nullptr || (ref != c->data() && ref->size() == 0)) continue;
        if (!tensor_exists(ref)) {
          return v.Fail(StrCat(where, ": component tensor ", Quote(Sv(ref)), " is missing"));
        }
      }
    }
  }
  return Status::Ok();
}

}  // namespace

Result<FooterLocation> ReadTrailer(const uint8_t* file, uint64_t file_size,
                                   const std::string& path) {
  const uint8_t* trailer =
      file_size >= format::kTrailerSize ? file + file_size - format::kTrailerSize : nullptr;
  return ParseTrailer(file, file_size, trailer, file_size, path);
}

Result<FooterLocation> ParseTrailer(const uint8_t* head, uint64_t head_size, const uint8_t* trailer,
                                    uint64_t file_size, const std::string& path) {
  const uint64_t min_size = format::kMagicSize + format::kTrailerSize;
  const uint64_t seen = std::min({head_size, file_size, uint64_t{format::kMagicSize}});
  // An empty file has no head to compare (and memcmp must not see a null pointer).
  const bool magic = seen == 0 || std::memcmp(head, format::kMagic, seen) == 0;  // or a cut
  // Shorter than any checkpoint: too little to tell a kind by, and "too short" says enough.
  if (!magic && file_size >= min_size) {
    if (auto foreign = ForeignFileError(head, std::min(head_size, file_size), path)) {
      return *foreign;
    }
  }
  if (file_size < min_size) {
    return Error(StatusCode::kDataLoss, path, ": file is ", file_size,
                 " bytes, too short for a TensorFerry checkpoint (at least ", min_size, ")");
  }
  if (!magic || head_size < format::kMagicSize) {
    return Error(StatusCode::kDataLoss, path,
                 ": not a TensorFerry checkpoint (bad magic at offset 0)");
  }
  uint64_t trailer_offset = file_size - format::kTrailerSize;
  if (std::memcmp(trailer + 16, format::kMagic, format::kMagicSize) != 0) {
    return Error(StatusCode::kDataLoss, path, ": bad trailer magic at offset ", trailer_offset + 16,
                 " (file truncated or not a TensorFerry checkpoint)");
  }
  uint64_t footer_size = LoadU64(trailer);
  uint64_t footer_sum = LoadU64(trailer + 8);
  if (footer_size == 0 || footer_size > format::kMaxFooterBytes ||
      footer_size > trailer_offset - format::kMagicSize) {
    return Error(StatusCode::kDataLoss, path, ": footer length ", footer_size,
                 " (trailer at offset ", trailer_offset, ") does not fit the file");
  }
  return FooterLocation{trailer_offset - footer_size, footer_size, footer_sum};
}

Status CheckFooterSum(const uint8_t* footer, const FooterLocation& loc, const std::string& path) {
  if (Checksum64(footer, loc.size) != loc.checksum) {
    return Error(StatusCode::kDataLoss, path, ": footer checksum mismatch (footer at offset ",
                 loc.offset, ", ", loc.size, " bytes)");
  }
  return Status::Ok();
}

Result<FooterLocation> LocateFooter(const uint8_t* file, uint64_t file_size,
                                    const std::string& path) {
  FERRY_ASSIGN_OR_RETURN(FooterLocation loc, ReadTrailer(file, file_size, path));
  FERRY_RETURN_IF_ERROR(CheckFooterSum(file + loc.offset, loc, path));
  return loc;
}

namespace {

// The verifier's limits for a footer of `size` bytes.
flatbuffers::Verifier::Options VerifierOptions(uint64_t size) {
  flatbuffers::Verifier::Options opts;
  opts.max_depth = format::kMaxVerifierDepth;
  // Every table takes at least 8 bytes, so this bounds work by the footer's own size.
  opts.max_tables = static_cast<flatbuffers::uoffset_t>(size / 8 + 16);
  opts.check_alignment = true;
  return opts;
}

// The root table, verified structurally except for the tensor tables (CheckTensorTables
// verifies those in parallel slices: 100,000 tensors take ~10 ms on one core), then its
// version, checksum algorithm and tensor count. This mirrors the generated
// Checkpoint::Verify; keep the two in step when fields are added.
Result<const fb::Checkpoint*> VerifyRoot(const Validator& v, const uint8_t* footer, uint64_t size) {
  if (size < 8 || size > format::kMaxFooterBytes) return v.Fail(StrCat("size ", size));
  if (reinterpret_cast<uintptr_t>(footer) % 8 != 0) {
    return Error(StatusCode::kInternal, v.path, ": footer buffer is not 8-byte aligned");
  }
  if (!fb::CheckpointBufferHasIdentifier(footer)) return v.Fail("missing identifier TFRY");
  flatbuffers::Verifier verifier(footer, static_cast<size_t>(size), VerifierOptions(size));
  const fb::Checkpoint* ck = fb::GetCheckpoint(footer);
  // Checkpoint derives privately from Table; the generated Verify calls these on itself.
  const auto* table = reinterpret_cast<const flatbuffers::Table*>(ck);
  if (!verifier.VerifyTableStart(reinterpret_cast<const uint8_t*>(ck)) ||
      !table->VerifyField<uint32_t>(verifier, fb::Checkpoint::VT_FORMAT_VERSION, 4) ||
      !table->VerifyOffset(verifier, fb::Checkpoint::VT_PRODUCER) ||
      !verifier.VerifyString(ck->producer()) ||
      !table->VerifyField<uint8_t>(verifier, fb::Checkpoint::VT_CHECKSUM_ALGO, 1) ||
      !table->VerifyOffset(verifier, fb::Checkpoint::VT_TENSORS) ||
      !verifier.VerifyVector(ck->tensors()) ||
      !table->VerifyOffset(verifier, fb::Checkpoint::VT_QUANTIZED) ||
      !verifier.VerifyVector(ck->quantized()) || !verifier.VerifyVectorOfTables(ck->quantized()) ||
      !table->VerifyOffset(verifier, fb::Checkpoint::VT_SCALING) ||
      !verifier.VerifyVector(ck->scaling()) || !verifier.VerifyVectorOfTables(ck->scaling()) ||
      !table->VerifyOffset(verifier, fb::Checkpoint::VT_METADATA) ||
      !verifier.VerifyVector(ck->metadata()) || !verifier.VerifyVectorOfTables(ck->metadata()) ||
      !table->VerifyOffset(verifier, fb::Checkpoint::VT_DATA_ORDER) ||
      !verifier.VerifyVector(ck->data_order()) || !verifier.EndTable()) {
    return v.Fail("FlatBuffers verification failed");
  }
  if (ck->format_version() != kFormatVersion) {
    return Error(StatusCode::kUnimplemented, v.path, ": format version ", ck->format_version(),
                 " (this build reads version ", kFormatVersion, ")");
  }
  if (ck->checksum_algo() != fb::ChecksumAlgo::XXH3_64) {
    return v.Fail(StrCat("unknown checksum algorithm ", static_cast<int>(ck->checksum_algo())));
  }
  const size_t n = Count(ck->tensors());
  if (n > format::kMaxTensors) {
    return v.Fail(StrCat(n, " tensors (limit ", format::kMaxTensors, ")"));
  }
  return ck;
}

// What the tensor tables hold, gathered while each is checked.
struct TensorScan {
  // Each tensor's extent, by index: the overlap check then walks this compact array in file
  // order instead of chasing tables across the footer.
  std::vector<std::pair<uint64_t, uint64_t>> extents;
  uint64_t nonempty = 0;  // tensors with stored bytes
  bool monotonic = true;  // extents in index order never go backwards
};

// Runs fn(k) for k in [0, slices), each but the first on its own thread (on this one when no
// thread can be had: slower, but the same).
void RunSlices(size_t slices, const std::function<void(size_t)>& fn) {
  RunParts(static_cast<int>(slices), [&](int k) { fn(static_cast<size_t>(k)); });
}

// Every tensor table verified structurally and then checked semantically while it is in
// cache, in one pass, in slices of the list on parallel threads. A slice's first name is
// compared with its predecessor's (another slice's table) after the join, once every table
// is known to be well formed.
Result<TensorScan> CheckTensorTables(const Validator& v, const fb::Checkpoint* ck,
                                     const uint8_t* footer, uint64_t size, uint64_t data_end) {
  auto* tensors = ck->tensors();
  const size_t n = Count(tensors);
  const size_t slices = std::clamp<size_t>(std::min<size_t>(n / 16384, DefaultThreads(8)), 1, 8);
  struct SliceResult {
    Status status;
    uint64_t nonempty = 0;
    bool monotonic = true;
  };
  std::vector<SliceResult> results(slices);
  TensorScan scan;
  scan.extents.resize(n);
  auto slice_begin = [&](size_t k) { return n * k / slices; };
  const flatbuffers::Verifier::Options opts = VerifierOptions(size);
  RunSlices(slices, [&](size_t k) {
    SliceResult& r = results[k];
    flatbuffers::Verifier tv(footer, static_cast<size_t>(size), opts);
    uint64_t last_end = 0;
    std::string_view prev;
    for (size_t i = slice_begin(k); i < slice_begin(k + 1); ++i) {
      const fb::Tensor* t = tensors->Get(static_cast<flatbuffers::uoffset_t>(i));
      if (!t->Verify(tv)) {
        r.status = v.Fail(StrCat("FlatBuffers verification failed at tensor #", i));
        return;
      }
      std::string_view name = Sv(t->name());
      r.status = v.CheckName(name, prev, i == slice_begin(k), "tensor", i);
      if (r.status.ok()) r.status = v.CheckTensor(t, i, data_end);
      if (!r.status.ok()) return;
      prev = name;
      scan.extents[i] = {t->data_offset(), t->data_offset() + t->data_size()};
      if (t->data_size() == 0) continue;
      ++r.nonempty;
      if (t->data_offset() < last_end) r.monotonic = false;
      last_end = t->data_offset() + t->data_size();
    }
  });
  for (const SliceResult& r : results) {
    if (!r.status.ok()) return r.status;
  }
  for (size_t k = 1; k < slices; ++k) {
    size_t i = slice_begin(k);
    if (i == 0 || i >= n) continue;
    auto name_at = [&](size_t j) {
      return Sv(tensors->Get(static_cast<flatbuffers::uoffset_t>(j))->name());
    };
    FERRY_RETURN_IF_ERROR(v.CheckName(name_at(i), name_at(i - 1), false, "tensor", i));
  }
  for (const SliceResult& r : results) {
    scan.nonempty += r.nonempty;
    scan.monotonic = scan.monotonic && r.monotonic;
  }
  return scan;
}

// No two extents may overlap. data_order lists the non-empty tensors in file order, which
// makes this one linear pass; files without it (or with a wrong one) are sorted instead.
Status CheckDisjoint(const Validator& v, const fb::Checkpoint* ck, const TensorScan& scan) {
  const auto& ext = scan.extents;
  const size_t n = ext.size();
  auto* order = ck->data_order();
  if (order != nullptr && order->size() > 0) {
    if (order->size() != scan.nonempty) {
      return v.Fail(StrCat("data_order has ", order->size(), " entries for ", scan.nonempty,
                           " tensors with data"));
    }
    uint64_t prev_end = 0;
    for (uint32_t idx : *order) {
      if (idx >= n) return v.Fail(StrCat("data_order names tensor #", idx, " of ", n));
      if (ext[idx].first == ext[idx].second) {
        return v.Fail(StrCat("data_order names tensor #", idx, ", which has no data"));
      }
      if (ext[idx].first < prev_end) {
        return v.Fail(StrCat("tensor data extents overlap (or data_order is unsorted) at offset ",
                             ext[idx].first));
      }
      prev_end = ext[idx].second;
    }
    return Status::Ok();
  }
  bool monotonic = scan.monotonic;
  std::vector<std::pair<uint64_t, uint64_t>> extents;
  extents.reserve(scan.nonempty);
  for (const auto& e : ext) {
    if (e.first != e.second) extents.push_back(e);
  }
  // Slices were each in order; the whole list is in order only if slice ends line up too.
  for (size_t i = 1; monotonic && i < extents.size(); ++i) {
    if (extents[i].first < extents[i - 1].second) monotonic = false;
  }
  if (!monotonic) {
    std::sort(extents.begin(), extents.end());
    for (size_t i = 1; i < extents.size(); ++i) {
      if (extents[i].first < extents[i - 1].second) {
        return v.Fail(StrCat("tensor data extents overlap at offset ", extents[i].first));
      }
    }
  }
  return Status::Ok();
}

Status CheckMetadata(const Validator& v, const fb::Checkpoint* ck) {
  auto* md = ck->metadata();
  std::string_view prev;
  for (size_t i = 0; i < Count(md); ++i) {
    std::string_view key = Sv(md->Get(static_cast<flatbuffers::uoffset_t>(i))->key());
    FERRY_RETURN_IF_ERROR(v.CheckName(key, prev, i == 0, "metadata key", i));
    prev = key;
  }
  return Status::Ok();
}

}  // namespace

Result<const fb::Checkpoint*> ParseFooter(const uint8_t* footer, uint64_t size, uint64_t data_end,
                                          const std::string& path, const FooterRules& rules) {
  Validator v{path, data_end, rules};
  FERRY_ASSIGN_OR_RETURN(const fb::Checkpoint* ck, VerifyRoot(v, footer, size));
  FERRY_ASSIGN_OR_RETURN(TensorScan scan, CheckTensorTables(v, ck, footer, size, data_end));
  FERRY_RETURN_IF_ERROR(CheckDisjoint(v, ck, scan));
  FERRY_RETURN_IF_ERROR(CheckQuantized(v, ck));
  FERRY_RETURN_IF_ERROR(CheckScaling(v, ck));
  FERRY_RETURN_IF_ERROR(CheckMetadata(v, ck));
  return ck;
}

// ---- Reader ---------------------------------------------------------------------------

Reader::Reader(std::unique_ptr<BlockSource> blocks) : blocks_(std::move(blocks)) {}
Reader::~Reader() = default;

const BlockSource& BlocksOf(const Reader& reader) { return *reader.blocks_; }

const std::string& Reader::path() const { return blocks_->path(); }
uint64_t Reader::file_size() const { return blocks_->bytes().size(); }
uint32_t Reader::format_version() const { return blocks_->index()->format_version(); }
std::string Reader::producer() const { return std::string(Sv(blocks_->index()->producer())); }
size_t Reader::num_tensors() const { return blocks_->size(); }
TensorInfo Reader::tensor(size_t i) const { return blocks_->Info(i); }

Result<TensorInfo> Reader::Find(std::string_view name) const {
  FERRY_ASSIGN_OR_RETURN(size_t i, blocks_->Lookup(name));
  return blocks_->Info(i);
}

std::vector<std::string> Reader::names() const {
  std::vector<std::string> out;
  out.reserve(blocks_->size());
  for (size_t i = 0; i < blocks_->size(); ++i) out.emplace_back(Sv(blocks_->at(i)->name()));
  return out;
}

std::vector<std::pair<std::string, std::string>> Reader::metadata() const {
  std::vector<std::pair<std::string, std::string>> out;
  auto* md = blocks_->index()->metadata();
  for (size_t i = 0; i < Count(md); ++i) {
    auto* kv = md->Get(static_cast<flatbuffers::uoffset_t>(i));
    out.emplace_back(Sv(kv->key()), Sv(kv->value()));
  }
  return out;
}

std::optional<std::string> Reader::metadata(std::string_view key) const {
  auto* md = blocks_->index()->metadata();
  int64_t i = FindSorted(md, key, [](const fb::KeyValue* kv) { return kv->key(); });
  if (i < 0) return std::nullopt;
  return std::string(Sv(md->Get(static_cast<flatbuffers::uoffset_t>(i))->value()));
}

namespace {
template <typename T>
std::vector<T> Copy(const flatbuffers::Vector<T>* v) {
  return v == nullptr ? std::vector<T>() : std::vector<T>(v->begin(), v->end());
}

std::optional<QuantizedComponent> ToComponent(const fb::QuantizedComponent* c) {
  if (c == nullptr) return std::nullopt;
  QuantizedComponent out;
  out.data = std::string(Sv(c->data()));
  out.scale_inv = std::string(Sv(c->scale_inv()));
  out.scale_layout = static_cast<ScaleLayout>(c->scale_layout());
  out.amax = std::string(Sv(c->amax()));
  return out;
}

}  // namespace

std::vector<QuantizedTensor> Reader::quantized() const {
  std::vector<QuantizedTensor> out;
  auto* qs = blocks_->index()->quantized();
  for (size_t i = 0; i < Count(qs); ++i) {
    auto* q = qs->Get(static_cast<flatbuffers::uoffset_t>(i));
    QuantizedTensor t;
    t.name = std::string(Sv(q->name()));
    t.quantized_dtype = static_cast<DType>(q->quantized_dtype());
    t.logical_dtype = static_cast<DType>(q->logical_dtype());
    t.shape = Copy(q->shape());
    t.scaling_mode = static_cast<ScalingMode>(q->scaling_mode());
    t.rowwise = ToComponent(q->rowwise());
    t.columnwise = ToComponent(q->columnwise());
    out.push_back(std::move(t));
  }
  return out;
}

std::vector<ScalingState> Reader::scaling_states() const {
  std::vector<ScalingState> out;
  auto* ss = blocks_->index()->scaling();
  for (size_t i = 0; i < Count(ss); ++i) {
    auto* s = ss->Get(static_cast<flatbuffers::uoffset_t>(i));
    ScalingState state;
    state.module = std::string(Sv(s->module_()));
    state.recipe = format::RecipeFromTable(s);
    for (size_t d = 0; d < Count(s->states()); ++d) {
      auto* ds = s->states()->Get(static_cast<flatbuffers::uoffset_t>(d));
      DirectionState dir;
      dir.direction = static_cast<Direction>(ds->direction());
      dir.num_gemms = ds->num_gemms();
      if (ds->slot_roles()) {
        for (auto r : *ds->slot_roles()) dir.slot_roles.push_back(static_cast<SlotRole>(r));
      }
      dir.scale = Copy(ds->scale());
      dir.amax_history = Copy(ds->amax_history());
      dir.history_len = ds->history_len();
      state.states.push_back(std::move(dir));
    }
    out.push_back(std::move(state));
  }
  return out;
}

Result<HostView> Reader::View(std::string_view name, ReadOptions options) const {
  FERRY_ASSIGN_OR_RETURN(size_t i, blocks_->Lookup(name));
  TensorInfo info = blocks_->Info(i);
  if (info.encoding != Encoding::kRaw) {
    return Error(StatusCode::kUnimplemented, blocks_->Where(i), ": is stored ",
                 EncodingName(info.encoding),
                 "; a zero-copy view needs raw encoding (use ReadInto)");
  }
  if (blocks_->mapping() == nullptr) {
    return Error(StatusCode::kUnimplemented, blocks_->Where(i),
                 ": a zero-copy view needs a mapped file, and this one is read without a "
                 "mapping (",
                 blocks_->bytes().Describe(), "; use ReadInto)");
  }
  if (options.verify) FERRY_RETURN_IF_ERROR(blocks_->VerifyRange(i, 0, info.nbytes, nullptr));
  HostView view;
  view.data = info.nbytes ? blocks_->mapping()->data() + info.data_offset : nullptr;
  view.nbytes = info.nbytes;
  view.info = std::move(info);
  view.keepalive = blocks_->mapping();
  return view;
}

namespace {
// Raw bytes [begin, begin + len) of tensor i into the caller's `dst` of `dst_size` bytes;
// `needs` words the message of a destination too small.
Status ReadChecked(const BlockSource& blocks, size_t i, uint64_t begin, uint64_t len, void* dst,
                   uint64_t dst_size, bool verify, const char* needs) {
  if (dst_size < len || (dst == nullptr && len > 0)) {
    return Error(StatusCode::kInvalidArgument, blocks.Where(i), ": ", needs, " ", len,
                 " bytes, destination holds ", dst_size);
  }
  ReadPath how;
  how.verify = verify;
  return blocks.Read(i, begin, len, static_cast<uint8_t*>(dst), how);
}
}  // namespace

Status Reader::ReadInto(std::string_view name, void* dst, uint64_t dst_size,
                        ReadOptions options) const {
  FERRY_ASSIGN_OR_RETURN(size_t i, blocks_->Lookup(name));
  return ReadChecked(*blocks_, i, 0, blocks_->RawSize(i), dst, dst_size, options.verify, "needs");
}

Status Reader::ReadRowsInto(std::string_view name, int64_t row_begin, int64_t row_end, void* dst,
                            uint64_t dst_size, ReadOptions options) const {
  FERRY_ASSIGN_OR_RETURN(size_t i, blocks_->Lookup(name));
  FERRY_ASSIGN_OR_RETURN(auto range, blocks_->RowRange(i, row_begin, row_end));
  return ReadChecked(*blocks_, i, range.first, range.second, dst, dst_size, options.verify,
                     "rows need");
}

Status Reader::Verify(std::string_view name) const {
  FERRY_ASSIGN_OR_RETURN(size_t i, blocks_->Lookup(name));
  return blocks_->VerifyTensor(i);
}

namespace {
// Below this many stored bytes a verification runs on the calling thread alone.
constexpr uint64_t kParallelVerifyBytes = uint64_t{64} << 20;
}  // namespace

Status Reader::VerifyAll() const {
  const BlockSource& b = *blocks_;
  // Every block, hashed where it lies, spread over threads: hashing is CPU work, and a file
  // of many gigabytes (load_file's views, load_model, verify_on_open) would otherwise wait
  // on one core. The error reported is the first in (tensor, block) order, as one thread
  // would find it.
  std::vector<std::pair<uint32_t, uint64_t>> units;  // (tensor, block)
  uint64_t bytes = 0;
  for (size_t i = 0; i < b.size(); ++i) {
    for (uint64_t k = 0; k < b.NumBlocks(i); ++k) units.emplace_back(static_cast<uint32_t>(i), k);
    bytes += b.Record(i).data_size;
  }
  const size_t threads = bytes < kParallelVerifyBytes
                             ? 1
                             : std::clamp<size_t>(std::thread::hardware_concurrency(), 1,
                                                  std::min<size_t>(16, units.size()));
  std::atomic<size_t> next{0}, failed_at{units.size()};
  std::mutex mu;
  Status failure;
  RunSlices(threads, [&](size_t) {
    for (size_t u; (u = next.fetch_add(1)) < units.size();) {
      if (u > failed_at.load(std::memory_order_relaxed)) return;
      Status st = b.VerifyBlock(units[u].first, units[u].second);
      if (st.ok()) continue;
      std::lock_guard<std::mutex> lock(mu);
      if (u < failed_at.load()) {
        failed_at = u;
        failure = std::move(st);
      }
    }
  });
  return failure;
}

}  // namespace ferry
