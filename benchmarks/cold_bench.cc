// Cold loads (page cache dropped) from disk, raw and shuffle+zstd, beside the raw read
// bandwidth of the same files measured in the same run. Needs root (drop_caches) and a
// disk-backed directory (O_DIRECT; tmpfs has no cold state).
//
//   cold_bench [--ferry_gib=8] [--ferry_dir=/var/tmp] [benchmark flags]
//
// Throughput is counted in uncompressed bytes per second (decimal GB/s), so a compressed file
// that loads faster than the disk reads shows a figure above the raw read bandwidth.
#include <benchmark/benchmark.h>
#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
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
std::string g_dir = "/var/tmp";
std::string g_paths[2];  // raw, shuffle+zstd
uint64_t g_bytes = 0;
bool g_gpu = false;

using bench::Now;

bool DropCaches() {
  ::sync();
  FILE* f = std::fopen("/proc/sys/vm/drop_caches", "w");
  if (f == nullptr) return false;
  bool ok = std::fputs("3\n", f) >= 0;
  return std::fclose(f) == 0 && ok;
}

// bf16 weights ~ N(0, 0.02), the distribution compression is measured on.
std::vector<uint16_t> NormalBf16(size_t n) {
  std::vector<uint16_t> out(n);
  std::mt19937_64 rng(7);
  std::normal_distribution<float> nd(0.f, 0.02f);
  for (auto& v : out) {
    float f = nd(rng);
    uint32_t u;
    std::memcpy(&u, &f, 4);
    u += 0x7fff + ((u >> 16) & 1);
    v = static_cast<uint16_t>(u >> 16);
  }
  return out;
}

void Generate() {
  const uint64_t target = static_cast<uint64_t>(g_gib * (1ull << 30));
  const int64_t rows = 4096, cols = 8192;  // 64 MiB bf16 matrices
  std::vector<uint16_t> buf = NormalBf16(static_cast<size_t>(rows * cols));
  const char* names[2] = {"raw", "shuffle_zstd"};
  for (int f = 0; f < 2; ++f) {
    g_paths[f] = g_dir + "/ferry_cold_" + names[f] + "_" + std::to_string(getpid()) + ".ferry";
    WriterOptions wo;
    wo.encoding = f == 0 ? Encoding::kRaw : Encoding::kShuffleZstd;
    auto w = Writer::Create(g_paths[f], wo);
    if (!w.ok()) {
      std::fprintf(stderr, "%s\n", w.status().ToString().c_str());
      std::exit(1);
    }
    uint64_t written = 0;
    for (int i = 0; written < target; ++i) {
      // Rotate the buffer per tensor so tensors differ (blocks compress independently anyway).
      std::rotate(buf.begin(), buf.begin() + 4099, buf.end());
      Status st = w->AddTensor("w." + std::to_string(i), DType::kBF16, {rows, cols}, buf.data(),
                               buf.size() * 2);
      if (!st.ok()) {
        std::fprintf(stderr, "%s\n", st.ToString().c_str());
        std::exit(1);
      }
      written += buf.size() * 2;
    }
    if (Status st = w->Commit(); !st.ok()) {
      std::fprintf(stderr, "%s\n", st.ToString().c_str());
      std::exit(1);
    }
    g_bytes = written;
    auto r = Reader::Open(g_paths[f]);
    std::printf("%s: %.2f GiB raw, %.2f GiB on disk\n", g_paths[f].c_str(),
                written / double(1ull << 30), (*r)->file_size() / double(1ull << 30));
  }
}

// Reads the whole file once with `threads` threads and O_DIRECT, 4 MiB per request: what the
// storage gives to a reader that does nothing else.
double RawReadSeconds(const std::string& path, int threads) {
  int fd = ::open(path.c_str(), O_RDONLY | O_DIRECT);
  if (fd < 0) return -1;
  off_t size = ::lseek(fd, 0, SEEK_END);
  const uint64_t chunk = uint64_t{4} << 20;
  std::atomic<uint64_t> next{0};
  double t0 = Now();
  std::vector<std::thread> ts;
  for (int t = 0; t < threads; ++t) {
    ts.emplace_back([&] {
      void* buf = std::aligned_alloc(4096, chunk);
      for (;;) {
        uint64_t off = next.fetch_add(chunk);
        if (off >= static_cast<uint64_t>(size)) break;
        if (::pread(fd, buf, chunk, static_cast<off_t>(off)) < 0) break;
      }
      std::free(buf);
    });
  }
  for (auto& t : ts) t.join();
  double secs = Now() - t0;
  ::close(fd);
  return secs;
}

void BM_RawRead(benchmark::State& state) {
  const std::string& path = g_paths[state.range(0)];
  uint64_t file_bytes = (*Reader::Open(path))->file_size();
  for (auto _ : state) {
    if (!DropCaches()) {
      state.SkipWithError("cannot drop caches (needs root)");
      break;
    }
    double secs = RawReadSeconds(path, static_cast<int>(state.range(1)));
    if (secs < 0) {
      state.SkipWithError("O_DIRECT open failed (tmpfs?)");
      break;
    }
    state.SetIterationTime(secs);
    state.counters["file_GBps"] = file_bytes / secs / 1e9;
    state.counters["raw_equiv_GBps"] = g_bytes / secs / 1e9;
  }
  state.SetLabel(state.range(0) == 0 ? "raw file" : "shuffle+zstd file");
}

// Args: file (0 raw, 1 shuffle+zstd), io mode, threads, cold.
void BM_Load(benchmark::State& state) {
  const std::string& path = g_paths[state.range(0)];
  LoaderOptions o;
  o.io = static_cast<IoMode>(state.range(1));
  o.threads = static_cast<int>(state.range(2));
  const bool cold = state.range(3) != 0;
  auto loader = std::move(Loader::Create(o).value());
  LoadStats stats;
  for (auto _ : state) {
    if (cold && !DropCaches()) {
      state.SkipWithError("cannot drop caches (needs root)");
      break;
    }
    double t0 = Now();
    auto reader = Reader::Open(path);
    Result<std::vector<LoadedTensor>> out =
        g_gpu ? loader->Load(**reader, {}) : loader->LoadToHost(**reader, {});
    double secs = Now() - t0;
    if (!out.ok()) {
      state.SkipWithError(out.status().ToString().c_str());
      break;
    }
    stats = loader->last_stats();
    state.SetIterationTime(secs);
    state.counters["GBps"] = g_bytes / secs / 1e9;
    out->clear();
#ifdef FERRY_HAVE_CUDA
    if (g_gpu) cudaDeviceSynchronize();
#endif
  }
  state.SetLabel(std::string(state.range(0) == 0 ? "raw" : "shuffle+zstd") +
                 (cold ? " cold" : " hot") + (stats.used_direct_io ? " direct" : " pagecache") +
                 (g_gpu ? " ->gpu" : " ->host"));
}

}  // namespace

int main(int argc, char** argv) {
  if (!bench::ParseFlags(argc, argv, &g_gib, &g_dir)) return 1;
  g_gpu = CudaAvailable();
  Generate();
  benchmark::RegisterBenchmark("BM_RawRead", BM_RawRead)
      ->ArgNames({"file", "threads"})
      ->Args({0, 8})
      ->Args({0, 16})
      ->Args({1, 8})
      ->UseManualTime()
      ->Iterations(1)
      ->Unit(benchmark::kMillisecond);
  auto* b = benchmark::RegisterBenchmark("BM_Load", BM_Load);
  b->ArgNames({"file", "io", "threads", "cold"});
  b->Args({0, 0, 8, 1});   // raw, auto (direct when cold)
  b->Args({0, 1, 8, 1});   // raw, page cache forced
  b->Args({0, 0, 16, 1});  // raw, auto, more requests in flight
  b->Args({1, 0, 16, 1});  // shuffle+zstd, auto
  b->Args({1, 1, 16, 1});  // shuffle+zstd, page cache forced
  b->Args({1, 0, 16, 0});  // shuffle+zstd hot: the decode-bound rate
  // Two workers (run under `taskset -c 0,1`: a 2-core machine), cold and hot.
  b->Args({1, 0, 2, 1});
  b->Args({1, 1, 2, 1});
  b->Args({1, 0, 2, 0});
  b->UseManualTime()->Iterations(1)->Unit(benchmark::kMillisecond);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  for (const auto& p : g_paths) std::remove(p.c_str());
  return 0;
}
