// `ferry bench`: load throughput of a checkpoint onto the current GPU (or into host memory
// without one), printed beside the hardware ceiling measured in the same run.
#include <fcntl.h>
#include <sched.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>

#include "base/fp8.hpp"
#include "base/util.hpp"
#include "base/worker_pool.hpp"
#include "cli.hpp"
#include "codec/codec.hpp"
#include "codec/planes.hpp"
#include "ferry/loader.hpp"
#include "format/block_source.hpp"
#include "io/source.hpp"

#ifdef FERRY_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace ferry::cli {

namespace {

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// The generated file and its directory, removed on exit and on Ctrl-C: they usually sit in
// /dev/shm, where a leftover holds RAM until reboot.
char g_cleanup_file[4096];
char g_cleanup_dir[4096];

void RemoveGenerated() {
  if (g_cleanup_file[0]) ::unlink(g_cleanup_file);
  if (g_cleanup_dir[0]) ::rmdir(g_cleanup_dir);
  g_cleanup_file[0] = g_cleanup_dir[0] = '\0';
}

void OnSignal(int sig) {
  // unlink and rmdir are async-signal-safe.
  if (g_cleanup_file[0]) ::unlink(g_cleanup_file);
  if (g_cleanup_dir[0]) ::rmdir(g_cleanup_dir);
  ::_exit(128 + sig);
}

std::string PickDir(const BenchOptions& options, uint64_t need) {
  if (!options.dir.empty()) return options.dir;
  struct statvfs vfs;
  struct stat st;
  // /dev/shm keeps the file in RAM, so the benchmark measures the loader, not the disk.
  if (::stat("/dev/shm", &st) == 0 && S_ISDIR(st.st_mode) && ::access("/dev/shm", W_OK) == 0 &&
      ::statvfs("/dev/shm", &vfs) == 0 &&
      static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize > need + (uint64_t{256} << 20)) {
    return "/dev/shm";
  }
  const char* tmp = std::getenv("TMPDIR");
  return tmp && *tmp ? tmp : "/tmp";
}

struct Layout {
  int64_t hidden = 0, ffn = 0, kv = 0, vocab = 0;
  int layers = 0;
};

uint64_t LayerBytes(int64_t h, int64_t ffn, int64_t kv) {
  return 2 * static_cast<uint64_t>(2 * h * h + 2 * kv * h + 3 * ffn * h + 2 * h);
}

// A llama-like decoder (GQA 4:1, MLP 3.5x hidden) sized to `target`: the widest hidden size
// that still fits four layers beside the embeddings, as many layers as fit, and the vocabulary
// taking up the remainder so the file comes out close to the size asked for.
Layout ChooseLayout(uint64_t target) {
  Layout best;
  for (int64_t h : {64, 128, 256, 512, 1024, 2048, 4096, 8192}) {
    int64_t ffn = std::max<int64_t>(64, (h * 7 / 2 + 127) / 128 * 128);
    int64_t kv = std::max<int64_t>(16, h / 4);
    int64_t vocab = std::min<int64_t>(32000, 64 * h);
    uint64_t embed = 2 * static_cast<uint64_t>(2 * vocab * h) + 2 * h;
    uint64_t layer = LayerBytes(h, ffn, kv);
    if (best.hidden != 0 && embed + 4 * layer > target) break;
    best = Layout{h, ffn, kv, vocab, 1};
    if (target > embed)
      best.layers = static_cast<int>(std::max<uint64_t>(1, (target - embed) / layer));
  }
  uint64_t layers_bytes = best.layers * LayerBytes(best.hidden, best.ffn, best.kv);
  if (target > layers_bytes + 2 * best.hidden) {
    int64_t vocab = static_cast<int64_t>((target - layers_bytes - 2 * best.hidden) /
                                         (4 * static_cast<uint64_t>(best.hidden)));
    best.vocab = std::max<int64_t>(64, vocab / 64 * 64);
  }
  return best;
}

// Weight-like bytes of `dtype`, read by the generator at shifting offsets. bf16: |x| around
// 2^-7..2^0 with random sign and mantissa. fp8: normal values whose scale varies by row of
// 4096 (weights after training are not one Gaussian), scaled so that the largest maps to the
// format's largest finite value, as per-tensor scaled fp8 weights are.
std::vector<uint8_t> WeightPattern(DType dtype, uint64_t bytes) {
  std::vector<uint8_t> out(bytes);
  uint64_t x = 0x9E3779B97F4A7C15ull;
  auto next = [&] {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    return x;
  };
  if (dtype == DType::kBF16) {
    for (uint64_t i = 0; i + 1 < bytes; i += 2) {
      const uint64_t r = next();
      const uint16_t exponent = static_cast<uint16_t>(120 + (r >> 32) % 7);
      const uint16_t v = static_cast<uint16_t>(((r >> 8) & 0x8000) | (exponent << 7) | (r & 0x7f));
      std::memcpy(&out[i], &v, 2);
    }
    return out;
  }
  const Fp8Layout& format = dtype == DType::kF8_E4M3FN ? kE4M3FN : kE5M2;
  std::vector<float> v(bytes);
  auto uniform = [&] { return (static_cast<double>(next() >> 11) + 0.5) * 0x1.0p-53; };
  float amax = 0, scale = 1;
  for (uint64_t i = 0; i < bytes; ++i) {
    const double g = std::sqrt(-2 * std::log(uniform())) * std::cos(6.283185307179586 * uniform());
    if (i % 4096 == 0) {
      scale = static_cast<float>(
          std::exp(0.5 * std::sqrt(-2 * std::log(uniform())) * std::cos(2 * uniform())));
    }
    v[i] = static_cast<float>(g) * scale;
    amax = std::max(amax, std::fabs(v[i]));
  }
  const float to_max = Fp8ToFloat(format.max_finite, format) / amax;
  for (uint64_t i = 0; i < bytes; ++i) out[i] = FloatToFp8(v[i] * to_max, format);
  return out;
}

Status Generate(const std::string& path, uint64_t target, Encoding encoding, DType dtype,
                Layout* layout_out, size_t* count) {
  const uint64_t elem = static_cast<uint64_t>(DTypeStorageBits(dtype)) / 8;
  // The layout is chosen in bf16 bytes: as many elements whatever their width.
  Layout L = ChooseLayout(target * 2 / elem);
  *layout_out = L;
  struct T {
    std::string name;
    std::vector<int64_t> shape;
  };
  std::vector<T> tensors;
  tensors.push_back({"model.embed_tokens.weight", {L.vocab, L.hidden}});
  for (int l = 0; l < L.layers; ++l) {
    std::string p = "model.layers." + std::to_string(l) + ".";
    tensors.push_back({p + "input_layernorm.weight", {L.hidden}});
    tensors.push_back({p + "self_attn.q_proj.weight", {L.hidden, L.hidden}});
    tensors.push_back({p + "self_attn.k_proj.weight", {L.kv, L.hidden}});
    tensors.push_back({p + "self_attn.v_proj.weight", {L.kv, L.hidden}});
    tensors.push_back({p + "self_attn.o_proj.weight", {L.hidden, L.hidden}});
    tensors.push_back({p + "post_attention_layernorm.weight", {L.hidden}});
    tensors.push_back({p + "mlp.gate_proj.weight", {L.ffn, L.hidden}});
    tensors.push_back({p + "mlp.up_proj.weight", {L.ffn, L.hidden}});
    tensors.push_back({p + "mlp.down_proj.weight", {L.hidden, L.ffn}});
  }
  tensors.push_back({"model.norm.weight", {L.hidden}});
  tensors.push_back({"lm_head.weight", {L.vocab, L.hidden}});
  *count = tensors.size();
  uint64_t total = 0;
  for (const T& t : tensors) total += elem * *NumElements(t.shape);

  // Values of weight-like magnitude, so compressed encodings see realistic entropy. One
  // pattern, read at shifting offsets.
  const std::vector<uint8_t> pattern = WeightPattern(dtype, uint64_t{16} << 20);
  const uint8_t* pat = pattern.data();
  const uint64_t pat_bytes = pattern.size();

  // Ctrl-C stops the generation through the writer (CatchInterrupts), whose error path
  // removes its temporary file, which no signal handler could name.
  auto interrupted = [&]() -> Status {
    int sig = InterruptSignal();
    if (sig == 0) return Status::Ok();
    return Error(StatusCode::kIoError, path, ": generation interrupted by ",
                 sig == SIGINT ? "SIGINT" : "SIGTERM");
  };
  WriterOptions wo;
  wo.durable = false;  // a scratch file
  wo.progress = [&](uint64_t) { return interrupted(); };
  FERRY_ASSIGN_OR_RETURN(Writer writer, Writer::Create(path, wo));
  Progress progress("generating", total);
  uint64_t shift = 0;
  for (const T& t : tensors) {
    uint64_t start = (shift += 4098) % (pat_bytes / 2);
    FillFn fill = [&](uint64_t offset, void* dst, size_t size) {
      FERRY_RETURN_IF_ERROR(interrupted());
      auto* out = static_cast<uint8_t*>(dst);
      for (size_t done = 0; done < size;) {
        uint64_t at = (start + offset + done) % pat_bytes / elem * elem;
        size_t n = std::min<uint64_t>(size - done, pat_bytes - at);
        std::memcpy(out + done, pat + at, n);
        done += n;
      }
      progress.Add(size);
      return Status::Ok();
    };
    FERRY_RETURN_IF_ERROR(writer.AddTensorFrom(t.name, dtype, t.shape, fill, encoding));
  }
  writer.SetMetadata("generator", "ferry bench --generate").ok();
  Status st = writer.Commit();
  progress.Finish();
  return st;
}

// Touches every page of the mapping so the timed loads read a hot page cache, as the
// ceiling does; a file read without a mapping is read through once instead.
void WarmPageCache(const Reader& reader) {
  const BlockSource& blocks = BlocksOf(reader);
  uint64_t size = reader.file_size();
  Progress progress("reading into the page cache", size);
  if (blocks.mapping() == nullptr) {
    constexpr uint64_t kChunk = uint64_t{4} << 20;
    std::vector<uint8_t> buf(std::min(size, kChunk));
    for (uint64_t off = 0; off < size; off += kChunk) {
      const uint64_t n = std::min(kChunk, size - off);
      if (!blocks.bytes().ReadAt(off, n, buf.data()).ok()) break;  // the loads will say why
      progress.Add(n);
    }
    return;
  }
  const volatile uint8_t* p = blocks.mapping()->data();
  uint8_t sink = 0;
  for (uint64_t off = 0; off < size; off += 4096) {
    sink ^= p[off];
    progress.Add(std::min<uint64_t>(4096, size - off));
  }
  (void)sink;
}

// CPUs this process may run on (taskset narrows them; hardware_concurrency does not see it).
int UsableCpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (::sched_getaffinity(0, sizeof(set), &set) == 0) return CPU_COUNT(&set);
  return static_cast<int>(std::thread::hardware_concurrency());
}

// Drops the file's pages from the page cache (written back first), so that the next read goes
// to the disk; returns the fraction still resident (1 on tmpfs, which has no disk to go to).
double EvictFromPageCache(const std::string& path, const Reader& reader) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd >= 0) {
    ::fdatasync(fd);
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    ::close(fd);
  }
  const BlockSource& blocks = BlocksOf(reader);
  if (blocks.mapping() == nullptr) return -1;
  return blocks.mapping()->ResidentFraction({{0, reader.file_size()}});
}

// Sequential O_DIRECT reads of the whole file, 16 MiB requests on 4 threads: the disk's rate,
// which a cold load is compared with (a compressed load should beat it by its ratio).
// Returns seconds, or a negative value where the file system refuses O_DIRECT.
double DirectReadSeconds(const std::string& path, uint64_t size) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_DIRECT);
  if (fd < 0) return -1;
  constexpr uint64_t kRequest = uint64_t{16} << 20;
  constexpr int kThreads = 4;
  std::atomic<uint64_t> next{0};
  std::atomic<bool> failed{false};
  double t0 = Now();
  std::vector<std::thread> pool;
  for (int t = 0; t < kThreads; ++t) {
    pool.emplace_back([&] {
      void* buf = std::aligned_alloc(4096, kRequest);
      if (buf == nullptr) {
        failed = true;
        return;
      }
      for (uint64_t off; (off = next.fetch_add(kRequest)) < size;) {
        if (::pread(fd, buf, kRequest, static_cast<off_t>(off)) < 0) failed = true;
      }
      std::free(buf);
    });
  }
  for (std::thread& t : pool) t.join();
  double secs = Now() - t0;
  ::close(fd);
  return failed ? -1 : secs;
}

struct Runs {
  std::vector<double> seconds;
  double Median() const {
    std::vector<double> s = seconds;
    std::sort(s.begin(), s.end());
    size_t n = s.size();
    return n == 0 ? 0 : n % 2 ? s[n / 2] : (s[n / 2 - 1] + s[n / 2]) / 2;
  }
  double Best() const { return *std::min_element(seconds.begin(), seconds.end()); }
};

// Every stored block of the file turned into its raw bytes by the codec alone (memcpy for raw
// blocks; zstd, unshuffle or the PLANES CPU decoder for encoded ones) in a prefaulted buffer,
// blocks taken in turn by the threads: what a host load could reach if the loader added
// nothing, and for encoded files the decode rate a load on N threads is compared with (N x the
// single-thread rate on an idle machine). The buffer holds at most 1 GiB and is reused
// round-robin (the rate does not depend on it being larger). Run() is called between loads: on
// a busy machine a ceiling measured only once can land in a quiet or a noisy moment that the
// loads did not see. A file read without a mapping has its stored blocks read, then decoded.
class HostCeiling {
 public:
  HostCeiling(const Reader& reader, uint64_t bytes) : blocks_(BlocksOf(reader)) {
    const BlockSource& blocks = blocks_;
    const Mapping* mapping = blocks.mapping().get();
    const uint64_t cap = std::max<uint64_t>(1, std::min(bytes, uint64_t{1} << 30));
    dst_.assign(cap, 1);
    uint64_t off = 0;
    for (size_t i = 0; i < reader.num_tensors(); ++i) {
      const TensorInfo info = reader.tensor(i);
      const size_t width = info.encoding == Encoding::kShuffleZstd ? ShuffleWidth(info.dtype) : 1;
      for (uint64_t b = 0; b < blocks.NumBlocks(i); ++b) {
        const StoredBlock s = blocks.Block(i, b);
        if (off % cap + s.raw_size > cap) off += cap - off % cap;
        pieces_.push_back(Piece{mapping ? mapping->data() + s.file_offset : nullptr, s.file_offset,
                                s.stored_size, s.raw_size, off % cap, s.compressed, s.planes,
                                width});
        off += s.raw_size;
        encoded_ = encoded_ || info.encoding != Encoding::kRaw;
        largest_ = std::max(largest_, s.raw_size);
        if (mapping == nullptr) largest_stored_ = std::max(largest_stored_, s.stored_size);
      }
    }
  }

  // Whether any tensor is encoded: the ceiling is then a decode rate.
  bool encoded() const { return encoded_; }
  // Whether a GPU load decodes some of the blocks on the CPU: zstd blocks (PLANES blocks expand
  // on the device, verified or not).
  bool cpu_decoded() const {
    for (const Piece& p : pieces_) {
      if (p.zstd || p.width > 1) return true;
    }
    return false;
  }

  // One timed pass over every block on `threads` threads; returns the best time so far with
  // that many threads.
  Result<double> Run(int threads) { return Pass(threads, 1); }

  // Seconds per byte of one thread over a sample of about `sample` raw bytes spread over the
  // file, best of `passes`: the single-thread decode rate without a pass over a huge file.
  Result<double> SingleThread(uint64_t sample, int passes) {
    uint64_t total = 0;
    for (const Piece& p : pieces_) total += p.raw;
    const size_t stride = std::max<uint64_t>(1, total / std::max<uint64_t>(sample, 1));
    double best = 1e30;
    for (int k = 0; k < passes; ++k) {
      FERRY_ASSIGN_OR_RETURN(double secs, Pass(1, stride));
      best = std::min(best, secs);
    }
    uint64_t sampled = 0;
    for (size_t k = 0; k < pieces_.size(); k += stride) sampled += pieces_[k].raw;
    sample_bytes_ = sampled;
    return best / static_cast<double>(sampled);
  }
  uint64_t sample_bytes() const { return sample_bytes_; }

 private:
  struct Piece {
    const uint8_t* src;  // in the mapping; null: read from the source into `stored` first
    uint64_t file_offset, stored, raw, dst_off;
    bool zstd, planes;
    size_t width;  // shuffle width (1: not shuffled)
  };

  Status Decode(const Piece& p, uint8_t* scratch, uint8_t* stored) {
    uint8_t* dst = dst_.data() + p.dst_off;
    uint8_t* out = p.width > 1 ? scratch : dst;
    const uint8_t* src = p.src;
    if (src == nullptr) {
      // Raw blocks are read straight into place, as a load without a mapping reads them.
      const bool raw = !p.planes && !p.zstd;
      uint8_t* into = raw ? out : stored;
      FERRY_RETURN_IF_ERROR(blocks_.bytes().ReadAt(p.file_offset, p.stored, into));
      if (raw) {
        if (out != dst) Unshuffle(out, dst, p.raw, p.width);
        return Status::Ok();
      }
      src = into;
    }
    Status st;
    if (p.planes) {
      st = planes::Decode(src, p.stored, dst, p.raw, scratch);
      out = dst;
    } else if (p.zstd) {
      st = ZstdDecompressExact(src, p.stored, out, p.raw);
    } else {
      std::memcpy(out, src, p.raw);
    }
    if (st.ok() && out != dst) Unshuffle(out, dst, p.raw, p.width);
    return st;
  }

  // Pieces 0, stride, 2 * stride, ...; the best time of full passes (stride 1) is kept.
  Result<double> Pass(int threads, size_t stride) {
    while (scratch_.size() < static_cast<size_t>(threads)) {
      scratch_.emplace_back(encoded_ ? largest_ : 0, uint8_t{1});  // prefaulted
      stored_.emplace_back(largest_stored_, uint8_t{1});
    }
    std::atomic<size_t> next{0};
    FirstError error;
    auto work = [&](int t) {
      for (size_t k; (k = next.fetch_add(1) * stride) < pieces_.size();) {
        Status st = Decode(pieces_[k], scratch_[t].data(), stored_[t].data());
        if (!st.ok()) error.Set(std::move(st));
      }
    };
    double t0 = Now();
    RunParts(threads, work);
    double secs = Now() - t0;
    if (error.failed()) return error.Get();
    if (stride != 1) return secs;
    double& best = best_[threads];
    best = best == 0 ? secs : std::min(best, secs);
    return best;
  }

  const BlockSource& blocks_;
  std::vector<uint8_t> dst_;
  std::vector<Piece> pieces_;
  std::vector<std::vector<uint8_t>> scratch_, stored_;
  std::map<int, double> best_;
  bool encoded_ = false;
  uint64_t largest_ = 0, largest_stored_ = 0, sample_bytes_ = 0;
};

#ifdef FERRY_HAVE_CUDA
// Pinned host-to-device copies of `bytes` in 256 MiB pieces from one cudaHostAlloc buffer,
// timed with CUDA events on the default stream: the link's practical limit.
Result<double> DeviceCeiling(uint64_t bytes, int reps) {
  const uint64_t chunk = std::min<uint64_t>(uint64_t{256} << 20, std::max<uint64_t>(bytes, 1));
  void *host = nullptr, *dev = nullptr;
  cudaEvent_t a = nullptr, b = nullptr;
  auto fail = [&](cudaError_t err, const char* what) {
    cudaGetLastError();
    if (a) cudaEventDestroy(a);
    if (b) cudaEventDestroy(b);
    if (dev) cudaFree(dev);
    if (host) cudaFreeHost(host);
    return Error(StatusCode::kCudaError, "ceiling: ", what, ": ", cudaGetErrorString(err));
  };
  cudaError_t err;
  if ((err = cudaHostAlloc(&host, chunk, cudaHostAllocDefault)) != cudaSuccess)
    return fail(err, "cudaHostAlloc");
  std::memset(host, 1, chunk);
  if ((err = cudaMalloc(&dev, chunk)) != cudaSuccess) return fail(err, "cudaMalloc");
  if ((err = cudaEventCreate(&a)) != cudaSuccess) return fail(err, "cudaEventCreate");
  if ((err = cudaEventCreate(&b)) != cudaSuccess) return fail(err, "cudaEventCreate");
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    cudaEventRecord(a, nullptr);
    for (uint64_t done = 0; done < bytes; done += chunk) {
      err = cudaMemcpyAsync(dev, host, std::min(chunk, bytes - done), cudaMemcpyHostToDevice,
                            nullptr);
      if (err != cudaSuccess) return fail(err, "cudaMemcpyAsync");
    }
    cudaEventRecord(b, nullptr);
    if ((err = cudaEventSynchronize(b)) != cudaSuccess) return fail(err, "cudaEventSynchronize");
    float ms = 0;
    cudaEventElapsedTime(&ms, a, b);
    best = std::min(best, ms / 1e3);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  cudaFree(dev);
  cudaFreeHost(host);
  return best;
}
#endif

// A destination for --prealloc, touched once so page faults stay out of the timed loads.
std::shared_ptr<void> AllocateDestination(bool gpu, uint64_t bytes) {
#ifdef FERRY_HAVE_CUDA
  if (gpu) {
    void* p = nullptr;
    if (cudaMalloc(&p, bytes) != cudaSuccess) {
      cudaGetLastError();
      return nullptr;
    }
    return std::shared_ptr<void>(p, [](void* q) { cudaFree(q); });
  }
#endif
  (void)gpu;
  void* p = std::malloc(bytes);
  if (p == nullptr) return nullptr;
  std::memset(p, 0, bytes);
  return std::shared_ptr<void>(p, std::free);
}

}  // namespace

int RunBench(const BenchOptions& options) {
  std::string path = options.file;
  std::string generated_desc;
  if (!options.generate.empty()) {
    auto size = ParseSize(options.generate);
    if (!size || *size < (uint64_t{1} << 20)) {
      std::fprintf(stderr,
                   "ferry bench: --generate %s: give a size of at least 1MiB, "
                   "like 1GiB or 512MiB\n",
                   options.generate.c_str());
      return kExitUsage;
    }
    std::string dir = PickDir(options, *size);
    std::string templ = dir + "/ferry-bench-XXXXXX";
    if (::mkdtemp(templ.data()) == nullptr) {
      return Fail(Error(StatusCode::kIoError, templ, ": mkdtemp failed ", ErrnoText(errno)));
    }
    path = templ + "/bench.ferry";
    // Until the file is complete, a signal is recorded and stops the writer (which removes
    // its temporary file); the folder goes at exit. Afterwards the file and the folder are
    // all there is to remove, and a signal removes them at once (unless --keep).
    std::snprintf(g_cleanup_dir, sizeof(g_cleanup_dir), "%s", templ.c_str());
    std::atexit(RemoveGenerated);
    CatchInterrupts();
    Layout layout;
    size_t count = 0;
    double t0 = Now();
    const Encoding encoding = ParseEncoding(options.encoding).value_or(Encoding::kRaw);
    const DType dtype = options.dtype == "f8_e4m3"   ? DType::kF8_E4M3FN
                        : options.dtype == "f8_e5m2" ? DType::kF8_E5M2
                                                     : DType::kBF16;
    Status st = Generate(path, *size, encoding, dtype, &layout, &count);
    if (!st.ok()) {
      Fail(st);
      ::unlink(path.c_str());  // a commit that failed after its rename
      return InterruptSignal() != 0 ? 128 + InterruptSignal() : kExitFailure;
    }
    if (options.keep) {
      g_cleanup_dir[0] = '\0';
    } else {
      std::snprintf(g_cleanup_file, sizeof(g_cleanup_file), "%s", path.c_str());
      std::signal(SIGINT, OnSignal);
      std::signal(SIGTERM, OnSignal);
    }
    if (InterruptSignal() != 0) {  // arrived after the last block was written
      std::fprintf(stderr, "ferry: bench interrupted by %s\n",
                   InterruptSignal() == SIGINT ? "SIGINT" : "SIGTERM");
      return 128 + InterruptSignal();
    }
    generated_desc =
        StrCat(", generated in ", static_cast<int>((Now() - t0) * 1000), " ms: ", count, " ",
               options.dtype, " tensors, llama-like: hidden ", layout.hidden, ", ffn ", layout.ffn,
               ", kv ", layout.kv, ", ", layout.layers, " layers, vocab ", layout.vocab);
  }

  const bool remote = IsRemoteName(path);
  if (remote && options.cold) {
    std::fprintf(stderr,
                 "ferry bench: --cold evicts a local file from the page cache; %s is read from "
                 "its server on every load\n",
                 Printable(PrintableUrl(path)).c_str());
    return kExitUsage;
  }
  auto opened = Reader::Open(path);
  if (!opened.ok()) return Fail(opened.status());
  const Reader& reader = **opened;
  uint64_t bytes = 0, stored = 0;
  std::map<std::string, uint64_t> by_encoding;  // raw bytes per encoding
  for (size_t i = 0; i < reader.num_tensors(); ++i) {
    const TensorRecord t = BlocksOf(reader).Record(i);
    bytes += t.nbytes;
    stored += t.data_size;
    by_encoding[EncodingName(t.encoding)] += t.nbytes;
  }
  double resident_before = 1;
  if (options.cold) {
    resident_before = EvictFromPageCache(path, reader);
  } else if (!remote) {  // an object is fetched again by every load: nothing to warm
    WarmPageCache(reader);
  }

  LoaderOptions lo;
  lo.threads = options.threads;
  lo.slot_bytes = static_cast<uint64_t>(options.slot_mib) << 20;
  lo.staging_bytes = static_cast<uint64_t>(options.staging_mib) << 20;
  lo.host_path = options.path == "staging"            ? HostPath::kStaging
                 : options.path == "register"         ? HostPath::kRegister
                 : options.path == "register-windows" ? HostPath::kRegisterWindows
                                                      : HostPath::kAuto;
  lo.io = options.io == "page-cache" ? IoMode::kPageCache
          : options.io == "direct"   ? IoMode::kDirect
                                     : IoMode::kAuto;
  lo.verify = options.verify;
  int threads = options.threads > 0 ? options.threads : DefaultThreads(8);

#ifdef FERRY_HAVE_CUDA
  if (options.device >= 0) {
    cudaError_t err = cudaSetDevice(options.device);
    if (err != cudaSuccess) {
      return Fail(Error(StatusCode::kCudaError, "cudaSetDevice(", options.device,
                        "): ", cudaGetErrorString(err)));
    }
  }
#else
  if (options.device >= 0) {
    return Fail(Error(StatusCode::kUnimplemented, "--device: this build has no CUDA support"));
  }
#endif
  const bool gpu = CudaAvailable();
  if (options.device >= 0 && !gpu) {
    return Fail(
        Error(StatusCode::kCudaError, "--device ", options.device, ": no usable CUDA device"));
  }

  std::string target = "host memory (no usable CUDA device: Loader::LoadToHost)";
#ifdef FERRY_HAVE_CUDA
  if (gpu) {
    int dev = 0;
    cudaGetDevice(&dev);
    cudaDeviceProp prop{};
    cudaGetDeviceProperties(&prop, dev);
    target = StrCat("GPU ", dev, ": ", prop.name, " (current device), default stream");
  }
#endif

  auto loader_or = Loader::Create(lo);
  if (!loader_or.ok()) return Fail(loader_or.status());
  Loader& loader = **loader_or;
  std::vector<LoadRequest> requests;
  std::vector<std::shared_ptr<void>> buffers;
  if (options.prealloc) {
    for (size_t i = 0; i < reader.num_tensors(); ++i) {
      TensorInfo t = reader.tensor(i);
      LoadRequest q;
      q.name = t.name;
      q.dst_bytes = t.nbytes;
      if (t.nbytes > 0) {
        std::shared_ptr<void> buf = AllocateDestination(gpu, t.nbytes);
        if (!buf) {
          return Fail(Error(StatusCode::kResourceExhausted, "cannot allocate ", t.nbytes,
                            " bytes for ", Quote(t.name), gpu ? " on the GPU" : ""));
        }
        q.dst = buf.get();
        buffers.push_back(std::move(buf));
      }
      requests.push_back(std::move(q));
    }
  }
  auto load_once = [&]() -> Result<double> {
    double t0 = Now();
    auto out = gpu ? loader.Load(reader, requests) : loader.LoadToHost(reader, requests);
    double secs = Now() - t0;
    if (!out.ok()) return out.status();
    return secs;  // `out` frees the tensors here, outside the timed region
  };

  std::printf("checkpoint  %s (%s, %zu tensors%s)\n", path.c_str(), HumanBytes(bytes).c_str(),
              reader.num_tensors(), generated_desc.c_str());
  std::printf("target      %s\n", target.c_str());
  std::string encodings;
  for (const auto& [name, raw] : by_encoding) {
    encodings += StrCat(encodings.empty() ? "" : ", ", name, " ", HumanBytes(raw));
  }
  std::printf("stored      %s for %s of tensors: ratio %.3fx (%s)\n", HumanBytes(stored).c_str(),
              HumanBytes(bytes).c_str(), stored ? static_cast<double>(bytes) / stored : 0.0,
              encodings.c_str());
  std::printf("read        %s\n", Printable(BlocksOf(reader).bytes().Describe()).c_str());
  std::string threads_desc =
      options.threads > 0 ? std::to_string(options.threads) : std::string("auto");
  std::printf("loader      threads %s, slot %d MiB, staging %d MiB, path %s, io %s%s, %s\n",
              threads_desc.c_str(), options.slot_mib, options.staging_mib, options.path.c_str(),
              options.io.c_str(), options.verify ? ", verifying checksums" : "",
              options.prealloc ? "into preallocated buffers" : "the loader allocates");
  std::fflush(stdout);

  // The codec alone on the same blocks: the ceiling of host loads; beside a GPU load, the rate
  // its CPU decoding is bound by (zstd blocks; PLANES blocks decode on the GPU unless verified).
  auto host_ceiling = std::make_unique<HostCeiling>(reader, bytes);
  if (gpu && !host_ceiling->cpu_decoded()) host_ceiling.reset();
  // Loads of mostly encoded tensors run on the whole pool, copies on at most `threads`.
  const int ceiling_threads =
      host_ceiling && host_ceiling->encoded() ? loader.options().threads : threads;

  auto warm = load_once();
  if (!warm.ok()) return Fail(warm.status());
  if (options.cold) {
    std::printf(
        "cold        %.3f s  %s  (first load, from the disk: %.0f%% of the file in the "
        "page cache before it%s)\n",
        *warm, Rate(bytes, *warm).c_str(), std::max(0.0, resident_before) * 100,
        loader.last_stats().used_direct_io ? "; O_DIRECT reads" : "");
    WarmPageCache(reader);
  } else {
    std::printf("warm-up     %.3f s  %s  (first load%s)\n", *warm, Rate(bytes, *warm).c_str(),
                gpu ? ": includes pinned staging set-up" : "");
  }
  Runs runs;
  for (int r = 0; r < options.repeat; ++r) {
    auto secs = load_once();
    if (!secs.ok()) return Fail(secs.status());
    runs.seconds.push_back(*secs);
    if (host_ceiling) {
      auto c = host_ceiling->Run(ceiling_threads);
      if (!c.ok()) return Fail(c.status());
    }
    std::printf("run %d/%d     %.3f s  %s\n", r + 1, options.repeat, *secs,
                Rate(bytes, *secs).c_str());
    std::fflush(stdout);
  }
  LoadStats stats = loader.last_stats();
  double median = runs.Median(), best = runs.Best();
  std::printf("load        median %s, best %s (%s per load", Rate(bytes, median).c_str(),
              Rate(bytes, best).c_str(), HumanBytes(bytes).c_str());
  if (gpu) {
    std::printf(", %llu copies, %s pinned, %s", static_cast<unsigned long long>(stats.copies),
                HumanBytes(stats.pinned_bytes).c_str(),
                stats.used_register ? "registered page cache" : "staging ring");
  }
  if (stats.used_direct_io) std::printf(", O_DIRECT reads");
  std::printf(")\n");

  double ceiling_secs = 0;
  std::string ceiling_desc;
#ifdef FERRY_HAVE_CUDA
  if (gpu) {
    auto c = DeviceCeiling(bytes, 3);
    if (!c.ok()) return Fail(c.status());
    ceiling_secs = *c;
    ceiling_desc =
        "pinned cudaMemcpyAsync host-to-device, 256 MiB chunks from cudaHostAlloc, "
        "timed with CUDA events";
  }
#endif
  if (!gpu) {
    auto c = host_ceiling->Run(ceiling_threads);
    if (!c.ok()) return Fail(c.status());
    ceiling_secs = *c;
    ceiling_desc = StrCat(host_ceiling->encoded() ? "decode of the same blocks by the codec alone"
                                                  : "memcpy of the same bytes",
                          ", ", ceiling_threads, ceiling_threads == 1 ? " thread" : " threads",
                          ", page cache to a prefaulted buffer, best of ", options.repeat + 1,
                          " passes between the loads");
  }
  std::printf("ceiling     %s  %s\n", Rate(bytes, ceiling_secs).c_str(), ceiling_desc.c_str());
  std::printf("ratio       %.2f of the ceiling (best run %.2f)\n", ceiling_secs / median,
              ceiling_secs / best);
  if (host_ceiling && host_ceiling->encoded()) {
    // N x the single-thread rate: what N threads reach when nothing else runs.
    auto per_byte = host_ceiling->SingleThread(uint64_t{512} << 20, 3);
    auto all = host_ceiling->Run(ceiling_threads);
    if (!per_byte.ok()) return Fail(per_byte.status());
    if (!all.ok()) return Fail(all.status());
    const double single = 1.0 / *per_byte, n = ceiling_threads;
    std::printf(
        "decode      1 thread %s (best of 3 passes over %s of the blocks), %d thread%s %s\n",
        Rate(1, *per_byte).c_str(), HumanBytes(host_ceiling->sample_bytes()).c_str(),
        ceiling_threads, ceiling_threads == 1 ? "" : "s", Rate(bytes, *all).c_str());
    std::printf(
        "ratio       %.2f of %d x the 1-thread decode (best run %.2f), %.2f of the %d-thread "
        "decode\n",
        bytes / median / (n * single), ceiling_threads, bytes / best / (n * single), *all / median,
        ceiling_threads);
  }
  if (stats.used_direct_io) {
    std::printf(
        "note        the loads read with O_DIRECT, so the disk bounds them, not the "
        "ceiling above\n");
  }
  double disk_secs = 0;
  if (options.cold) {
    disk_secs = DirectReadSeconds(path, reader.file_size());
    if (disk_secs > 0) {
      std::printf(
          "disk        %s of stored bytes (O_DIRECT, 16 MiB reads, 4 threads); the cold "
          "load ran at %.2fx of it\n",
          Rate(reader.file_size(), disk_secs).c_str(), disk_secs / *warm);
    } else {
      std::printf("disk        no O_DIRECT on this file system: no disk rate to compare with\n");
    }
  }
  // One line per run for scripts: decimal GB/s of tensor bytes.
  std::printf("summary     ratio=%.3f cpus=%d first=%.2f hot=%.2f ceiling=%.2f hot/ceiling=%.3f",
              stored ? static_cast<double>(bytes) / stored : 0.0, UsableCpus(), bytes / *warm / 1e9,
              bytes / median / 1e9, bytes / ceiling_secs / 1e9, ceiling_secs / median);
  if (options.cold) {
    std::printf(" cold_first/disk=%.3f", disk_secs > 0 ? disk_secs / *warm : 0.0);
  }
  std::printf("\n");
  if (options.keep && !options.generate.empty()) std::printf("kept        %s\n", path.c_str());
  return kExitOk;
}

}  // namespace ferry::cli
