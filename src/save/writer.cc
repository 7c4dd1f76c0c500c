// Streaming writer: the public API and the commit. The caller's thread checks each tensor and
// stages its blocks (points at host memory, copies it into the staging pool, pulls it from a
// FillFn, or enqueues a device-to-host copy on the caller's stream: device_snapshot.hpp), and
// hands them to the block pipeline (block_pipeline.hpp), which encodes and writes them. The
// footer (format/footer_builder.hpp) and the atomic rename happen in Finish, on the caller's
// thread (Commit) or in the background (CommitAsync).
#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <set>
#include <vector>

#include "base/util.hpp"
#include "base/worker_pool.hpp"
#include "cuda/staging_pool.hpp"
#include "format/footer_builder.hpp"
#include "format/format.hpp"
#include "io/io.hpp"
#include "io/remote_sink.hpp"
#include "io/source.hpp"
#include "io/temp_file.hpp"
#include "save/block_pipeline.hpp"
#include "save/device_snapshot.hpp"
#include "save/direct_sink.hpp"

namespace ferry {

namespace {

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

// Where a tensor's bytes come from.
struct Source {
  enum class Kind { kHost, kFill, kDevice } kind = Kind::kHost;
  const uint8_t* host = nullptr;
  uint64_t host_bytes = 0;
  const FillFn* fill = nullptr;
  const uint8_t* device = nullptr;
  Stream stream = nullptr;
};

// The internal pool of a writer without WriterOptions::staging.
constexpr uint64_t kDefaultStagingBytes = uint64_t{64} << 20;

}  // namespace

class SaveHandle::State {
 public:
  std::string path;
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  Status status;
};

class Writer::Impl {
 public:
  Impl(std::string p, WriterOptions o)
      : path(std::move(p)), options(std::move(o)), pool(options.staging), device(path) {
    extras.producer = options.producer;
  }

  std::string path;
  bool upload = false;  // an s3:// object: the pipeline's sink uploads it, no local file
  std::string tmp_path;
  std::string dest;  // `path`, or the file a symbolic link at `path` resolves to
  File file;         // the temporary file; messages name `dest`
  File temp_lock;    // its lock (io/temp_file.hpp), held until the rename or the removal
  WriterOptions options;
  bool spent = false;  // Commit, CommitAsync or Abort was reached (caller's side)
  bool finished = false;
  std::deque<PipelineTensor> tensors;  // stable addresses: blocks point into it
  std::set<std::string, std::less<>> names;
  format::FooterExtras extras;              // quantized tensors, scaling states, metadata, producer
  std::shared_ptr<StagingPool> pool;        // options.staging, or the internal one once needed
  DeviceSnapshot device;                    // device tensors' copies
  std::unique_ptr<BlockPipeline> pipeline;  // made by Create, right after the file

  ~Impl() { Abort(); }

  void Abort() {
    if (spent) return;
    spent = true;
    if (pipeline) {
      pipeline->Fail(Error(StatusCode::kInvalidArgument, path, ": writer aborted"));
      pipeline->Drain();
      (void)pipeline->Close(0);  // an upload is abandoned now: the previous object stays
    }
    (void)file.Close();
    if (!tmp_path.empty()) ::unlink(tmp_path.c_str());
    (void)temp_lock.Close();
  }

  Status CheckUsable() const {
    if (spent) {
      return Error(StatusCode::kInvalidArgument, path, ": writer already committed or aborted");
    }
    return Status::Ok();
  }

  Result<StagingPool::Impl*> Pool() {
    if (!pool) {
      FERRY_ASSIGN_OR_RETURN(
          pool, StagingPool::Create(std::max(kDefaultStagingBytes, 2 * options.block_size)));
    }
    if (options.block_size > pool->bytes()) {
      return Error(StatusCode::kInvalidArgument, path, ": block_size ", options.block_size,
                   " exceeds the staging pool of ", pool->bytes(), " bytes");
    }
    return &pool->impl();
  }

  Status WaitSnapshot() {
    FERRY_RETURN_IF_ERROR(device.WaitAll());
    return pipeline->status();
  }

  // ---- adding tensors ---------------------------------------------------------------------

  // The tensor's size in bytes, once its name, dtype, encoding, shape and source are usable.
  Result<uint64_t> CheckTensor(std::string_view name, DType dtype,
                               const std::vector<int64_t>& shape, const Source& src,
                               Encoding encoding) const {
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
    if (src.kind != Source::Kind::kFill) {
      const bool null =
          src.kind == Source::Kind::kHost ? src.host == nullptr : src.device == nullptr;
      if (src.host_bytes != *nbytes || (null && *nbytes > 0)) {
        return Error(StatusCode::kInvalidArgument, path, ": tensor ", Quote(name), ": ",
                     DTypeName(dtype), " shape needs ", *nbytes, " bytes, got ", src.host_bytes);
      }
    }
    return *nbytes;
  }

  // Gives block `b` its bytes: a staging piece filled from the source (a host copy, the fill
  // function, or an enqueued device copy), or, unstaged, the caller's memory itself.
  Status StageBlock(Block& b, const Source& src, StagingPool::Impl* staging,
                    const std::string& where) {
    const uint64_t off = b.raw_off;
    if (staging != nullptr) {
      auto piece = staging->Acquire(b.n);
      if (!piece.ok()) return Error(piece.status().code(), where, ": ", piece.status().message());
      b.pool = staging;
      b.piece = piece->id;
      b.raw = piece->data;
    }
    switch (src.kind) {
      case Source::Kind::kHost:
        if (b.pool != nullptr) {
          std::memcpy(const_cast<uint8_t*>(b.raw), src.host + off, b.n);
        } else {
          b.raw = src.host + off;
        }
        return Status::Ok();
      case Source::Kind::kFill: {
        Status st = (*src.fill)(off, const_cast<uint8_t*>(b.raw), b.n);
        if (!st.ok()) {
          return Error(st.code(), where, ": source failed at byte ", off, ": ", st.message());
        }
        return Status::Ok();
      }
      case Source::Kind::kDevice: {
        FERRY_ASSIGN_OR_RETURN(b.event, device.Copy(const_cast<uint8_t*>(b.raw), src.device + off,
                                                    b.n, src.stream, where, off));
        return Status::Ok();
      }
    }
    return Status::Ok();
  }

  // A failure while adding spoils the whole save: the file would miss part of a tensor.
  Status Spoil(Status st) {
    pipeline->Fail(st);
    return st;
  }

  // A host or pulled tensor of one small block: copied into the pipeline's batch, so it costs
  // no thread hand-off (and the caller's memory is free at the return, as when staged).
  Status AddSmall(PipelineTensor& rec, const Source& src) {
    uint8_t* dst = pipeline->AddSmall(&rec, rec.nbytes);
    if (rec.nbytes == 0) return pipeline->status();
    if (src.kind == Source::Kind::kHost) {
      std::memcpy(dst, src.host, rec.nbytes);
      return pipeline->status();
    }
    Status st = (*src.fill)(0, dst, rec.nbytes);
    if (!st.ok()) {
      return Spoil(Error(st.code(), path, ": tensor ", Quote(rec.name),
                         ": source failed at byte 0: ", st.message()));
    }
    return pipeline->status();
  }

  PipelineTensor& NewRecord(std::string_view name, DType dtype, const std::vector<int64_t>& shape,
                            uint64_t nbytes, Encoding encoding) {
    tensors.emplace_back();
    PipelineTensor& rec = tensors.back();
    rec.name = std::string(name);
    rec.dtype = dtype;
    rec.shape = shape;
    rec.nbytes = nbytes;
    rec.encoding = nbytes == 0 ? Encoding::kRaw : encoding;
    rec.block_size = nbytes == 0 ? 0 : options.block_size;
    names.insert(rec.name);
    return rec;
  }

  Status Add(std::string_view name, DType dtype, const std::vector<int64_t>& shape,
             const Source& src, Encoding encoding) {
    FERRY_ASSIGN_OR_RETURN(const uint64_t nbytes, CheckTensor(name, dtype, shape, src, encoding));
    if (src.kind != Source::Kind::kDevice &&
        nbytes <= std::min(BlockPipeline::kSmallBytes, options.block_size)) {
      FERRY_RETURN_IF_ERROR(pipeline->status());
      FERRY_RETURN_IF_ERROR(pipeline->Start());
      return AddSmall(NewRecord(name, dtype, shape, nbytes, encoding), src);
    }
    const std::string where = StrCat(path, ": tensor ", Quote(name));
    const bool staged = src.kind != Source::Kind::kHost || options.staging != nullptr;
    StagingPool::Impl* staging = nullptr;
    if (staged && nbytes > 0) {
      FERRY_ASSIGN_OR_RETURN(staging, Pool());
    }
    if (src.kind == Source::Kind::kDevice) {
      FERRY_RETURN_IF_ERROR(device.Bind(where, src.device, nbytes));
      if (staging != nullptr) {
        Status st = staging->EnsurePinned();
        if (!st.ok()) return Error(st.code(), where, ": ", st.message());
      }
    }
    FERRY_RETURN_IF_ERROR(pipeline->status());
    FERRY_RETURN_IF_ERROR(pipeline->Start());

    PipelineTensor& rec = NewRecord(name, dtype, shape, nbytes, encoding);
    const uint64_t bs = options.block_size;
    uint64_t off = 0;
    do {
      Block b;
      b.rec = &rec;
      b.raw_off = off;
      b.n = static_cast<size_t>(std::min(bs, rec.nbytes - off));
      b.first = off == 0;
      b.last = off + b.n == rec.nbytes;
      if (b.n > 0) {
        Status st = StageBlock(b, src, staging, where);
        if (!st.ok()) {
          if (b.pool != nullptr) b.pool->Release(b.piece);
          return Spoil(std::move(st));
        }
      }
      pipeline->Push(std::move(b));
      off += bs;
    } while (off < rec.nbytes);
    if (src.kind == Source::Kind::kDevice && rec.nbytes > 0) {
      Status st = device.RecordTail(src.stream);
      if (!st.ok()) return Spoil(std::move(st));
    }
    // Unstaged blocks point into the caller's memory: return once they are in the file.
    if (!staged) return pipeline->WaitWritten(rec);
    return pipeline->status();
  }

  // ---- commit -----------------------------------------------------------------------------

  // Every tensor a quantized tensor names must have been added.
  Status CheckQuantizedRefs() const {
    for (const auto& [qname, q] : extras.quantized) {
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
    }
    return Status::Ok();
  }

  // Footer and trailer after the data section, 8-byte aligned.
  Status WriteFooter() {
    FERRY_RETURN_IF_ERROR(CheckQuantizedRefs());
    std::vector<const format::TensorRecord*> records;
    records.reserve(tensors.size());
    for (const PipelineTensor& t : tensors) records.push_back(&t);
    FERRY_ASSIGN_OR_RETURN(std::vector<uint8_t> footer,
                           format::BuildFooter(std::move(records), extras, path));
    const auto trailer = format::MakeTrailer(footer);
    const uint64_t footer_at = AlignUp(pipeline->end(), 8);
    FERRY_RETURN_IF_ERROR(pipeline->WriteTail(footer_at, footer.data(), footer.size()));
    FERRY_RETURN_IF_ERROR(
        pipeline->WriteTail(footer_at + footer.size(), trailer.data(), trailer.size()));
    return pipeline->Close(pipeline->end());
  }

  // Drains the pipeline, writes footer and trailer, fsyncs and renames. On failure the
  // temporary file is removed and `path` is untouched.
  Status Finish() {
    pipeline->Drain();
    Status st = pipeline->status();
    if (st.ok()) st = WriteFooter();
    (void)pipeline->Close(0);
    if (upload) {
      // WriteFooter's Close completed the upload; a failure anywhere has aborted it.
      finished = st.ok();
      return st;
    }
    if (st.ok() && options.durable) st = file.Sync();
    if (st.ok()) st = KeepPermissions(file, dest);
    if (st.ok()) st = file.Close();
    if (st.ok()) st = RenameFile(tmp_path, dest);
    if (!st.ok()) {
      (void)file.Close();
      ::unlink(tmp_path.c_str());
      (void)temp_lock.Close();
      return st;
    }
    (void)temp_lock.Close();
    finished = true;
    if (options.durable) FERRY_RETURN_IF_ERROR(SyncParentDir(dest));
    return Status::Ok();
  }

  Status Commit() {
    FERRY_RETURN_IF_ERROR(CheckUsable());
    spent = true;
    return Finish();
  }
};

Writer::Writer(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
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
  if (options.staging && options.block_size > options.staging->bytes()) {
    return Error(StatusCode::kInvalidArgument, path, ": block_size ", options.block_size,
                 " exceeds the staging pool of ", options.staging->bytes(), " bytes");
  }
  auto impl = std::make_shared<Impl>(path, std::move(options));
  if (IsRemoteName(path)) {
    FERRY_ASSIGN_OR_RETURN(std::unique_ptr<RemoteSink> upload, OpenRemoteSink(path));
    std::unique_ptr<DirectSink> sink = DirectSink::OpenUpload(std::move(upload));
    if (sink == nullptr) {
      return Error(StatusCode::kResourceExhausted, path, ": no memory for the upload's buffers");
    }
    impl->upload = true;
    impl->pipeline = std::make_unique<BlockPipeline>(path, impl->options, &impl->file,
                                                     std::move(sink), &impl->device);
    return Writer(std::move(impl));
  }
  FERRY_ASSIGN_OR_RETURN(TempFile temp, BeginReplace(path));
  impl->dest = std::move(temp.dest);
  impl->file = std::move(temp.file);
  impl->tmp_path = std::move(temp.path);
  impl->temp_lock = std::move(temp.lock);
  // Bytes between the magic and the first tensor, and between tensors, are never written:
  // they read as zeros (holes).
  std::unique_ptr<DirectSink> sink;
  if (impl->options.direct_io) sink = DirectSink::Open(impl->tmp_path, &impl->file);
  const bool direct = sink != nullptr;
  impl->pipeline = std::make_unique<BlockPipeline>(path, impl->options, &impl->file,
                                                   std::move(sink), &impl->device);
  if (!direct) {
    FERRY_RETURN_IF_ERROR(impl->file.PWriteAll(format::kMagic, format::kMagicSize, 0));
  }
  return Writer(std::move(impl));
}

Status Writer::AddTensor(std::string_view name, DType dtype, const std::vector<int64_t>& shape,
                         const void* data, uint64_t nbytes) {
  return AddTensor(name, dtype, shape, data, nbytes, impl_->options.encoding);
}

Status Writer::AddTensor(std::string_view name, DType dtype, const std::vector<int64_t>& shape,
                         const void* data, uint64_t nbytes, Encoding encoding) {
  if (!impl_) return Error(StatusCode::kInvalidArgument, "moved-from Writer");
  Source src;
  src.host = static_cast<const uint8_t*>(data);
  src.host_bytes = nbytes;
  return impl_->Add(name, dtype, shape, src, encoding);
}

Status Writer::AddTensorFrom(std::string_view name, DType dtype, const std::vector<int64_t>& shape,
                             const FillFn& fill, Encoding encoding) {
  if (!impl_) return Error(StatusCode::kInvalidArgument, "moved-from Writer");
  if (!fill) return Error(StatusCode::kInvalidArgument, impl_->path, ": empty fill function");
  Source src;
  src.kind = Source::Kind::kFill;
  src.fill = &fill;
  return impl_->Add(name, dtype, shape, src, encoding);
}

Status Writer::AddDeviceTensor(std::string_view name, DType dtype,
                               const std::vector<int64_t>& shape, const void* device_data,
                               uint64_t nbytes, Stream stream) {
  if (!impl_) return Error(StatusCode::kInvalidArgument, "moved-from Writer");
  return AddDeviceTensor(name, dtype, shape, device_data, nbytes, stream, impl_->options.encoding);
}

Status Writer::AddDeviceTensor(std::string_view name, DType dtype,
                               const std::vector<int64_t>& shape, const void* device_data,
                               uint64_t nbytes, Stream stream, Encoding encoding) {
  if (!impl_) return Error(StatusCode::kInvalidArgument, "moved-from Writer");
  Source src;
  src.kind = Source::Kind::kDevice;
  src.device = static_cast<const uint8_t*>(device_data);
  src.host_bytes = nbytes;
  src.stream = stream;
  return impl_->Add(name, dtype, shape, src, encoding);
}

Status Writer::WaitSnapshot() {
  if (!impl_) return Error(StatusCode::kInvalidArgument, "moved-from Writer");
  FERRY_RETURN_IF_ERROR(impl_->CheckUsable());
  return impl_->WaitSnapshot();
}

Result<SaveHandle> Writer::CommitAsync() {
  if (!impl_) return Error(StatusCode::kInvalidArgument, "moved-from Writer");
  FERRY_RETURN_IF_ERROR(impl_->CheckUsable());
  Status st = impl_->WaitSnapshot();
  if (!st.ok()) {
    impl_->Abort();
    return st;
  }
  impl_->spent = true;
  auto state = std::make_shared<SaveHandle::State>();
  state->path = impl_->path;
  auto finish = [state](std::shared_ptr<Impl> impl) {
    Status result = impl->Finish();
    // Workers are joined by Finish; the rest goes with the last reference (this one, unless
    // the Writer still exists).
    impl.reset();
    {
      std::lock_guard<std::mutex> lock(state->mu);
      state->status = std::move(result);
      state->done = true;
    }
    state->cv.notify_all();
  };
  Status started = StartDetached([finish, impl = impl_] { finish(impl); }, impl_->path);
  if (!started.ok()) finish(impl_);  // no thread to spare: finish here, before returning
  return SaveHandle(std::move(state));
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
                               [&](const PipelineTensor& t) { return t.name == name; });
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
  if (!impl_->extras.quantized.emplace(tensor.name, tensor).second) {
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
  if (!impl_->extras.scaling.emplace(state.module, state).second) {
    return Error(StatusCode::kInvalidArgument, impl_->path, ": duplicate scaling state ",
                 Quote(state.module));
  }
  return Status::Ok();
}

Status Writer::SetMetadata(std::string_view key, std::string_view value) {
  if (!impl_) return Error(StatusCode::kInvalidArgument, "moved-from Writer");
  FERRY_RETURN_IF_ERROR(impl_->CheckUsable());
  FERRY_RETURN_IF_ERROR(CheckKey(impl_->path, key, "metadata key"));
  impl_->extras.metadata[std::string(key)] = std::string(value);
  return Status::Ok();
}

Status Writer::Commit() {
  if (!impl_) return Error(StatusCode::kInvalidArgument, "moved-from Writer");
  return impl_->Commit();
}

void Writer::Abort() {
  if (impl_) impl_->Abort();
}

SaveHandle::SaveHandle() = default;
SaveHandle::SaveHandle(std::shared_ptr<State> state) : state_(std::move(state)) {}
SaveHandle::SaveHandle(SaveHandle&&) noexcept = default;
SaveHandle& SaveHandle::operator=(SaveHandle&& other) noexcept {
  if (this != &other) {
    (void)Wait();
    state_ = std::move(other.state_);
  }
  return *this;
}
SaveHandle::~SaveHandle() { (void)Wait(); }

Status SaveHandle::Wait() {
  if (!state_) return Error(StatusCode::kInvalidArgument, "SaveHandle without a save");
  std::unique_lock<std::mutex> lock(state_->mu);
  state_->cv.wait(lock, [&] { return state_->done; });
  return state_->status;
}

bool SaveHandle::done() const {
  if (!state_) return true;
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->done;
}

const std::string& SaveHandle::path() const {
  static const std::string kEmpty;
  return state_ ? state_->path : kEmpty;
}

const std::string& Writer::path() const {
  static const std::string kEmpty;
  return impl_ ? impl_->path : kEmpty;
}

}  // namespace ferry
