// Hot-cache load of a large checkpoint onto the current GPU, beside the pinned host-to-device
// ceiling measured in the same run. Without a GPU it measures host loads beside memcpy.
//
//   load_bench [--ferry_gib=8] [--ferry_dir=/dev/shm] [benchmark flags]
//
// Every load benchmark reports GB/s (decimal, bytes_per_second), the ceiling measured at
// start-up, their ratio, and the pinned host memory the loader held.
#include <benchmark/benchmark.h>
#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "bench_util.hpp"
#include "ferry/loader.hpp"

#ifdef FERRY_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace {

using namespace ferry;

double g_gib = 8;
std::string g_dir = "/dev/shm";
std::string g_path;
std::shared_ptr<Reader> g_reader;
uint64_t g_bytes = 0;
double g_ceiling = 0;  // bytes per second

using bench::Now;

// A llama-like layout of bf16 weights: per layer, four attention projections, three MLP
// matrices and two norms, until the requested size is reached.
void Generate() {
  g_path = g_dir + "/ferry_load_bench_" + std::to_string(getpid()) + ".ferry";
  const uint64_t target = static_cast<uint64_t>(g_gib * (1ull << 30));
  const int64_t hidden = 4096, ffn = 14336;
  WriterOptions wo;
  wo.durable = false;
  auto w = Writer::Create(g_path, wo);
  if (!w.ok()) {
    std::fprintf(stderr, "%s\n", w.status().ToString().c_str());
    std::exit(1);
  }
  std::vector<uint16_t> buf(static_cast<size_t>(hidden) * ffn);
  uint64_t x = 0x9E3779B97F4A7C15ull;
  for (auto& v : buf) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    v = static_cast<uint16_t>(0x3c00 | (x & 0x83ff));  // bf16-like: small exponents
  }
  uint64_t written = 0;
  for (int layer = 0; written < target; ++layer) {
    std::string p = "model.layers." + std::to_string(layer) + ".";
    struct M {
      const char* n;
      int64_t r, c;
    } mats[] = {
        {"self_attn.q_proj.weight", hidden, hidden},   {"self_attn.k_proj.weight", 1024, hidden},
        {"self_attn.v_proj.weight", 1024, hidden},     {"self_attn.o_proj.weight", hidden, hidden},
        {"mlp.gate_proj.weight", ffn, hidden},         {"mlp.up_proj.weight", ffn, hidden},
        {"mlp.down_proj.weight", hidden, ffn},         {"input_layernorm.weight", 1, hidden},
        {"post_attention_layernorm.weight", 1, hidden}};
    for (const M& m : mats) {
      std::vector<int64_t> shape =
          m.r == 1 ? std::vector<int64_t>{m.c} : std::vector<int64_t>{m.r, m.c};
      uint64_t n = static_cast<uint64_t>(m.r * m.c) * 2;
      Status st = w->AddTensor(p + m.n, DType::kBF16, shape, buf.data(), n);
      if (!st.ok()) {
        std::fprintf(stderr, "%s\n", st.ToString().c_str());
        std::exit(1);
      }
      written += n;
    }
  }
  if (Status st = w->Commit(); !st.ok()) {
    std::fprintf(stderr, "%s\n", st.ToString().c_str());
    std::exit(1);
  }
  auto r = Reader::Open(g_path);
  g_reader = *r;
  g_bytes = 0;
  for (size_t i = 0; i < g_reader->num_tensors(); ++i) g_bytes += g_reader->tensor(i).nbytes;
  // Make sure every page is resident: this is the hot-cache benchmark.
  int fd = ::open(g_path.c_str(), O_RDONLY);
  std::vector<char> tmp(64 << 20);
  while (::read(fd, tmp.data(), tmp.size()) > 0) {
  }
  ::close(fd);
}

// Accumulates manual time per iteration; Finish() turns it into decimal GB/s beside the
// ceiling, so the figure and its limit print on one line.
struct Timing {
  double total = 0;
  uint64_t runs = 0;
  void Add(benchmark::State& state, double secs) {
    state.SetIterationTime(secs);
    total += secs;
    ++runs;
  }
  void Finish(benchmark::State& state, uint64_t pinned) const {
    if (runs == 0) return;
    double gbps = static_cast<double>(g_bytes) * runs / total / 1e9;
    state.counters["GBps"] = gbps;
    state.counters["ceiling_GBps"] = g_ceiling / 1e9;
    state.counters["ratio"] = gbps * 1e9 / g_ceiling;
    state.counters["pinned_MiB"] = static_cast<double>(pinned) / (1 << 20);
    state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * g_bytes));
  }
};

#ifdef FERRY_HAVE_CUDA

// Pinned host -> device copies of 256 MiB from a cudaHostAlloc buffer, timed with events:
// the most the PCIe link gives for the checkpoint's byte count.
double MeasureCeiling(uint64_t bytes, int reps) {
  const uint64_t chunk = uint64_t{256} << 20;
  void *host = nullptr, *dev = nullptr;
  cudaHostAlloc(&host, chunk, cudaHostAllocDefault);
  std::memset(host, 1, chunk);
  cudaMalloc(&dev, chunk);
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  double best = 0;
  for (int r = 0; r < reps; ++r) {
    cudaEventRecord(a);
    for (uint64_t done = 0; done < bytes; done += chunk) {
      cudaMemcpyAsync(dev, host, std::min(chunk, bytes - done), cudaMemcpyHostToDevice);
    }
    cudaEventRecord(b);
    cudaEventSynchronize(b);
    float ms = 0;
    cudaEventElapsedTime(&ms, a, b);
    best = std::max(best, bytes / (ms / 1e3));
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  cudaFree(dev);
  cudaFreeHost(host);
  return best;
}

void BM_PinnedCeiling(benchmark::State& state) {
  for (auto _ : state) {
    double bps = MeasureCeiling(g_bytes, 1);
    state.SetIterationTime(g_bytes / bps);
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * g_bytes));
}

// Device buffers allocated once, reused by every iteration: measures the copy pipeline alone.
std::vector<LoadRequest> PreallocatedRequests(std::vector<void*>* buffers) {
  std::vector<LoadRequest> reqs;
  for (size_t i = 0; i < g_reader->num_tensors(); ++i) {
    TensorInfo t = g_reader->tensor(i);
    void* p = nullptr;
    cudaMalloc(&p, t.nbytes);
    buffers->push_back(p);
    LoadRequest q;
    q.name = t.name;
    q.dst = p;
    q.dst_bytes = t.nbytes;
    reqs.push_back(q);
  }
  return reqs;
}

// Args: host path, threads, chunk MiB, preallocated destinations, fresh (a new Reader and
// Loader every iteration: what a process that opens and loads once pays, page-table faults of
// the new mapping, ring allocation and any registration included), streaming stores.
// Non-fresh runs take one untimed warm-up load first.
void BM_Load(benchmark::State& state) {
  LoaderOptions o;
  o.host_path = static_cast<HostPath>(state.range(0));
  o.threads = static_cast<int>(state.range(1));
  o.slot_bytes = static_cast<uint64_t>(state.range(2)) << 20;
  o.staging_bytes = std::max<uint64_t>(uint64_t{64} << 20, 4 * o.slot_bytes);
  o.streaming_stores = state.range(5) != 0;
  const bool prealloc = state.range(3) != 0;
  const bool fresh = state.range(4) != 0;
  std::vector<void*> buffers;
  std::vector<LoadRequest> reqs;
  if (prealloc) reqs = PreallocatedRequests(&buffers);
  std::unique_ptr<Loader> loader = std::move(Loader::Create(o).value());
  std::shared_ptr<Reader> reader = g_reader;
  if (!fresh) {
    auto warm = loader->Load(*reader, reqs);
    if (!warm.ok()) state.SkipWithError(warm.status().ToString().c_str());
    warm->clear();
    cudaDeviceSynchronize();
  }
  uint64_t pinned = 0;
  Timing timing;
  for (auto _ : state) {
    if (state.error_occurred()) break;
    double t0 = Now();
    if (fresh) {
      loader = std::move(Loader::Create(o).value());
      reader = Reader::Open(g_path).value();
    }
    auto out = loader->Load(*reader, reqs);
    double secs = Now() - t0;
    if (!out.ok()) {
      state.SkipWithError(out.status().ToString().c_str());
      break;
    }
    pinned = loader->last_stats().pinned_bytes;
    timing.Add(state, secs);
    out->clear();
    if (fresh) {
      loader.reset();
      reader.reset();
    }
    cudaDeviceSynchronize();  // outside the timed region: returns pool memory between runs
  }
  timing.Finish(state, pinned);
  loader.reset();
  for (void* p : buffers) cudaFree(p);
}

void BM_PinnedAllocation(benchmark::State& state) {
  const uint64_t bytes = static_cast<uint64_t>(state.range(1)) << 20;
  for (auto _ : state) {
    double t0 = Now();
    if (state.range(0) == 0) {
      void* p = nullptr;
      cudaHostAlloc(&p, bytes, cudaHostAllocPortable);
      state.SetIterationTime(Now() - t0);
      cudaFreeHost(p);
    } else {
      void* p = std::aligned_alloc(4096, bytes);
      std::memset(p, 0, bytes);
      cudaHostRegister(p, bytes, cudaHostRegisterPortable);
      state.SetIterationTime(Now() - t0);
      cudaHostUnregister(p);
      std::free(p);
    }
  }
  state.SetLabel(state.range(0) == 0 ? "cudaHostAlloc" : "malloc+prefault+cudaHostRegister");
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * bytes));
}

void RegisterDevice() {
  benchmark::RegisterBenchmark("BM_PinnedCeiling", BM_PinnedCeiling)
      ->UseManualTime()
      ->Iterations(3)
      ->Unit(benchmark::kMillisecond);
  auto* b = benchmark::RegisterBenchmark("BM_Load", BM_Load);
  b->ArgNames({"path", "threads", "chunkMiB", "prealloc", "fresh", "nt"});
  // Staging ring, warm mapping, preallocated destinations: thread and chunk sweeps, and
  // streaming stores on and off.
  for (int threads : {4, 8, 12, 16, 24}) b->Args({1, threads, 4, 1, 0, 1});
  b->Args({1, 8, 4, 1, 0, 0});
  b->Args({1, 16, 4, 1, 0, 0});
  for (int chunk : {1, 2, 8, 16}) b->Args({1, 12, chunk, 1, 0, 1});
  // What users get: default allocator; warm mapping and a fresh open.
  b->Args({1, 12, 4, 0, 0, 1});
  b->Args({1, 12, 4, 0, 1, 1});
  // The defaults (8 copy threads, plain stores): caller buffers, default allocator warm and
  // fresh.
  b->Args({1, 8, 4, 0, 0, 0});
  b->Args({1, 8, 4, 0, 1, 0});
  // Registration of the whole mapping: cached (warm) and paid per open (fresh).
  b->Args({2, 8, 4, 1, 0, 1});
  b->Args({2, 8, 64, 1, 0, 1});
  b->Args({2, 8, 4, 0, 0, 1});
  b->Args({2, 8, 4, 0, 1, 1});
  // Registration window by window (64 MiB), registered and released within the load.
  b->Args({3, 8, 4, 1, 0, 1});
  b->Args({3, 16, 4, 1, 0, 1});
  b->Args({3, 8, 4, 0, 1, 1});
  b->UseManualTime()->Iterations(3)->Unit(benchmark::kMillisecond);
  auto* a = benchmark::RegisterBenchmark("BM_PinnedAllocation", BM_PinnedAllocation);
  a->ArgNames({"register", "MiB"})->Args({0, 64})->Args({1, 64})->Args({0, 1024})->Args({1, 1024});
  a->UseManualTime()->Iterations(2)->Unit(benchmark::kMillisecond);
}
#endif  // FERRY_HAVE_CUDA

void BM_HostLoad(benchmark::State& state) {
  LoaderOptions o;
  o.threads = static_cast<int>(state.range(0));
  auto loader = std::move(Loader::Create(o).value());
  std::vector<std::vector<uint8_t>> dst(g_reader->num_tensors());
  std::vector<LoadRequest> reqs;
  for (size_t i = 0; i < g_reader->num_tensors(); ++i) {
    TensorInfo t = g_reader->tensor(i);
    dst[i].resize(t.nbytes);
    std::memset(dst[i].data(), 0, t.nbytes);
    LoadRequest q;
    q.name = t.name;
    q.dst = dst[i].data();
    q.dst_bytes = t.nbytes;
    reqs.push_back(q);
  }
  Timing timing;
  for (auto _ : state) {
    double t0 = Now();
    auto out = loader->LoadToHost(*g_reader, reqs);
    double secs = Now() - t0;
    if (!out.ok()) {
      state.SkipWithError(out.status().ToString().c_str());
      break;
    }
    timing.Add(state, secs);
  }
  timing.Finish(state, 0);
}

// One memcpy pass of every tensor from the mapping into `dst`; returns the seconds it took.
double CopyAll(std::vector<uint8_t>& dst) {
  double t0 = Now();
  uint64_t off = 0;
  for (size_t i = 0; i < g_reader->num_tensors(); ++i) {
    auto v = g_reader->View(g_reader->tensor(i).name);
    std::memcpy(dst.data() + off, v->data, v->nbytes);
    off += v->nbytes;
  }
  benchmark::DoNotOptimize(dst.data());
  return Now() - t0;
}

void BM_HostMemcpy(benchmark::State& state) {
  std::vector<uint8_t> dst(g_bytes);
  std::memset(dst.data(), 0, dst.size());
  for (auto _ : state) state.SetIterationTime(CopyAll(dst));
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * g_bytes));
}

}  // namespace

int main(int argc, char** argv) {
  if (!bench::ParseFlags(argc, argv, &g_gib, &g_dir)) return 1;
  Generate();
  std::printf("checkpoint: %s, %zu tensors, %.2f GiB\n", g_path.c_str(), g_reader->num_tensors(),
              g_bytes / double(1ull << 30));
  bool gpu = CudaAvailable();
#ifdef FERRY_HAVE_CUDA
  if (gpu) {
    g_ceiling = MeasureCeiling(g_bytes, 3);
    std::printf("pinned host->device ceiling: %.1f GB/s\n", g_ceiling / 1e9);
    RegisterDevice();
  }
#endif
  if (!gpu) {
    // The host ceiling: one memcpy pass over the same bytes.
    std::vector<uint8_t> dst(g_bytes, 0);
    g_ceiling = g_bytes / CopyAll(dst);
    std::printf("no GPU: host load beside memcpy (%.1f GB/s single pass)\n", g_ceiling / 1e9);
  }
  auto* h = benchmark::RegisterBenchmark("BM_HostLoad", BM_HostLoad);
  h->ArgNames({"threads"})->Arg(1)->Arg(4)->Arg(8);
  h->UseManualTime()->Iterations(3)->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("BM_HostMemcpy", BM_HostMemcpy)
      ->UseManualTime()
      ->Iterations(3)
      ->Unit(benchmark::kMillisecond);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  g_reader.reset();
  std::remove(g_path.c_str());
  return 0;
}
