// Host-side costs of the format: opening and indexing a file of 100,000 tensors, and loading a
// few hundred MiB into caller memory beside plain memcpy of the same bytes in the same run.
//
//   format_bench [--ferry_dir=/dev/shm] [--ferry_mib=256] [benchmark flags]
//
// The files are written once per run (into a RAM-backed directory by default, so the figures
// are page-cache-hot) and removed at exit. Every load benchmark reports bytes_per_second and
// its fraction of the memcpy rate measured at start-up ("of_memcpy").
#include <benchmark/benchmark.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "ferry/ferry.hpp"

namespace {

using namespace ferry;

std::string g_dir = "/dev/shm";
uint64_t g_mib = 256;
constexpr int kManyTensors = 100000;
constexpr uint64_t kTensorBytes = uint64_t{4} << 20;

std::vector<std::string> g_files;
std::string g_many_path;
std::vector<std::string> g_many_names;
struct LoadFile {
  std::string path;
  std::shared_ptr<Reader> reader;
  std::vector<TensorInfo> tensors;
  uint64_t bytes = 0;
};
LoadFile g_raw, g_zstd, g_shuffle;
std::vector<uint8_t> g_dst;
double g_memcpy_rate = 0;  // bytes per second, measured once at start-up

[[noreturn]] void Die(const Status& st) {
  std::fprintf(stderr, "format_bench: %s\n", st.ToString().c_str());
  for (const std::string& p : g_files) ::unlink(p.c_str());
  std::exit(1);
}

std::string TempName(const char* what) {
  std::string p =
      g_dir + "/ferry_format_bench_" + std::to_string(::getpid()) + "_" + what + ".ferry";
  g_files.push_back(p);
  return p;
}

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

void WriteMany() {
  g_many_path = TempName("many");
  WriterOptions o;
  o.durable = false;
  auto w = Writer::Create(g_many_path, o);
  if (!w.ok()) Die(w.status());
  g_many_names.reserve(kManyTensors);
  for (int i = 0; i < kManyTensors; ++i) {
    // Names shaped like a transformer's: long shared prefixes, as real checkpoints have.
    char name[96];
    std::snprintf(name, sizeof(name), "model.layers.%d.experts.%d.mlp.down_proj.weight", i / 128,
                  i % 128);
    g_many_names.emplace_back(name);
    uint16_t v[2] = {static_cast<uint16_t>(i), static_cast<uint16_t>(i >> 16)};
    Status st = w->AddTensor(name, DType::kBF16, {2}, v, sizeof(v));
    if (!st.ok()) Die(st);
  }
  Status st = w->Commit();
  if (!st.ok()) Die(st);
}

// bf16-like values with a narrow exponent range: what trained weights look like to a codec.
void FillWeights(std::vector<uint16_t>& buf, uint64_t seed) {
  uint64_t x = 0x9E3779B97F4A7C15ull ^ seed;
  for (auto& v : buf) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    v = static_cast<uint16_t>(0x3c00 | (x & 0x83ff));
  }
}

void WriteLoadFile(LoadFile& f, const char* what, Encoding encoding, uint64_t total) {
  f.path = TempName(what);
  WriterOptions o;
  o.durable = false;
  auto w = Writer::Create(f.path, o);
  if (!w.ok()) Die(w.status());
  std::vector<uint16_t> buf(kTensorBytes / 2);
  for (uint64_t i = 0; i * kTensorBytes < total; ++i) {
    FillWeights(buf, i);
    char name[64];
    std::snprintf(name, sizeof(name), "layers.%03llu.weight", static_cast<unsigned long long>(i));
    Status st = w->AddTensor(name, DType::kBF16, {1024, static_cast<int64_t>(kTensorBytes / 2048)},
                             buf.data(), kTensorBytes, encoding);
    if (!st.ok()) Die(st);
  }
  Status st = w->Commit();
  if (!st.ok()) Die(st);
  auto r = Reader::Open(f.path);
  if (!r.ok()) Die(r.status());
  f.reader = *r;
  for (size_t i = 0; i < f.reader->num_tensors(); ++i) {
    f.tensors.push_back(f.reader->tensor(i));
    f.bytes += f.tensors.back().nbytes;
  }
}

// Copies every tensor of `f` out of the file mapping with memcpy: the bytes ReadInto moves.
void MemcpyAll(const LoadFile& f, uint8_t* dst) {
  uint64_t at = 0;
  for (const TensorInfo& t : f.tensors) {
    auto v = f.reader->View(t.name);
    std::memcpy(dst + at, v->data, v->nbytes);
    at += v->nbytes;
  }
}

void Setup() {
  double t0 = Now();
  WriteMany();
  double t1 = Now();
  auto many = Reader::Open(g_many_path);
  if (!many.ok()) Die(many.status());
  double many_mib = static_cast<double>((*many)->file_size()) / 1048576.0;
  many->reset();
  WriteLoadFile(g_raw, "raw", Encoding::kRaw, g_mib << 20);
  // The codec files are smaller: a 2-core host compresses slowly, and the decode rate, not
  // the size, is the figure.
  uint64_t coded = std::min<uint64_t>(g_mib, 64) << 20;
  WriteLoadFile(g_zstd, "zstd", Encoding::kZstd, coded);
  WriteLoadFile(g_shuffle, "shuffle_zstd", Encoding::kShuffleZstd, coded);
  double t2 = Now();
  g_dst.assign(g_raw.bytes, 0);  // touched once so no benchmark pays first-touch faults
  MemcpyAll(g_raw, g_dst.data());
  double best = 1e30;
  for (int rep = 0; rep < 5; ++rep) {
    double s = Now();
    MemcpyAll(g_raw, g_dst.data());
    best = std::min(best, Now() - s);
  }
  g_memcpy_rate = static_cast<double>(g_raw.bytes) / best;
  std::fprintf(stderr,
               "format_bench: %d-tensor file %.1f MiB (written in %.2f s); load files %.0f / %.0f "
               "/ %.0f MiB raw / zstd / shuffle+zstd (written in %.2f s) in %s; memcpy from the "
               "mapping %.2f GB/s; %ld CPUs\n",
               kManyTensors, many_mib, t1 - t0, g_raw.bytes / 1048576.0, g_zstd.bytes / 1048576.0,
               g_shuffle.bytes / 1048576.0, t2 - t1, g_dir.c_str(), g_memcpy_rate / 1e9,
               ::sysconf(_SC_NPROCESSORS_ONLN));
}

void Cleanup() {
  g_raw = g_zstd = g_shuffle = LoadFile{};
  for (const std::string& p : g_files) ::unlink(p.c_str());
}

// ---- saves of many small tensors -------------------------------------------------------

// The 100,000 tensors of the index benchmarks saved again (Arg: 1 through a staging pool):
// every add is a small tensor, so the figure is the writer's cost per tensor, which was about
// a dozen thread wake-ups before small tensors travelled in batches.
void BM_SaveSmall100k(benchmark::State& state) {
  WriterOptions o;
  o.durable = false;
  if (state.range(0) != 0) {
    auto pool = StagingPool::Create(uint64_t{64} << 20);
    if (!pool.ok()) Die(pool.status());
    o.staging = *pool;
  }
  const std::string path = TempName(state.range(0) != 0 ? "save_small_staged" : "save_small");
  for (auto _ : state) {
    auto w = Writer::Create(path, o);
    if (!w.ok()) Die(w.status());
    for (int i = 0; i < kManyTensors; ++i) {
      uint16_t v[2] = {static_cast<uint16_t>(i), static_cast<uint16_t>(i >> 16)};
      Status st = w->AddTensor(g_many_names[i], DType::kBF16, {2}, v, sizeof(v));
      if (!st.ok()) Die(st);
    }
    Status st = w->Commit();
    if (!st.ok()) Die(st);
  }
  state.SetItemsProcessed(state.iterations() * kManyTensors);
}
BENCHMARK(BM_SaveSmall100k)->Arg(0)->Arg(1)->Unit(benchmark::kMillisecond)->UseRealTime();

// ---- open and index -------------------------------------------------------------------

void BM_OpenIndex100k(benchmark::State& state) {
  for (auto _ : state) {
    auto r = Reader::Open(g_many_path);
    if (!r.ok()) {
      state.SkipWithError(r.status().ToString().c_str());
      return;
    }
    if ((*r)->num_tensors() != kManyTensors) state.SkipWithError("wrong tensor count");
    benchmark::DoNotOptimize((*r)->Find(g_many_names[kManyTensors / 2]).ok());
  }
  state.SetItemsProcessed(state.iterations() * kManyTensors);
  state.counters["goal_ms"] = 5;
}
BENCHMARK(BM_OpenIndex100k)->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_Find100k(benchmark::State& state) {
  auto r = Reader::Open(g_many_path);
  if (!r.ok()) {
    state.SkipWithError(r.status().ToString().c_str());
    return;
  }
  std::mt19937 rng(1);
  std::vector<uint32_t> order(4096);
  for (auto& o : order) o = rng() % kManyTensors;
  size_t k = 0;
  for (auto _ : state) {
    auto t = (*r)->Find(g_many_names[order[k++ % order.size()]]);
    benchmark::DoNotOptimize(t.ok());
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_Find100k);

// ---- host loads -----------------------------------------------------------------------

void LoadInto(benchmark::State& state, const LoadFile& f, bool verify) {
  for (auto _ : state) {
    uint64_t at = 0;
    for (const TensorInfo& t : f.tensors) {
      Status st = f.reader->ReadInto(t.name, g_dst.data() + at, t.nbytes, {verify});
      if (!st.ok()) {
        state.SkipWithError(st.ToString().c_str());
        return;
      }
      at += t.nbytes;
    }
    benchmark::ClobberMemory();
  }
  double bytes = static_cast<double>(f.bytes) * static_cast<double>(state.iterations());
  state.SetBytesProcessed(static_cast<int64_t>(bytes));
  // bytes / ceiling is the time memcpy would take; as a rate it is the fraction of memcpy.
  state.counters["of_memcpy"] =
      benchmark::Counter(bytes / g_memcpy_rate, benchmark::Counter::kIsRate);
  state.counters["MiB"] = static_cast<double>(f.bytes) / 1048576.0;
}

void BM_HostLoad(benchmark::State& state) { LoadInto(state, g_raw, false); }
BENCHMARK(BM_HostLoad)->Unit(benchmark::kMillisecond)->UseRealTime();
void BM_HostLoadVerify(benchmark::State& state) { LoadInto(state, g_raw, true); }
BENCHMARK(BM_HostLoadVerify)->Unit(benchmark::kMillisecond)->UseRealTime();
void BM_HostLoadZstd(benchmark::State& state) { LoadInto(state, g_zstd, false); }
BENCHMARK(BM_HostLoadZstd)->Unit(benchmark::kMillisecond)->UseRealTime();
void BM_HostLoadShuffleZstd(benchmark::State& state) { LoadInto(state, g_shuffle, false); }
BENCHMARK(BM_HostLoadShuffleZstd)->Unit(benchmark::kMillisecond)->UseRealTime();

// The ceiling for BM_HostLoad: memcpy of the same bytes, from the same mapping, into the
// same destination.
void BM_Memcpy(benchmark::State& state) {
  for (auto _ : state) {
    MemcpyAll(g_raw, g_dst.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(g_raw.bytes * state.iterations()));
  state.counters["MiB"] = static_cast<double>(g_raw.bytes) / 1048576.0;
}
BENCHMARK(BM_Memcpy)->Unit(benchmark::kMillisecond)->UseRealTime();

// Zero-copy views of every tensor: the cost of handing out the mapping, per tensor.
void BM_HostView(benchmark::State& state) {
  const LoadFile& f = g_raw;
  for (auto _ : state) {
    for (const TensorInfo& t : f.tensors) {
      auto v = f.reader->View(t.name);
      benchmark::DoNotOptimize(v->data);
    }
  }
  state.SetItemsProcessed(static_cast<int64_t>(state.iterations() * f.tensors.size()));
  state.counters["MiB"] = static_cast<double>(f.bytes) / 1048576.0;
}
BENCHMARK(BM_HostView)->UseRealTime();

// Views that are then read end to end (summed): what a consumer of a zero-copy view pays,
// beside BM_Memcpy.
void BM_HostViewRead(benchmark::State& state) {
  const LoadFile& f = g_raw;
  for (auto _ : state) {
    uint64_t sum = 0;
    for (const TensorInfo& t : f.tensors) {
      auto v = f.reader->View(t.name);
      const auto* p = static_cast<const uint64_t*>(v->data);
      for (uint64_t i = 0; i < v->nbytes / 8; ++i) sum += p[i];
    }
    benchmark::DoNotOptimize(sum);
  }
  state.SetBytesProcessed(static_cast<int64_t>(f.bytes * state.iterations()));
}
BENCHMARK(BM_HostViewRead)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace

int main(int argc, char** argv) {
  // Our flags first; the rest belong to Google Benchmark.
  std::vector<char*> rest;
  for (int i = 0; i < argc; ++i) {
    std::string a = argv[i];
    if (a.rfind("--ferry_dir=", 0) == 0) {
      g_dir = a.substr(12);
    } else if (a.rfind("--ferry_mib=", 0) == 0) {
      g_mib = std::strtoull(a.c_str() + 12, nullptr, 10);
    } else {
      rest.push_back(argv[i]);
    }
  }
  int rest_argc = static_cast<int>(rest.size());
  benchmark::Initialize(&rest_argc, rest.data());
  if (benchmark::ReportUnrecognizedArguments(rest_argc, rest.data())) return 1;
  if (g_mib < 4) g_mib = 4;
  Setup();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  Cleanup();
  return 0;
}
