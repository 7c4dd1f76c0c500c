// Streaming writer: tensor bytes go to a temporary file as they are added; the footer and the
// atomic rename happen in Commit.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <random>
#include <set>
#include <thread>
#include <vector>

#include "codec.hpp"
#include "ferry_generated.h"
#include "format.hpp"
#include "io.hpp"
#include "planes.hpp"
#include "util.hpp"
#include "worker_pool.hpp"

namespace ferry {

namespace {

struct ChunkRecord {
  uint64_t offset;
  uint64_t stored_size;
  uint8_t codec;
};

struct TensorRecord {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  uint64_t data_offset = 0;
  uint64_t data_size = 0;
  uint64_t nbytes = 0;
  Encoding encoding = Encoding::kRaw;
  uint64_t block_size = 0;
  std::vector<uint64_t> checksums;
  std::vector<ChunkRecord> chunks;
  std::vector<int64_t> global_shape;  // both empty unless SetGlobalSlice was called
  std::vector<int64_t> shard_offset;
};

std::string TempPath(const std::string& path) {
  static std::atomic<uint64_t> counter{0};
  std::random_device rd;
  uint64_t r = (uint64_t{rd()} << 32) ^ rd() ^ counter.fetch_add(1);
  char buf[32];
  std::snprintf(buf, sizeof(buf), ".tmp.%d.%016llx", static_cast<int>(::getpid()),
                static_cast<unsigned long long>(r));
  return path + buf;
}

Status CheckKey(const std::string& path, std::string_view key, const char* kind) {
  if (key.empty()) return Error(StatusCode::kInvalidArgument, path, ": empty ", kind);
  if (key.size() > format::kMaxNameBytes) {
    return Error(StatusCode::kInvalidArgument, path, ": ", kind, " of ", key.size(),
                 " bytes (limit ", format::kMaxNameBytes, ")");
  }
  if (key.find('\0') != std::string_view::npos) {
    return Error(StatusCode::kInvalidArgument, path, ": ", kind, " ", Quote(key),
                 " contains a NUL byte");
  }
  return Status::Ok();
}

}  // namespace

class Writer::Impl {
 public:
  std::string path;
  std::string tmp_path;
  File file;
  WriterOptions options;
  uint64_t pos = 0;
  bool spent = false;
  std::vector<TensorRecord> tensors;
  std::set<std::string, std::less<>> names;
  std::map<std::string, QuantizedTensor, std::less<>> quantized;
  std::map<std::string, ScalingState, std::less<>> scaling;
  std::map<std::string, std::string, std::less<>> metadata;
  std::vector<uint8_t> block_buf;

  ~Impl() { Abort(); }

  void Abort() {
    if (spent) return;
    spent = true;
    (void)file.Close();
    if (!tmp_path.empty()) ::unlink(tmp_path.c_str());
  }

  Status CheckUsable() const {
    if (spent) {
      return Error(StatusCode::kInvalidArgument, path, ": writer already committed or aborted");
    }
    return Status::Ok();
  }

  Status Write(const void* data, size_t size) {
    Status st = file.WriteAll(data, size);
    if (!st.ok()) {
      // A failed write leaves the temporary file useless; drop it now so a full disk is
      // not made fuller, and keep the previous checkpoint at `path` untouched.
      Abort();
      return st;
    }
    pos += size;
    return Status::Ok();
  }

  Status PadTo(uint64_t alignment) {
    static const uint8_t kZeros[format::kLargeAlign] = {};
    uint64_t target = AlignUp(pos, alignment);
    while (pos < target) {
      FERRY_RETURN_IF_ERROR(Write(kZeros, std::min<uint64_t>(target - pos, sizeof(kZeros))));
    }
    return Status::Ok();
  }

  // Compression runs on a worker pool, a batch of blocks at a time; outputs are written in
  // block order, so memory stays at a few blocks per thread whatever the tensor size.
  std::unique_ptr<WorkerPool> pool;
  struct EncodedBlock {
    const uint8_t* raw = nullptr;
    size_t n = 0;
    std::vector<uint8_t> raw_copy;  // pulled sources only
    std::vector<uint8_t> shuffled;
    std::vector<uint8_t> out;
    uint64_t checksum = 0;
    bool compressed = false;
    uint8_t codec = 0;  // fb::ChunkCodec when compressed
    size_t stored = 0;
    Status status;
  };
  std::vector<EncodedBlock> encoded;

  int Threads() const {
    if (options.threads > 0) return options.threads;
    unsigned hw = std::thread::hardware_concurrency();
    return static_cast<int>(std::clamp<unsigned>(hw == 0 ? 4 : hw, 1, 16));
  }

  void EncodeBlock(EncodedBlock& blk, DType dtype, Encoding encoding) {
    blk.checksum = Checksum64(blk.raw, blk.n);
    const uint8_t* input = blk.raw;
    size_t width = ShuffleWidth(dtype);
    if (encoding == Encoding::kPlanes) {
      // Planes blocks that do not pay are stored raw and unshuffled: the loader then copies
      // them like raw data.
      blk.shuffled.resize(blk.n);
      if (blk.out.size() < planes::Bound(blk.n)) blk.out.resize(planes::Bound(blk.n));
      size_t n = planes::Encode(blk.raw, blk.n, width, blk.out.data(), blk.shuffled.data(),
                                options.min_savings);
      blk.compressed = n > 0;
      blk.codec = static_cast<uint8_t>(fb::ChunkCodec::PLANES);
      blk.stored = n > 0 ? n : blk.n;
      if (n == 0) std::memcpy(blk.out.data(), blk.raw, blk.n);
      return;
    }
    blk.codec = static_cast<uint8_t>(fb::ChunkCodec::ZSTD);
    if (encoding == Encoding::kShuffleZstd && width > 1) {
      blk.shuffled.resize(blk.n);
      Shuffle(blk.raw, blk.shuffled.data(), blk.n, width);
      input = blk.shuffled.data();
    }
    size_t bound = CompressBound(blk.n);
    if (blk.out.size() < bound) blk.out.resize(bound);
    auto csize = ZstdCompress(input, blk.n, blk.out.data(), bound, options.zstd_level);
    if (!csize.ok()) {
      blk.status = csize.status();
      return;
    }
    blk.compressed =
        static_cast<double>(*csize) <= static_cast<double>(blk.n) * (1.0 - options.min_savings);
    if (blk.compressed) {
      blk.stored = *csize;
    } else {
      // Stored chunks of a shuffled tensor hold the shuffled bytes (the reader unshuffles).
      blk.stored = blk.n;
      if (input != blk.raw) {
        std::memcpy(blk.out.data(), input, blk.n);
      } else {
        std::memcpy(blk.out.data(), blk.raw, blk.n);
      }
    }
  }

  Status AddEncoded(TensorRecord& rec, const uint8_t* host, const FillFn* fill) {
    const int threads = Threads();
    if (!pool && threads > 1) pool = std::make_unique<WorkerPool>(threads);
    const size_t batch = static_cast<size_t>(threads) * 2;
    if (encoded.size() < batch) encoded.resize(batch);
    for (uint64_t off = 0; off < rec.nbytes;) {
      size_t nb = 0;
      for (; nb < batch && off < rec.nbytes; ++nb, off += rec.block_size) {
        EncodedBlock& blk = encoded[nb];
        blk.n = static_cast<size_t>(std::min(rec.block_size, rec.nbytes - off));
        blk.status = Status::Ok();
        if (host != nullptr) {
          blk.raw = host + off;
        } else {
          blk.raw_copy.resize(blk.n);
          Status st = (*fill)(off, blk.raw_copy.data(), blk.n);
          if (!st.ok()) {
            return Error(st.code(), path, ": tensor ", Quote(rec.name), ": source failed at byte ",
                         off, ": ", st.message());
          }
          blk.raw = blk.raw_copy.data();
        }
      }
      std::atomic<size_t> next{0};
      auto work = [&](int) {
        for (size_t k; (k = next.fetch_add(1)) < nb;)
          EncodeBlock(encoded[k], rec.dtype, rec.encoding);
      };
      if (pool && nb > 1) {
        pool->Run(work);
      } else {
        work(0);
      }
      for (size_t k = 0; k < nb; ++k) {
        EncodedBlock& blk = encoded[k];
        if (!blk.status.ok()) {
          return Error(blk.status.code(), path, ": tensor ", Quote(rec.name), ": ",
                       blk.status.message());
        }
        rec.checksums.push_back(blk.checksum);
        ChunkRecord chunk{
            pos - rec.data_offset, blk.stored,
            blk.compressed ? blk.codec : static_cast<uint8_t>(fb::ChunkCodec::STORED)};
        FERRY_RETURN_IF_ERROR(Write(blk.out.data(), blk.stored));
        rec.chunks.push_back(chunk);
      }
    }
    return Status::Ok();
  }

  // `host` is the whole tensor in memory, or null to pull blocks through `fill`.
  Status Add(std::string_view name, DType dtype, const std::vector<int64_t>& shape,
             const uint8_t* host, uint64_t host_bytes, const FillFn* fill, Encoding encoding) {
    FERRY_RETURN_IF_ERROR(CheckUsable());
    FERRY_RETURN_IF_ERROR(CheckKey(path, name, "tensor name"));
    if (names.count(name)) {
      return Error(StatusCode::kInvalidArgument, path, ": duplicate tensor ", Quote(name));
    }
    if (!IsValidDType(static_cast<uint8_t>(dtype))) {
      return Error(StatusCode::kInvalidArgument, path, ": tensor ", Quote(name), ": unknown dtype ",
                   static_cast<int>(dtype));
    }
    if (static_cast<uint8_t>(encoding) > 3) {
      return Error(StatusCode::kInvalidArgument, path, ": tensor ", Quote(name),
                   ": unknown encoding ", static_cast<int>(encoding));
    }
    if (shape.size() > format::kMaxDims) {
      return Error(StatusCode::kInvalidArgument, path, ": tensor ", Quote(name), ": ", shape.size(),
                   " dims (limit ", format::kMaxDims, ")");
    }
    auto numel = NumElements(shape);
    auto nbytes = numel ? StorageBytes(dtype, *numel) : std::nullopt;
    if (!nbytes) {
      return Error(StatusCode::kInvalidArgument, path, ": tensor ", Quote(name),
                   ": shape has a negative dim or its size overflows");
    }
    if (host != nullptr || fill == nullptr) {
      if (host_bytes != *nbytes || (host == nullptr && *nbytes > 0)) {
        return Error(StatusCode::kInvalidArgument, path, ": tensor ", Quote(name), ": ",
                     DTypeName(dtype), " shape needs ", *nbytes, " bytes, got ", host_bytes);
      }
    }
    TensorRecord rec;
    rec.name = std::string(name);
    rec.dtype = dtype;
    rec.shape = shape;
    rec.nbytes = *nbytes;
    rec.encoding = *nbytes == 0 ? Encoding::kRaw : encoding;
    rec.block_size = *nbytes == 0 ? 0 : options.block_size;
    FERRY_RETURN_IF_ERROR(PadTo(format::TensorAlignment(*nbytes)));
    rec.data_offset = pos;
    if (rec.encoding != Encoding::kRaw) {
      FERRY_RETURN_IF_ERROR(AddEncoded(rec, host, fill));
    }
    for (uint64_t off = 0; rec.encoding == Encoding::kRaw && off < rec.nbytes;
         off += rec.block_size) {
      size_t n = static_cast<size_t>(std::min(rec.block_size, rec.nbytes - off));
      const uint8_t* raw;
      if (host != nullptr) {
        raw = host + off;
      } else {
        block_buf.resize(n);
        Status st = (*fill)(off, block_buf.data(), n);
        if (!st.ok()) {
          return Error(st.code(), path, ": tensor ", Quote(name), ": source failed at byte ", off,
                       ": ", st.message());
        }
        raw = block_buf.data();
      }
      rec.checksums.push_back(Checksum64(raw, n));
      FERRY_RETURN_IF_ERROR(Write(raw, n));
    }
    rec.data_size = pos - rec.data_offset;
    if (rec.data_size == 0) rec.data_offset = 0;
    names.insert(rec.name);
    tensors.push_back(std::move(rec));
    return Status::Ok();
  }

  flatbuffers::Offset<fb::QuantizedComponent> BuildComponent(
      flatbuffers::FlatBufferBuilder& b, const std::optional<QuantizedComponent>& c) {
    if (!c) return 0;
    auto data = b.CreateString(c->data);
    auto scale = c->scale_inv.empty() ? 0 : b.CreateString(c->scale_inv);
    auto amax = c->amax.empty() ? 0 : b.CreateString(c->amax);
    return fb::CreateQuantizedComponent(b, data, scale,
                                        static_cast<fb::ScaleLayout>(c->scale_layout), amax);
  }

  std::pair<fb::Recipe, flatbuffers::Offset<void>> BuildRecipe(flatbuffers::FlatBufferBuilder& b,
                                                               const Recipe& recipe) {
    struct Visitor {
      flatbuffers::FlatBufferBuilder& b;
      std::pair<fb::Recipe, flatbuffers::Offset<void>> operator()(std::monostate) {
        return {fb::Recipe::NONE, 0};
      }
      std::pair<fb::Recipe, flatbuffers::Offset<void>> operator()(const DelayedScaling& r) {
        return {fb::Recipe::DelayedScaling,
                fb::CreateDelayedScaling(b, r.margin, static_cast<fb::Fp8Format>(r.fp8_format),
                                         r.amax_history_len,
                                         static_cast<fb::AmaxComputeAlgo>(r.amax_compute_algo),
                                         r.reduce_amax, r.fp8_dpa, r.fp8_mha)
                    .Union()};
      }
      std::pair<fb::Recipe, flatbuffers::Offset<void>> operator()(const Float8CurrentScaling& r) {
        return {fb::Recipe::Float8CurrentScaling,
                fb::CreateFloat8CurrentScaling(b, static_cast<fb::Fp8Format>(r.fp8_format),
                                               r.fp8_dpa, r.fp8_mha)
                    .Union()};
      }
      std::pair<fb::Recipe, flatbuffers::Offset<void>> operator()(const MXFP8BlockScaling& r) {
        return {fb::Recipe::MXFP8BlockScaling,
                fb::CreateMXFP8BlockScaling(b, static_cast<fb::Fp8Format>(r.fp8_format)).Union()};
      }
      std::pair<fb::Recipe, flatbuffers::Offset<void>> operator()(const Float8BlockScaling& r) {
        return {fb::Recipe::Float8BlockScaling,
                fb::CreateFloat8BlockScaling(b, static_cast<fb::Fp8Format>(r.fp8_format),
                                             r.x_block_scaling_dim, r.w_block_scaling_dim,
                                             r.grad_block_scaling_dim)
                    .Union()};
      }
      std::pair<fb::Recipe, flatbuffers::Offset<void>> operator()(const NVFP4BlockScaling& r) {
        return {fb::Recipe::NVFP4BlockScaling,
                fb::CreateNVFP4BlockScaling(b, r.disable_rht, r.disable_stochastic_rounding,
                                            r.disable_2d_quantization)
                    .Union()};
      }
      std::pair<fb::Recipe, flatbuffers::Offset<void>> operator()(const CustomRecipe& r) {
        auto name = b.CreateString(r.name);
        auto qf = r.qfactory.empty() ? 0 : b.CreateString(r.qfactory);
        return {fb::Recipe::CustomRecipe, fb::CreateCustomRecipe(b, name, qf).Union()};
      }
    };
    return std::visit(Visitor{b}, recipe);
  }

  Status BuildFooter(flatbuffers::FlatBufferBuilder& b) {
    std::sort(tensors.begin(), tensors.end(),
              [](const TensorRecord& x, const TensorRecord& y) { return x.name < y.name; });
    std::vector<flatbuffers::Offset<fb::Tensor>> toffs;
    toffs.reserve(tensors.size());
    std::vector<fb::Chunk> chunks;
    for (const TensorRecord& t : tensors) {
      auto name = b.CreateString(t.name);
      auto shape = b.CreateVector(t.shape);
      auto sums = b.CreateVector(t.checksums);
      flatbuffers::Offset<flatbuffers::Vector<const fb::Chunk*>> ch = 0;
      if (t.encoding != Encoding::kRaw) {
        chunks.clear();
        for (const ChunkRecord& c : t.chunks) {
          chunks.emplace_back(c.offset, c.stored_size, static_cast<fb::ChunkCodec>(c.codec));
        }
        ch = b.CreateVectorOfStructs(chunks);
      }
      flatbuffers::Offset<flatbuffers::Vector<int64_t>> gshape = 0, goffset = 0;
      if (!t.global_shape.empty() || !t.shard_offset.empty()) {
        gshape = b.CreateVector(t.global_shape);
        goffset = b.CreateVector(t.shard_offset);
      }
      toffs.push_back(fb::CreateTensor(
          b, name, static_cast<fb::DType>(t.dtype), shape, t.data_offset, t.data_size, t.nbytes,
          static_cast<fb::Encoding>(t.encoding), t.block_size, sums, ch, gshape, goffset));
    }
    auto tvec = b.CreateVector(toffs);

    std::vector<flatbuffers::Offset<fb::QuantizedTensor>> qoffs;
    for (const auto& [qname, q] : quantized) {
      for (const auto* c : {&q.rowwise, &q.columnwise}) {
        if (!*c) continue;
        for (const std::string* ref : {&(*c)->data, &(*c)->scale_inv, &(*c)->amax}) {
          if (ref->empty() && ref != &(*c)->data) continue;
          if (!names.count(*ref)) {
            return Error(StatusCode::kInvalidArgument, path, ": quantized tensor ", Quote(qname),
                         " refers to tensor ", Quote(*ref), ", which was not added");
          }
        }
      }
      auto name = b.CreateString(q.name);
      auto shape = b.CreateVector(q.shape);
      auto row = BuildComponent(b, q.rowwise);
      auto col = BuildComponent(b, q.columnwise);
      qoffs.push_back(fb::CreateQuantizedTensor(b, name, static_cast<fb::DType>(q.quantized_dtype),
                                                static_cast<fb::DType>(q.logical_dtype), shape,
                                                static_cast<fb::ScalingMode>(q.scaling_mode), row,
                                                col));
    }
    auto qvec = b.CreateVector(qoffs);

    std::vector<flatbuffers::Offset<fb::ScalingState>> soffs;
    for (const auto& [module, s] : scaling) {
      std::vector<flatbuffers::Offset<fb::DirectionState>> doffs;
      for (const DirectionState& d : s.states) {
        std::vector<uint8_t> roles;
        for (SlotRole r : d.slot_roles) roles.push_back(static_cast<uint8_t>(r));
        auto rv = b.CreateVector(reinterpret_cast<const fb::SlotRole*>(roles.data()), roles.size());
        auto sv = b.CreateVector(d.scale);
        auto hv = b.CreateVector(d.amax_history);
        doffs.push_back(fb::CreateDirectionState(b, static_cast<fb::Direction>(d.direction),
                                                 d.num_gemms, rv, sv, hv, d.history_len));
      }
      auto dvec = b.CreateVector(doffs);
      auto mname = b.CreateString(module);
      auto [rtype, roff] = BuildRecipe(b, s.recipe);
      soffs.push_back(fb::CreateScalingState(b, mname, rtype, roff, dvec));
    }
    auto svec = b.CreateVector(soffs);

    std::vector<flatbuffers::Offset<fb::KeyValue>> moffs;
    for (const auto& [k, v] : metadata) {
      auto ko = b.CreateString(k);
      auto vo = b.CreateString(v);
      moffs.push_back(fb::CreateKeyValue(b, ko, vo));
    }
    auto mvec = b.CreateVector(moffs);
    std::string producer = options.producer.empty()
                               ? std::string("tensorferry ") + FERRY_VERSION_STRING
                               : options.producer;
    auto prod = b.CreateString(producer);
    std::vector<uint32_t> order;
    for (uint32_t i = 0; i < tensors.size(); ++i) {
      if (tensors[i].data_size > 0) order.push_back(i);
    }
    std::sort(order.begin(), order.end(), [&](uint32_t x, uint32_t y) {
      return tensors[x].data_offset < tensors[y].data_offset;
    });
    auto ovec = b.CreateVector(order);
    auto root = fb::CreateCheckpoint(b, kFormatVersion, prod, fb::ChecksumAlgo::XXH3_64, tvec, qvec,
                                     svec, mvec, ovec);
    fb::FinishCheckpointBuffer(b, root);
    return Status::Ok();
  }

  Status Commit() {
    FERRY_RETURN_IF_ERROR(CheckUsable());
    flatbuffers::FlatBufferBuilder builder(1 << 16);
    Status st = BuildFooter(builder);
    if (!st.ok()) {
      Abort();
      return st;
    }
    if (builder.GetSize() > format::kMaxFooterBytes) {
      Abort();
      return Error(StatusCode::kResourceExhausted, path, ": footer of ", builder.GetSize(),
                   " bytes exceeds the format's limit of ", format::kMaxFooterBytes);
    }
    FERRY_RETURN_IF_ERROR(PadTo(8));
    uint64_t footer_size = builder.GetSize();
    uint8_t trailer[format::kTrailerSize];
    uint64_t sum = Checksum64(builder.GetBufferPointer(), footer_size);
    std::memcpy(trailer, &footer_size, 8);
    std::memcpy(trailer + 8, &sum, 8);
    std::memcpy(trailer + 16, format::kMagic, format::kMagicSize);
    FERRY_RETURN_IF_ERROR(Write(builder.GetBufferPointer(), footer_size));
    FERRY_RETURN_IF_ERROR(Write(trailer, sizeof(trailer)));
    if (options.durable) {
      st = file.Sync();
      if (!st.ok()) {
        Abort();
        return st;
      }
    }
    st = file.Close();
    if (st.ok()) st = RenameFile(tmp_path, path);
    if (!st.ok()) {
      Abort();
      return st;
    }
    spent = true;
    if (options.durable) FERRY_RETURN_IF_ERROR(SyncParentDir(path));
    return Status::Ok();
  }
};

Writer::Writer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Writer::Writer(Writer&&) noexcept = default;
Writer& Writer::operator=(Writer&&) noexcept = default;
Writer::~Writer() = default;

Result<Writer> Writer::Create(const std::string& path, WriterOptions options) {
  if (path.empty()) return Error(StatusCode::kInvalidArgument, "empty checkpoint path");
  uint64_t bs = options.block_size;
  if (bs < format::kMinBlockSize || bs > format::kMaxBlockSize || (bs & (bs - 1)) != 0) {
    return Error(StatusCode::kInvalidArgument, path, ": block_size ", bs,
                 " must be a power of two in [", format::kMinBlockSize, ", ", format::kMaxBlockSize,
                 "]");
  }
  if (static_cast<uint8_t>(options.encoding) > 3) {
    return Error(StatusCode::kInvalidArgument, path, ": unknown encoding ",
                 static_cast<int>(options.encoding));
  }
  if (options.min_savings < 0 || options.min_savings >= 1) {
    return Error(StatusCode::kInvalidArgument, path, ": min_savings ", options.min_savings,
                 " outside [0, 1)");
  }
  auto impl = std::make_unique<Impl>();
  impl->path = path;
  impl->options = std::move(options);
  impl->tmp_path = TempPath(path);
  FERRY_ASSIGN_OR_RETURN(impl->file, File::CreateExclusive(impl->tmp_path));
  FERRY_RETURN_IF_ERROR(impl->Write(format::kMagic, format::kMagicSize));
  FERRY_RETURN_IF_ERROR(impl->PadTo(format::kFirstDataOffset));
  return Writer(std::move(impl));
}

Status Writer::AddTensor(std::string_view name, DType dtype, const std::vector<int64_t>& shape,
                         const void* data, uint64_t nbytes) {
  return AddTensor(name, dtype, shape, data, nbytes, impl_->options.encoding);
}

Status Writer::AddTensor(std::string_view name, DType dtype, const std::vector<int64_t>& shape,
                         const void* data, uint64_t nbytes, Encoding encoding) {
  if (!impl_) return Error(StatusCode::kInvalidArgument, "moved-from Writer");
  return impl_->Add(name, dtype, shape, static_cast<const uint8_t*>(data), nbytes, nullptr,
                    encoding);
}

Status Writer::AddTensorFrom(std::string_view name, DType dtype, const std::vector<int64_t>& shape,
                             const FillFn& fill, Encoding encoding) {
  if (!impl_) return Error(StatusCode::kInvalidArgument, "moved-from Writer");
  if (!fill) return Error(StatusCode::kInvalidArgument, impl_->path, ": empty fill function");
  return impl_->Add(name, dtype, shape, nullptr, 0, &fill, encoding);
}

Status Writer::SetGlobalSlice(std::string_view name, const std::vector<int64_t>& global_shape,
                              const std::vector<int64_t>& offset) {
  if (!impl_) return Error(StatusCode::kInvalidArgument, "moved-from Writer");
  FERRY_RETURN_IF_ERROR(impl_->CheckUsable());
  auto& tensors = impl_->tensors;
  // Usually called right after AddTensor: look at the newest record before searching.
  auto it = !tensors.empty() && tensors.back().name == name
                ? tensors.end() - 1
                : std::find_if(tensors.begin(), tensors.end(),
                               [&](const TensorRecord& t) { return t.name == name; });
  if (it == tensors.end()) {
    return Error(StatusCode::kNotFound, impl_->path, ": SetGlobalSlice of ", Quote(name),
                 ", which was not added");
  }
  const std::vector<int64_t>& shape = it->shape;
  if (global_shape.size() != shape.size() || offset.size() != shape.size()) {
    return Error(StatusCode::kInvalidArgument, impl_->path, ": tensor ", Quote(name), " has ",
                 shape.size(), " dims, but the global shape has ", global_shape.size(),
                 " and the offset ", offset.size());
  }
  if (!NumElements(global_shape)) {
    return Error(StatusCode::kInvalidArgument, impl_->path, ": tensor ", Quote(name),
                 ": global shape has a negative dim or its size overflows");
  }
  for (size_t d = 0; d < shape.size(); ++d) {
    if (offset[d] < 0 || offset[d] > global_shape[d] - shape[d]) {
      return Error(StatusCode::kInvalidArgument, impl_->path, ": tensor ", Quote(name), ": dim ", d,
                   " covers [", offset[d], ", ", offset[d] + shape[d], ") of a global extent of ",
                   global_shape[d]);
    }
  }
  it->global_shape = global_shape;
  it->shard_offset = offset;
  return Status::Ok();
}

Status Writer::AddQuantized(const QuantizedTensor& tensor) {
  if (!impl_) return Error(StatusCode::kInvalidArgument, "moved-from Writer");
  FERRY_RETURN_IF_ERROR(impl_->CheckUsable());
  FERRY_RETURN_IF_ERROR(CheckKey(impl_->path, tensor.name, "quantized tensor name"));
  if (!NumElements(tensor.shape) || tensor.shape.size() > format::kMaxDims) {
    return Error(StatusCode::kInvalidArgument, impl_->path, ": quantized tensor ",
                 Quote(tensor.name), ": bad shape");
  }
  for (const auto* c : {&tensor.rowwise, &tensor.columnwise}) {
    if (*c && (*c)->data.empty()) {
      return Error(StatusCode::kInvalidArgument, impl_->path, ": quantized tensor ",
                   Quote(tensor.name), ": a component needs a data tensor");
    }
  }
  if (!impl_->quantized.emplace(tensor.name, tensor).second) {
    return Error(StatusCode::kInvalidArgument, impl_->path, ": duplicate quantized tensor ",
                 Quote(tensor.name));
  }
  return Status::Ok();
}

Status Writer::AddScalingState(const ScalingState& state) {
  if (!impl_) return Error(StatusCode::kInvalidArgument, "moved-from Writer");
  FERRY_RETURN_IF_ERROR(impl_->CheckUsable());
  FERRY_RETURN_IF_ERROR(CheckKey(impl_->path, state.module, "scaling state module"));
  if (const auto* c = std::get_if<CustomRecipe>(&state.recipe); c && c->name.empty()) {
    return Error(StatusCode::kInvalidArgument, impl_->path, ": scaling state ", Quote(state.module),
                 ": a custom recipe needs a name");
  }
  for (const DirectionState& d : state.states) {
    uint64_t slots = d.slot_roles.size();
    if (d.scale.size() != slots || d.history_len < 0 ||
        d.amax_history.size() != static_cast<uint64_t>(d.history_len) * slots) {
      return Error(StatusCode::kInvalidArgument, impl_->path, ": scaling state ",
                   Quote(state.module),
                   ": needs scale F32[S] and amax_history F32[L, S] with S=", slots,
                   " slot roles and L=", d.history_len, "; got ", d.scale.size(), " scales and ",
                   d.amax_history.size(), " history entries");
    }
  }
  if (!impl_->scaling.emplace(state.module, state).second) {
    return Error(StatusCode::kInvalidArgument, impl_->path, ": duplicate scaling state ",
                 Quote(state.module));
  }
  return Status::Ok();
}

Status Writer::SetMetadata(std::string_view key, std::string_view value) {
  if (!impl_) return Error(StatusCode::kInvalidArgument, "moved-from Writer");
  FERRY_RETURN_IF_ERROR(impl_->CheckUsable());
  FERRY_RETURN_IF_ERROR(CheckKey(impl_->path, key, "metadata key"));
  impl_->metadata[std::string(key)] = std::string(value);
  return Status::Ok();
}

Status Writer::Commit() {
  if (!impl_) return Error(StatusCode::kInvalidArgument, "moved-from Writer");
  return impl_->Commit();
}

void Writer::Abort() {
  if (impl_) impl_->Abort();
}

const std::string& Writer::path() const {
  static const std::string kEmpty;
  return impl_ ? impl_->path : kEmpty;
}

}  // namespace ferry
