// Distributed loading on two GPUs, one process per GPU (each with its own current device),
// communicating through NCCL the way a training job does.
//
//   distributed_bench check DIR        correctness on a small sharded checkpoint: every tensor
//                                      bit-exact on both ranks, row ranges, caller buffers,
//                                      tensor-parallel local slices, plan mismatches fail on
//                                      every rank instead of hanging, NVML shows each process
//                                      on its own GPU only
//   distributed_bench bench [--gib=8] [--hot-dir=/dev/shm] [--cold-dir=/var/tmp] [--iters=3]
//                           [--no-cold] [--keep] [--nccl=PATH] [--ranks=2] [--threads=N]
//                           [--rounds=K] [--remote=URL]
//                                      the throughput comparison, hot and cold, with the same
//                                      bit-exact and NVML checks; prints a table. --remote: the
//                                      same checkpoint at an s3:// or http(s):// URL (put there
//                                      by the caller, e.g. after a --keep run) loaded
//                                      distributed too, with the bytes each rank fetched from
//                                      the server (counted in its byte source)
//
// The parent process only writes checkpoints (host memory, no CUDA context), passes the NCCL
// unique id from rank 0 to the others through a pipe, and collects results. Children run with
// NCCL_NVLS_ENABLE=0 (the H200 machines require NVLink multicast off). Exit status: 0 when every
// check passes (throughput goals are reported, not enforced: this is a benchmark), 1 on a
// failure, 77 when there are fewer GPUs than ranks or no NCCL library.
#include <cuda_runtime.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "dist/dist_plan.hpp"
#include "ferry/distributed.hpp"
#include "format/block_source.hpp"
#include "io/source.hpp"
#include "nccl_probe.hpp"
#include "nvml_probe.hpp"
#include "observed_source.hpp"
#include "test_util.hpp"

namespace {

using namespace ferry;
using Clock = std::chrono::steady_clock;

constexpr int kSkip = 77;

// ---- options ------------------------------------------------------------------------------

struct Options {
  std::string mode;  // check | bench
  std::string dir;   // check: scratch directory
  double gib = 8;
  std::string hot_dir = "/dev/shm";
  std::string cold_dir = "/var/tmp";
  std::string results;  // where children write their figures (set by the parent)
  std::string nccl;
  int iters = 3;
  int ranks = 2;
  int threads = 0;     // loader worker threads (0: the loader's default)
  int rounds = 4;      // DistributedOptions::rounds
  std::string remote;  // the checkpoint's copy on a server ("": no remote rows)
  bool cold = true;
  bool keep = false;
  std::vector<std::string> raw;  // as given, for the children
};

bool ParseOptions(int argc, char** argv, int first, Options* o) {
  for (int i = first; i < argc; ++i) {
    std::string a = argv[i];
    o->raw.push_back(a);
    auto val = [&](const char* key) -> const char* {
      size_t n = std::strlen(key);
      return a.compare(0, n, key) == 0 ? a.c_str() + n : nullptr;
    };
    if (const char* v = val("--gib=")) {
      o->gib = std::atof(v);
    } else if (const char* v = val("--hot-dir=")) {
      o->hot_dir = v;
    } else if (const char* v = val("--cold-dir=")) {
      o->cold_dir = v;
    } else if (const char* v = val("--results=")) {
      o->results = v;
    } else if (const char* v = val("--nccl=")) {
      o->nccl = v;
    } else if (const char* v = val("--iters=")) {
      o->iters = std::max(1, std::atoi(v));
    } else if (const char* v = val("--ranks=")) {
      o->ranks = std::max(2, std::atoi(v));
    } else if (const char* v = val("--threads=")) {
      o->threads = std::max(0, std::atoi(v));
    } else if (const char* v = val("--rounds=")) {
      o->rounds = std::max(1, std::atoi(v));
    } else if (const char* v = val("--remote=")) {
      o->remote = v;
    } else if (a == "--no-cold") {
      o->cold = false;
    } else if (a == "--keep") {
      o->keep = true;
    } else if (o->mode == "check" && o->dir.empty() && a.rfind("--", 0) != 0) {
      o->dir = a;
    } else {
      std::fprintf(stderr, "unknown argument %s\n", a.c_str());
      return false;
    }
  }
  return true;
}

// ---- deterministic contents ---------------------------------------------------------------

uint64_t Mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// A tensor's seed from its name (FNV-1a): parent and children agree without sharing state.
uint64_t SeedOf(const std::string& name) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : name) h = (h ^ c) * 1099511628211ull;
  return Mix(h);
}

// Bytes [offset, offset + n) of the tensor with this seed: byte i is byte i % 8 of
// Mix(seed + i / 8).
void Generate(uint64_t seed, uint64_t offset, uint8_t* dst, size_t n) {
  while (n > 0 && offset % 8 != 0) {
    uint64_t v = Mix(seed + offset / 8);
    *dst++ = static_cast<uint8_t>(v >> (8 * (offset % 8)));
    ++offset;
    --n;
  }
  while (n >= 8) {
    uint64_t v = Mix(seed + offset / 8);
    std::memcpy(dst, &v, 8);
    dst += 8;
    offset += 8;
    n -= 8;
  }
  if (n > 0) {
    uint64_t v = Mix(seed + offset / 8);
    std::memcpy(dst, &v, n);
  }
}

struct Spec {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  Encoding encoding = Encoding::kRaw;
  std::vector<int64_t> global_shape, shard_offset;
  uint64_t bytes() const { return *StorageBytes(dtype, *NumElements(shape)); }
};

// A llama-like bf16 model of about `gib` GiB: hidden 4096, MLP 14336, vocabulary 32000.
std::vector<Spec> ModelSpecs(double gib) {
  const int64_t h = 4096, inter = 14336, vocab = 32000;
  const double per_layer = 2.0 * (4 * h * h + 3 * inter * h + 2 * h);
  const double fixed = 2.0 * (2 * vocab * h + h);
  int layers = std::max(1, static_cast<int>(std::lround((gib * 1073741824.0 - fixed) / per_layer)));
  std::vector<Spec> s;
  s.push_back({"model.embed_tokens.weight", DType::kBF16, {vocab, h}});
  for (int l = 0; l < layers; ++l) {
    std::string p = "model.layers." + std::to_string(l) + ".";
    for (const char* m : {"q_proj", "k_proj", "v_proj", "o_proj"}) {
      s.push_back({p + "self_attn." + m + ".weight", DType::kBF16, {h, h}});
    }
    s.push_back({p + "mlp.gate_proj.weight", DType::kBF16, {inter, h}});
    s.push_back({p + "mlp.up_proj.weight", DType::kBF16, {inter, h}});
    s.push_back({p + "mlp.down_proj.weight", DType::kBF16, {h, inter}});
    s.push_back({p + "input_layernorm.weight", DType::kBF16, {h}});
    s.push_back({p + "post_attention_layernorm.weight", DType::kBF16, {h}});
  }
  s.push_back({"model.norm.weight", DType::kBF16, {h}});
  s.push_back({"lm_head.weight", DType::kBF16, {vocab, h}});
  return s;
}

uint64_t TotalBytes(const std::vector<Spec>& specs) {
  uint64_t n = 0;
  for (const Spec& s : specs) n += s.bytes();
  return n;
}

Status WriteCheckpoint(const std::string& path, const std::vector<Spec>& specs, bool durable,
                       const std::string& tag) {
  WriterOptions o;
  o.durable = durable;
  auto created = Writer::Create(path, o);
  if (!created.ok()) return created.status();
  Writer w = std::move(created).value();
  for (const Spec& s : specs) {
    uint64_t seed = SeedOf(s.name);
    FillFn fill = [seed](uint64_t off, void* dst, size_t n) {
      Generate(seed, off, static_cast<uint8_t*>(dst), n);
      return Status::Ok();
    };
    Status st = w.AddTensorFrom(s.name, s.dtype, s.shape, fill, s.encoding);
    if (st.ok() && !s.global_shape.empty())
      st = w.SetGlobalSlice(s.name, s.global_shape, s.shard_offset);
    if (!st.ok()) return st;
  }
  Status st = w.SetMetadata("distributed_bench", tag);
  if (!st.ok()) return st;
  return w.Commit();
}

// ---- checks on device data ----------------------------------------------------------------

// Copies device tensors back through a pinned buffer and compares them with the generator.
class Checker {
 public:
  explicit Checker(cudaStream_t stream) : stream_(stream) {
    if (cudaMallocHost(&host_, kChunk) != cudaSuccess) host_ = nullptr;
  }
  ~Checker() {
    if (host_) cudaFreeHost(host_);
  }
  // `begin`: offset of the loaded bytes inside the generated tensor (row ranges).
  bool Matches(const LoadedTensor& t, uint64_t seed, uint64_t begin) {
    if (host_ == nullptr) return false;
    for (uint64_t off = 0; off < t.nbytes; off += kChunk) {
      size_t n = static_cast<size_t>(std::min<uint64_t>(kChunk, t.nbytes - off));
      if (cudaMemcpyAsync(host_, static_cast<const uint8_t*>(t.data) + off, n,
                          cudaMemcpyDeviceToHost, stream_) != cudaSuccess ||
          cudaStreamSynchronize(stream_) != cudaSuccess) {
        return false;
      }
      if (!CompareParallel(host_, n, seed, begin + off)) return false;
    }
    return true;
  }

 private:
  static constexpr size_t kChunk = size_t{256} << 20;
  static bool CompareParallel(const uint8_t* data, size_t n, uint64_t seed, uint64_t offset) {
    const int threads = n < (size_t{8} << 20) ? 1 : 8;
    std::vector<char> ok(threads, 1);
    std::vector<std::thread> pool;
    for (int k = 0; k < threads; ++k) {
      pool.emplace_back([&, k] {
        size_t b = n * k / threads, e = n * (k + 1) / threads;
        std::vector<uint8_t> want(size_t{1} << 20);
        for (size_t p = b; p < e && ok[k]; p += want.size()) {
          size_t m = std::min(want.size(), e - p);
          Generate(seed, offset + p, want.data(), m);
          if (std::memcmp(want.data(), data + p, m) != 0) ok[k] = 0;
        }
      });
    }
    for (auto& t : pool) t.join();
    return std::all_of(ok.begin(), ok.end(), [](char c) { return c != 0; });
  }
  cudaStream_t stream_;
  uint8_t* host_ = nullptr;
};

// NVML: this process on its own GPU and on no other.
bool NvmlOwnGpuOnly(int device, int rank, std::string* report) {
  testing::NvmlProbe nvml;
  if (!nvml.ok()) {
    *report = "NVML unavailable";
    return false;
  }
  char bus[32] = {};
  if (cudaDeviceGetPCIBusId(bus, sizeof(bus), device) != cudaSuccess) return false;
  int own = nvml.IndexOfBusId(bus);
  unsigned pid = static_cast<unsigned>(getpid());
  bool ok = own >= 0;
  std::ostringstream out;
  out << "rank " << rank << " (pid " << pid << ", CUDA device " << device << " = NVML GPU " << own
      << "):";
  for (unsigned g = 0; g < nvml.DeviceCount(); ++g) {
    bool present = nvml.HasProcess(g, pid);
    out << " GPU" << g << (present ? " PRESENT" : " absent");
    if (present != (static_cast<int>(g) == own)) ok = false;
  }
  *report = out.str();
  return ok;
}

// ---- the per-rank process -----------------------------------------------------------------

struct Child {
  int rank = 0, nranks = 2, device = 0;
  Options opts;
  testing::NcclProbe* nccl = nullptr;
  ncclComm* comm = nullptr;
  cudaStream_t stream = nullptr;
  float* barrier = nullptr;
  std::map<std::string, std::vector<double>> results;
  int failures = 0;

  void Fail(const std::string& what) {
    std::printf("[rank %d] FAIL %s\n", rank, what.c_str());
    std::fflush(stdout);
    ++failures;
  }
  void Note(const std::string& what) {
    std::printf("[rank %d] %s\n", rank, what.c_str());
    std::fflush(stdout);
  }
  bool Barrier() {
    return nccl->all_reduce(barrier, barrier, 1, testing::NcclProbe::kFloat32,
                            testing::NcclProbe::kSum, comm, stream) == 0 &&
           cudaStreamSynchronize(stream) == cudaSuccess;
  }
};

#define CHILD_CHECK(cond, what) \
  do {                          \
    if (!(cond)) {              \
      c.Fail(what);             \
      return 1;                 \
    }                           \
  } while (0)

int SetUpChild(Child& c, int fd_read, int fd_write) {
  // The program picks its device, as any framework does; the library only follows it.
  CHILD_CHECK(cudaSetDevice(c.device) == cudaSuccess, "cudaSetDevice");
  testing::NcclProbe::UniqueId id{};
  if (c.rank == 0) {
    CHILD_CHECK(c.nccl->get_unique_id(&id) == 0, "ncclGetUniqueId");
    for (int r = 1; r < c.nranks; ++r) {
      CHILD_CHECK(write(fd_write, &id, sizeof(id)) == static_cast<ssize_t>(sizeof(id)),
                  "sending the NCCL id");
    }
  } else {
    size_t got = 0;
    while (got < sizeof(id)) {
      ssize_t n = read(fd_read, reinterpret_cast<char*>(&id) + got, sizeof(id) - got);
      CHILD_CHECK(n > 0, "receiving the NCCL id");
      got += static_cast<size_t>(n);
    }
  }
  close(fd_read);
  close(fd_write);
  int rc = c.nccl->comm_init_rank(&c.comm, c.nranks, id, c.rank);
  CHILD_CHECK(rc == 0, std::string("ncclCommInitRank: ") + c.nccl->error_string(rc));
  CHILD_CHECK(cudaStreamCreateWithFlags(&c.stream, cudaStreamNonBlocking) == cudaSuccess, "stream");
  CHILD_CHECK(cudaMalloc(&c.barrier, sizeof(float)) == cudaSuccess, "barrier buffer");
  // Keep freed device memory in the pool, as a framework's caching allocator does, so repeated
  // loads measure loading rather than the driver mapping fresh memory (same for every mode).
  cudaMemPool_t pool;
  uint64_t keep = UINT64_MAX;
  CHILD_CHECK(
      cudaDeviceGetDefaultMemPool(&pool, c.device) == cudaSuccess &&
          cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep) == cudaSuccess,
      "memory pool");
  return 0;
}

void TearDownChild(Child& c) {
  if (c.barrier) cudaFree(c.barrier);
  if (c.stream) cudaStreamDestroy(c.stream);
  if (c.comm) c.nccl->comm_destroy(c.comm);
}

std::map<std::string, Spec> ByName(const std::vector<Spec>& specs) {
  std::map<std::string, Spec> m;
  for (const Spec& s : specs) m.emplace(s.name, s);
  return m;
}

// Every loaded tensor equals the generator's bytes (from row `row0` on).
int CheckAll(Child& c, Checker& check, const std::vector<LoadedTensor>& out,
             const std::map<std::string, Spec>& specs, const std::string& label) {
  int bad = 0;
  for (const LoadedTensor& t : out) {
    auto it = specs.find(t.info.name);
    if (it == specs.end() || t.device != c.device || !check.Matches(t, SeedOf(t.info.name), 0) ||
        t.nbytes != it->second.bytes()) {
      if (bad++ < 5) c.Fail(label + ": tensor " + t.info.name + " differs");
    }
  }
  return bad;
}

// ---- check mode ---------------------------------------------------------------------------

std::vector<Spec> CheckShardA() {
  std::vector<Spec> s = {
      {"big", DType::kBF16, {1000, 1536}},
      {"fp4_odd", DType::kF4_E2M1FN, {3, 5}},
      {"scalar", DType::kI64, {}},
      {"empty", DType::kF32, {0, 8}},
      {"zstd", DType::kBF16, {300, 1024}, Encoding::kShuffleZstd},
      {"tp.w", DType::kBF16, {64, 256}, Encoding::kRaw, {128, 256}, {64, 0}},
  };
  return s;
}

std::vector<Spec> CheckShardB() {
  std::vector<Spec> s = {{"emb", DType::kF32, {4096, 256}}};
  for (int i = 0; i < 300; ++i) s.push_back({"tiny." + std::to_string(i), DType::kU8, {1 + i * 7}});
  return s;
}

int ChildCheck(Child& c) {
  std::vector<Spec> a = CheckShardA(), b = CheckShardB();
  std::vector<Spec> all = a;
  all.insert(all.end(), b.begin(), b.end());
  auto specs = ByName(all);
  const uint64_t total = TotalBytes(all);
  Checker check(c.stream);
  auto ck = ShardedCheckpoint::Open(c.opts.dir + "/model.ferry.index.json");
  CHILD_CHECK(ck.ok(), "open index: " + ck.status().ToString());
  auto single = Reader::Open(c.opts.dir + "/a.ferry");
  CHILD_CHECK(single.ok(), "open a.ferry");

  // 1. Everything, sharded, default options.
  auto dl = DistributedLoader::Create(c.comm);
  CHILD_CHECK(dl.ok(), "create: " + dl.status().ToString());
  CHILD_CHECK((*dl)->rank() == c.rank && (*dl)->nranks() == c.nranks, "rank and size");
  auto out = (*dl)->Load(**ck, {}, c.stream);
  CHILD_CHECK(out.ok(), "load all: " + out.status().ToString());
  CHILD_CHECK(out->size() == all.size(), "tensor count");
  if (CheckAll(c, check, *out, specs, "sharded, all tensors") == 0) {
    DistributedStats st = (*dl)->last_stats();
    c.Note("sharded checkpoint, " + std::to_string(out->size()) + " tensors: bit-exact; read " +
           std::to_string(st.bytes_read) + " of " + std::to_string(total) + " bytes, received " +
           std::to_string(st.bytes_received) + ", " + std::to_string(st.broadcasts) +
           " broadcasts");
    if (st.bytes_read + st.bytes_received != total) c.Fail("byte accounting");
    if (st.bytes_read > total * 0.6 || st.bytes_read < total * 0.4) c.Fail("unbalanced split");
  }
  for (const LoadedTensor& t : *out) {
    if (t.info.name == "tp.w" && (t.info.global_shape != std::vector<int64_t>{128, 256} ||
                                  t.info.shard_offset != std::vector<int64_t>{64, 0})) {
      c.Fail("global slice fields of tp.w");
    }
  }
  out->clear();

  // 2. Rows, a caller buffer, local tensor-parallel slices, uncuttable tensors.
  void* emb_buf = nullptr;
  const uint64_t emb_bytes = specs["emb"].bytes();
  CHILD_CHECK(cudaMalloc(&emb_buf, emb_bytes) == cudaSuccess, "cudaMalloc");
  std::vector<DistributedRequest> reqs(6);
  reqs[0].name = "big";
  reqs[0].row_begin = 10;
  reqs[0].row_end = 999;
  reqs[1].name = "emb";
  reqs[1].dst = emb_buf;
  reqs[1].dst_bytes = emb_bytes;
  reqs[2].name = "big";  // this rank's half of the rows only
  reqs[2].row_begin = 500 * c.rank;
  reqs[2].row_end = 500 * (c.rank + 1) > 1000 ? 1000 : 500 * (c.rank + 1);
  reqs[2].local = true;
  reqs[3].name = "fp4_odd";
  reqs[3].local = true;
  reqs[4].name = "scalar";
  reqs[5].name = "empty";
  // Replicated requests may come in any order; local ones may differ between ranks.
  if (c.rank == 1) std::swap(reqs[0], reqs[4]);
  for (int rounds : {1, 4}) {
    DistributedOptions o;
    o.rounds = rounds;
    auto dl2 = DistributedLoader::Create(c.comm, o);
    CHILD_CHECK(dl2.ok(), "create");
    auto part = (*dl2)->Load(**ck, reqs, c.stream);
    CHILD_CHECK(part.ok(), "mixed requests: " + part.status().ToString());
    int bad = 0;
    for (size_t k = 0; k < reqs.size(); ++k) {
      const LoadedTensor& t = (*part)[k];
      const Spec& s = specs[reqs[k].name];
      uint64_t row_bytes = s.shape.empty() || s.shape[0] == 0 ? 0 : s.bytes() / s.shape[0];
      uint64_t begin = reqs[k].row_begin * row_bytes;
      uint64_t end = reqs[k].row_end < 0 ? s.bytes() : reqs[k].row_end * row_bytes;
      bool ok = t.nbytes == end - begin && check.Matches(t, SeedOf(s.name), begin) &&
                (reqs[k].dst == nullptr || t.data == reqs[k].dst);
      if (!ok && bad++ < 5)
        c.Fail("mixed requests, rounds " + std::to_string(rounds) + ": " + s.name);
    }
    if (bad == 0)
      c.Note("rows, caller buffer, local slices, rounds " + std::to_string(rounds) + ": bit-exact");
  }
  cudaFree(emb_buf);

  // 3. A single file, asynchronously, then the caller's own stream synchronization.
  auto as = (*dl)->LoadAsync(**single, {}, c.stream);
  CHILD_CHECK(as.ok(), "load async: " + as.status().ToString());
  CHILD_CHECK(cudaStreamSynchronize(c.stream) == cudaSuccess, "sync");
  if (CheckAll(c, check, *as, specs, "single file, LoadAsync") == 0) {
    c.Note("single file, LoadAsync: bit-exact");
  }
  as->clear();

  // 4. Ranks that disagree fail on every rank instead of hanging, and the loader stays usable.
  DistributedRequest mine;
  mine.name = c.rank == 0 ? "big" : "emb";
  auto mismatch = (*dl)->Load(**ck, {mine}, c.stream);
  if (mismatch.ok() || mismatch.status().code() != StatusCode::kInvalidArgument) {
    c.Fail("disagreeing ranks: " + mismatch.status().ToString());
  } else {
    c.Note("disagreeing requests rejected on this rank: " + mismatch.status().message());
  }
  mine.name = c.rank == 0 ? "big" : "no.such.tensor";
  auto missing = (*dl)->Load(**ck, {mine}, c.stream);
  StatusCode want = c.rank == 0 ? StatusCode::kInvalidArgument : StatusCode::kNotFound;
  if (missing.ok() || missing.status().code() != want) {
    c.Fail("one rank failing to plan: " + missing.status().ToString());
  } else {
    c.Note("one rank failing to plan: " + std::string(StatusCodeName(want)) + " here, no hang");
  }
  auto again = (*dl)->Load(**ck, {}, c.stream);
  CHILD_CHECK(again.ok(), "load after failures: " + again.status().ToString());
  if (CheckAll(c, check, *again, specs, "after failures") == 0)
    c.Note("load after failures: bit-exact");
  again->clear();

  std::string report;
  bool own = NvmlOwnGpuOnly(c.device, c.rank, &report);
  c.Note("NVML " + report);
  if (!own) c.Fail("NVML: this process appears on another GPU (or NVML is unavailable)");
  return c.failures == 0 ? 0 : 1;
}

// ---- bench mode ---------------------------------------------------------------------------

std::string DropCaches(const std::string& path, bool global) {
  // Clean pages of this file go with fadvise (no privilege needed); drop_caches as root too.
  int fd = open(path.c_str(), O_RDONLY);
  if (fd >= 0) {
    posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    close(fd);
  }
  if (!global) return "";
  sync();
  std::ofstream out("/proc/sys/vm/drop_caches");
  out << "3\n";
  out.flush();
  return out.good() ? "drop_caches + fadvise" : "fadvise(DONTNEED) only (not root)";
}

double Resident(const std::string& path) {
  int fd = open(path.c_str(), O_RDONLY);
  if (fd < 0) return -1;
  struct stat st {};
  fstat(fd, &st);
  size_t size = static_cast<size_t>(st.st_size);
  void* p = mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) return -1;
  size_t pages = (size + 4095) / 4096;
  std::vector<unsigned char> vec(pages);
  double frac = -1;
  if (mincore(p, size, vec.data()) == 0) {
    size_t in = 0;
    for (unsigned char v : vec) in += v & 1;
    frac = static_cast<double>(in) / static_cast<double>(pages);
  }
  munmap(p, size);
  return frac;
}

int ChildBench(Child& c) {
  const std::vector<Spec> specs = ModelSpecs(c.opts.gib);
  const auto by_name = ByName(specs);
  const std::string hot = c.opts.hot_dir + "/ferry_distributed_bench.ferry";
  const std::string cold = c.opts.cold_dir + "/ferry_distributed_bench.ferry";
  Checker check(c.stream);
  LoaderOptions lo;
  lo.threads = c.opts.threads;
  auto base = Loader::Create(lo);
  LoaderOptions pc_options = lo;
  pc_options.io = IoMode::kPageCache;
  auto base_pc = Loader::Create(pc_options);
  DistributedOptions dopts;
  dopts.loader = lo;
  dopts.rounds = c.opts.rounds;
  auto dist = DistributedLoader::Create(c.comm, dopts);
  CHILD_CHECK(base.ok() && base_pc.ok() && dist.ok(),
              "create loaders: " + dist.status().ToString());

  // One timed load: barrier, open, load, stream synchronized; seconds on this rank.
  auto timed = [&](const std::string& path, int which, bool verify,
                   const std::string& label) -> double {
    if (!c.Barrier()) {
      c.Fail("barrier");
      return -1;
    }
    auto t0 = Clock::now();
    auto reader = Reader::Open(path);
    if (!reader.ok()) {
      c.Fail(label + ": " + reader.status().ToString());
      return -1;
    }
    Result<std::vector<LoadedTensor>> out = Status(StatusCode::kInternal, "unset");
    if (which == 0) out = (*base)->Load(**reader, {}, c.stream);
    if (which == 1) out = (*base_pc)->Load(**reader, {}, c.stream);
    if (which == 2) out = (*dist)->Load(**reader, {}, c.stream);
    double secs = std::chrono::duration<double>(Clock::now() - t0).count();
    if (!out.ok()) {
      c.Fail(label + ": " + out.status().ToString());
      return -1;
    }
    if (which == 2) {
      DistributedStats st = (*dist)->last_stats();
      c.results[label + ".read"] = {static_cast<double>(st.bytes_read)};
      c.results[label + ".received"] = {static_cast<double>(st.bytes_received)};
      c.results[label + ".direct"] = {st.used_direct_io ? 1.0 : 0.0};
    } else {
      c.results[label + ".direct"] = {
          (which == 0 ? *base : *base_pc)->last_stats().used_direct_io ? 1.0 : 0.0};
    }
    if (verify) {
      int bad = CheckAll(c, check, *out, by_name, label);
      c.results[label + ".exact"] = {bad == 0 ? 1.0 : 0.0};
      if (bad == 0) c.Note(label + ": " + std::to_string(out->size()) + " tensors bit-exact");
    }
    out->clear();  // frees on the stream; the next barrier synchronizes it
    return secs;
  };

  // Hot: the file in tmpfs. Iteration 0 warms up (pinned rings, memory pool) and verifies.
  for (int it = 0; it <= c.opts.iters; ++it) {
    double b = timed(hot, 0, it == 0, "hot.base");
    double d = timed(hot, 2, it == 0, "hot.dist");
    if (b < 0 || d < 0) return 1;
    if (it > 0) {
      c.results["hot.base"].push_back(b);
      c.results["hot.dist"].push_back(d);
    }
  }
  if (c.opts.cold) {
    const char* names[] = {"cold.base", "cold.base_pagecache", "cold.dist"};
    for (int which : {0, 1, 2}) {
      if (!c.Barrier()) return 1;
      std::string how = DropCaches(cold, c.rank == 0);
      if (!c.Barrier()) return 1;
      if (c.rank == 0) {
        c.results[std::string(names[which]) + ".resident"] = {Resident(cold)};
        c.Note(std::string(names[which]) + ": page cache dropped with " + how);
      }
      double s = timed(cold, which, which == 2, names[which]);
      if (s < 0) return 1;
      c.results[names[which]] = {s};
    }
  }
  // The checkpoint on a server: every rank opens it (the opening request and the footer) and
  // fetches its share of the tensor bytes; NCCL brings the rest. Iteration 0 verifies.
  for (int it = 0; !c.opts.remote.empty() && it <= c.opts.iters; ++it) {
    if (!c.Barrier()) return 1;
    auto t0 = Clock::now();
    auto source = OpenSource(c.opts.remote);
    if (!source.ok()) {
      c.Fail("remote: " + source.status().ToString());
      return 1;
    }
    // What this rank fetched from the server.
    auto fetched = std::make_shared<std::atomic<uint64_t>>(0);
    auto counting = std::make_shared<testing::ObservedSource>(
        *source, [fetched](uint64_t, uint64_t len) { *fetched += len; });
    auto reader = OpenReader(counting);
    if (!reader.ok()) {
      c.Fail("remote: " + reader.status().ToString());
      return 1;
    }
    auto out = (*dist)->Load(**reader, {}, c.stream);
    double secs = std::chrono::duration<double>(Clock::now() - t0).count();
    if (!out.ok()) {
      c.Fail("remote: " + out.status().ToString());
      return 1;
    }
    if (it == 0) {
      int bad = CheckAll(c, check, *out, by_name, "remote.dist");
      c.results["remote.dist.exact"] = {bad == 0 ? 1.0 : 0.0};
      c.results["remote.dist.read"] = {static_cast<double>((*dist)->last_stats().bytes_read)};
      c.results["remote.dist.fetched"] = {static_cast<double>(fetched->load())};
      c.results["remote.dist.object"] = {static_cast<double>((*reader)->file_size())};
      // What the plan says this rank fetches (its share of the stored tensor bytes).
      auto plan = MakeDistPlan(SourceOf(**reader), {}, c.rank, c.nranks, c.opts.rounds, 0, nullptr);
      uint64_t planned = 0;
      if (plan.ok()) {
        auto ranges =
            StoredRangesOf(SourceOf(**reader), plan->items, plan->pieces, c.rank, c.opts.rounds);
        for (const StoredRange& x : ranges.ok() ? *ranges : std::vector<StoredRange>{}) {
          planned += x.end - x.begin;
        }
      }
      c.results["remote.dist.planned"] = {static_cast<double>(planned)};
      if (bad == 0) c.Note("remote: " + std::to_string(out->size()) + " tensors bit-exact");
    } else {
      c.results["remote.dist"].push_back(secs);
    }
    out->clear();
  }

  std::string report;
  bool own = NvmlOwnGpuOnly(c.device, c.rank, &report);
  c.Note("NVML " + report);
  c.results["nvml_ok"] = {own ? 1.0 : 0.0};
  if (!own) c.Fail("NVML: this process appears on another GPU (or NVML is unavailable)");

  std::ofstream out(c.opts.results + "/rank" + std::to_string(c.rank) + ".txt");
  for (const auto& [k, v] : c.results) {
    out << k;
    for (double x : v) out << " " << x;
    out << "\n";
  }
  return c.failures == 0 ? 0 : 1;
}

int RunChild(int argc, char** argv) {
  // child MODE RANK NRANKS FD_READ FD_WRITE [options]
  if (argc < 7) return 2;
  Child c;
  c.opts.mode = argv[2];
  c.rank = std::atoi(argv[3]);
  c.nranks = std::atoi(argv[4]);
  c.device = c.rank;
  if (!ParseOptions(argc, argv, 7, &c.opts)) return 2;
  testing::NcclProbe nccl(c.opts.nccl);
  c.nccl = &nccl;
  if (!nccl.ok()) return kSkip;
  int rc = SetUpChild(c, std::atoi(argv[5]), std::atoi(argv[6]));
  if (rc == 0) rc = c.opts.mode == "check" ? ChildCheck(c) : ChildBench(c);
  TearDownChild(c);
  return rc;
}

// ---- the parent ---------------------------------------------------------------------------

pid_t Spawn(const std::vector<std::string>& args) { return testing::SpawnSelf(args); }

// Waits for every child; once one fails, or at the deadline, the rest are killed (a rank left
// alone would wait in NCCL forever). Returns the first non-zero status, else 0.
int WaitAll(std::vector<pid_t> pids, int deadline_s) {
  int result = 0;
  auto start = Clock::now();
  std::chrono::steady_clock::time_point kill_at = start + std::chrono::seconds(deadline_s);
  while (!pids.empty()) {
    int status = 0;
    pid_t done = waitpid(-1, &status, WNOHANG);
    if (done > 0) {
      pids.erase(std::remove(pids.begin(), pids.end(), done), pids.end());
      int rc = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      if (rc != 0 && result == 0) {
        result = rc;
        kill_at = std::min(kill_at, Clock::now() + std::chrono::seconds(20));
      }
      continue;
    }
    if (Clock::now() > kill_at) {
      for (pid_t p : pids) kill(p, SIGKILL);
      if (result == 0) result = 1;
      std::fprintf(stderr, "killed %zu rank(s) still running\n", pids.size());
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return result;
}

int RunRanks(const Options& o, const std::string& mode, int deadline_s) {
  int fds[2];
  if (pipe(fds) != 0) return 1;
  // NVLink multicast (NVLS) must stay off on these machines; children inherit this.
  setenv("NCCL_NVLS_ENABLE", "0", 1);
  std::vector<pid_t> pids;
  for (int r = 0; r < o.ranks; ++r) {
    std::vector<std::string> args = {"distributed_bench",
                                     "child",
                                     mode,
                                     std::to_string(r),
                                     std::to_string(o.ranks),
                                     std::to_string(fds[0]),
                                     std::to_string(fds[1])};
    args.insert(args.end(), o.raw.begin(), o.raw.end());
    if (!o.results.empty()) args.push_back("--results=" + o.results);
    if (mode == "check") args.push_back(o.dir);
    pids.push_back(Spawn(args));
  }
  close(fds[0]);
  close(fds[1]);
  return WaitAll(pids, deadline_s);
}

std::map<std::string, std::vector<double>> ReadResults(const std::string& path) {
  std::map<std::string, std::vector<double>> m;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream s(line);
    std::string k;
    s >> k;
    double v;
    while (s >> v) m[k].push_back(v);
  }
  return m;
}

double Median(std::vector<double> v) {
  if (v.empty()) return NAN;
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

int ParentCheck(Options o) {
  std::string dir = o.dir + "/distributed_check";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  std::vector<Spec> a = CheckShardA(), b = CheckShardB();
  for (auto [name, specs] : {std::make_pair("a.ferry", a), std::make_pair("b.ferry", b)}) {
    Status st = WriteCheckpoint(dir + "/" + name, specs, false, "check");
    if (!st.ok()) return std::fprintf(stderr, "%s\n", st.ToString().c_str()), 1;
  }
  Status st = WriteShardIndex(dir + "/model.ferry.index.json", {"a.ferry", "b.ferry"});
  if (!st.ok()) return std::fprintf(stderr, "%s\n", st.ToString().c_str()), 1;
  o.dir = dir;
  int rc = RunRanks(o, "check", 240);
  if (!o.keep) std::filesystem::remove_all(dir);
  std::printf(rc == 0 ? "DISTRIBUTED CHECK PASS\n" : "DISTRIBUTED CHECK FAIL (status %d)\n", rc);
  return rc == 0 ? 0 : (rc == kSkip ? kSkip : 1);
}

// Reuses a checkpoint written by an earlier run with the same contents.
bool Reusable(const std::string& path, const std::string& tag, uint64_t bytes) {
  auto r = Reader::Open(path);
  if (!r.ok()) return false;
  uint64_t n = 0;
  for (size_t i = 0; i < (*r)->num_tensors(); ++i) n += (*r)->tensor(i).nbytes;
  return (*r)->metadata("distributed_bench") == tag && n == bytes;
}

int ParentBench(Options o, int nccl_version) {
  const std::vector<Spec> specs = ModelSpecs(o.gib);
  const uint64_t bytes = TotalBytes(specs);
  const std::string tag =
      "model gib=" + std::to_string(o.gib) + " tensors=" + std::to_string(specs.size());
  const std::string hot = o.hot_dir + "/ferry_distributed_bench.ferry";
  const std::string cold = o.cold_dir + "/ferry_distributed_bench.ferry";
  for (const auto& [path, durable] : {std::make_pair(hot, false), std::make_pair(cold, true)}) {
    if (path == cold && !o.cold) continue;
    if (Reusable(path, tag, bytes)) {
      std::printf("reusing %s\n", path.c_str());
      continue;
    }
    auto t0 = Clock::now();
    Status st = WriteCheckpoint(path, specs, durable, tag);
    if (!st.ok()) return std::fprintf(stderr, "%s\n", st.ToString().c_str()), 1;
    std::printf("wrote %s: %.2f GiB in %.1f s\n", path.c_str(), bytes / 1073741824.0,
                std::chrono::duration<double>(Clock::now() - t0).count());
  }
  char tmpl[] = "/tmp/ferry_distributed_bench_XXXXXX";
  if (mkdtemp(tmpl) == nullptr) return 1;
  o.results = tmpl;
  std::fflush(stdout);
  int rc = RunRanks(o, "bench", 420);
  std::vector<std::map<std::string, std::vector<double>>> res;
  for (int r = 0; r < o.ranks; ++r) {
    res.push_back(ReadResults(o.results + "/rank" + std::to_string(r) + ".txt"));
  }
  std::filesystem::remove_all(o.results);
  if (!o.keep) {
    std::filesystem::remove(hot);
    if (o.cold) std::filesystem::remove(cold);
  }
  if (rc != 0) {
    std::printf("DISTRIBUTED BENCH FAIL (status %d)\n", rc);
    return rc == kSkip ? kSkip : 1;
  }

  const double gb = bytes / 1e9;
  // Per mode: the slowest rank's time in each iteration (every rank must have its tensors).
  auto slowest = [&](const std::string& key) {
    std::vector<double> worst;
    for (size_t i = 0; i < res[0][key].size(); ++i) {
      double w = 0;
      for (auto& r : res) w = std::max(w, r[key].size() > i ? r[key][i] : NAN);
      worst.push_back(w);
    }
    return worst;
  };
  auto ranks_median = [&](const std::string& key) {
    std::string s;
    for (int r = 0; r < o.ranks; ++r) {
      char buf[32];
      std::snprintf(buf, sizeof(buf), "%s%.3f", r ? " / " : "", Median(res[r][key]));
      s += buf;
    }
    return s;
  };
  std::printf(
      "\nDistributed load, %d ranks (one process per GPU), %.2f GiB bf16 checkpoint, "
      "%zu tensors, NCCL %d, loader threads %s, rounds %d\n",
      o.ranks, bytes / 1073741824.0, specs.size(), nccl_version,
      o.threads ? std::to_string(o.threads).c_str() : "default", o.rounds);
  std::printf(
      "per-rank GB/s = checkpoint bytes / wall time of the slowest rank (open + load + "
      "sync); aggregate = %d x checkpoint bytes / that time\n\n",
      o.ranks);
  std::printf("%-46s %-20s %12s %14s %10s\n", "case", "wall s per rank", "per-rank GB/s",
              "aggregate GB/s", "read/rank");
  struct Row {
    std::string label, key;
  };
  std::vector<Row> rows = {{"hot  (" + o.hot_dir + "): each rank reads all", "hot.base"},
                           {"hot  (" + o.hot_dir + "): distributed", "hot.dist"}};
  if (o.cold) {
    rows.push_back({"cold (" + o.cold_dir + "): each rank reads all", "cold.base"});
    rows.push_back({"cold: each reads all, page cache forced", "cold.base_pagecache"});
    rows.push_back({"cold (" + o.cold_dir + "): distributed", "cold.dist"});
  }
  if (!o.remote.empty())
    rows.push_back({"remote (" + PrintableUrl(o.remote) + "): distributed", "remote.dist"});
  std::map<std::string, double> median_wall;
  for (const Row& row : rows) {
    std::vector<double> worst = slowest(row.key);
    double med = Median(worst);
    double best = worst.empty() ? NAN : *std::min_element(worst.begin(), worst.end());
    median_wall[row.key] = med;
    double read = row.key.find("dist") != std::string::npos && !res[0][row.key + ".read"].empty()
                      ? res[0][row.key + ".read"][0] / 1e9
                      : gb;
    std::printf("%-46s %-20s %12.1f %14.1f %8.2f GB", row.label.c_str(),
                ranks_median(row.key).c_str(), gb / med, o.ranks * gb / med, read);
    if (worst.size() > 1) std::printf("   (best %.1f per rank)", gb / best);
    if (!res[0][row.key + ".direct"].empty()) {
      std::printf("%s", res[0][row.key + ".direct"][0] > 0 ? "  [O_DIRECT]" : "");
    }
    if (!res[0][row.key + ".resident"].empty()) {
      std::printf("  [%.1f%% resident before]", 100 * res[0][row.key + ".resident"][0]);
    }
    std::printf("\n");
  }
  if (!o.remote.empty()) {
    for (int r = 0; r < o.ranks; ++r) {
      auto get = [&](const char* k) { return res[r][k].empty() ? NAN : res[r][k][0]; };
      std::printf(
          "remote, rank %d: fetched %.3f GB of the %.3f GB object (%.3f of it; 1/%d = %.3f; "
          "planned share %.3f GB), tensor bytes read %.3f GB, bit-exact %s\n",
          r, get("remote.dist.fetched") / 1e9, get("remote.dist.object") / 1e9,
          get("remote.dist.fetched") / get("remote.dist.object"), o.ranks, 1.0 / o.ranks,
          get("remote.dist.planned") / 1e9, get("remote.dist.read") / 1e9,
          get("remote.dist.exact") == 1 ? "yes" : "NO");
    }
  }
  std::printf(
      "\nceilings on this machine (docs/DISTRIBUTED.md): 55 GB/s pinned host->device per "
      "GPU, ~570 GB/s NCCL all_gather per rank, 1.5-1.8 GB/s cold disk reads\n");

  bool exact = true, nvml = true;
  for (auto& r : res) {
    for (const char* k : {"hot.base.exact", "hot.dist.exact"})
      exact = exact && !r[k].empty() && r[k][0] == 1;
    if (o.cold) exact = exact && !r["cold.dist.exact"].empty() && r["cold.dist.exact"][0] == 1;
    if (!o.remote.empty()) {
      exact = exact && !r["remote.dist.exact"].empty() && r["remote.dist.exact"][0] == 1;
    }
    nvml = nvml && !r["nvml_ok"].empty() && r["nvml_ok"][0] == 1;
  }
  double hot_rate = gb / median_wall["hot.dist"];
  std::printf("\ngoal: hot, distributed, >= 80 GB/s effective per rank: %.1f GB/s  %s\n", hot_rate,
              hot_rate >= 80 ? "MET" : "NOT MET");
  if (o.cold) {
    double ratio = median_wall["cold.base"] / median_wall["cold.dist"];
    std::printf(
        "goal: cold, distributed aggregate >= 1.9x both ranks reading everything: %.2fx  "
        "%s\n",
        ratio, ratio >= 1.9 ? "MET" : "NOT MET");
    std::printf("      (against the page-cache baseline, where ranks share cached pages: %.2fx)\n",
                median_wall["cold.base_pagecache"] / median_wall["cold.dist"]);
  }
  std::printf("bit-exact on every rank: %s; NVML, each process on its own GPU only: %s\n",
              exact ? "yes" : "NO", nvml ? "yes" : "NO");
  bool pass = exact && nvml;
  std::printf(pass ? "DISTRIBUTED BENCH PASS\n" : "DISTRIBUTED BENCH FAIL\n");
  return pass ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc >= 2 && std::string(argv[1]) == "child") return RunChild(argc, argv);
  if (argc < 2 || (std::string(argv[1]) != "check" && std::string(argv[1]) != "bench")) {
    std::fprintf(stderr,
                 "usage: %s check DIR | bench [--gib=8] [--hot-dir=/dev/shm] "
                 "[--cold-dir=/var/tmp] [--iters=3] [--no-cold] [--keep] [--nccl=PATH] "
                 "[--ranks=2] [--threads=N] [--rounds=K]\n",
                 argv[0]);
    return 2;
  }
  Options o;
  o.mode = argv[1];
  if (!ParseOptions(argc, argv, 2, &o)) return 2;
  if (o.mode == "check" && o.dir.empty()) return std::fprintf(stderr, "check needs DIR\n"), 2;
  // Counting devices makes no context; children are fresh processes (exec), so nothing CUDA
  // crosses the fork.
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count < o.ranks) {
    std::printf("distributed loading needs %d GPUs (found %d); skipped\n", o.ranks, count);
    return kSkip;
  }
  testing::NcclProbe nccl(o.nccl);
  if (!nccl.ok()) {
    std::printf("no NCCL library found (libnccl.so.2; pass --nccl=PATH); skipped\n");
    return kSkip;
  }
  std::printf("NCCL %d from %s\n", nccl.version(), nccl.path().c_str());
  // The children get the check directory separately; the remaining options pass through.
  if (o.mode == "check") {
    o.raw.erase(std::remove(o.raw.begin(), o.raw.end(), o.dir), o.raw.end());
    return ParentCheck(o);
  }
  return ParentBench(o, nccl.version());
}
