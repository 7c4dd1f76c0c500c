// Block checksums (XXH3-64) of device memory on the device, beside the device-memory ceilings of
// the same run: a plain copy kernel (bytes read plus bytes written) and a read-only kernel (what
// hashing does: it only reads). Times are CUDA events around each call (UseManualTime), GB/s
// decimal.
//
//   checksum_bench [--benchmark_filter=...]
//   BM_Checksum/blocks/bytes/offset/form: that many blocks of that many bytes laid end to end
//   from `offset` bytes past a 256-byte boundary (offset 1: every block misaligned), through
//   ChecksumOnDevice (form 0), ChecksumTableOnDevice (1) or VerifyOnDevice (2).
#include <benchmark/benchmark.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <vector>

#include "codec/checksum_cuda.hpp"

namespace {

using namespace ferry;

constexpr size_t kMiB = size_t{1} << 20;
constexpr size_t kArenaBytes = size_t{8} << 30;

#define BENCH_CUDA(call)                                               \
  do {                                                                 \
    cudaError_t e_ = (call);                                           \
    if (e_ != cudaSuccess) {                                           \
      std::fprintf(stderr, "%s: %s\n", #call, cudaGetErrorString(e_)); \
      std::exit(1);                                                    \
    }                                                                  \
  } while (0)

// One arena for every case, filled once (hashing speed does not depend on the contents).
uint8_t* Arena() {
  static uint8_t* arena = [] {
    uint8_t* p = nullptr;
    BENCH_CUDA(cudaMalloc(&p, kArenaBytes + 4096));
    BENCH_CUDA(cudaMemset(p, 0x5A, kArenaBytes + 4096));
    BENCH_CUDA(cudaDeviceSynchronize());
    return p;
  }();
  return arena;
}

// Times `fn` (which enqueues on `stream`) with events, once per iteration.
template <typename Fn>
void Timed(benchmark::State& state, cudaStream_t stream, size_t bytes, Fn fn) {
  cudaEvent_t start, stop;
  BENCH_CUDA(cudaEventCreate(&start));
  BENCH_CUDA(cudaEventCreate(&stop));
  fn();  // warm-up: module load, first touch
  BENCH_CUDA(cudaStreamSynchronize(stream));
  double seconds = 0;
  for (auto _ : state) {
    BENCH_CUDA(cudaEventRecord(start, stream));
    fn();
    BENCH_CUDA(cudaEventRecord(stop, stream));
    BENCH_CUDA(cudaEventSynchronize(stop));
    float ms = 0;
    BENCH_CUDA(cudaEventElapsedTime(&ms, start, stop));
    state.SetIterationTime(ms / 1e3);
    seconds += ms / 1e3;
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * bytes));
  // Decimal GB/s over the event times (bytes_per_second above is in binary units).
  if (seconds > 0) {
    state.counters["GB/s"] = static_cast<double>(state.iterations()) * bytes / seconds / 1e9;
  }
  cudaDeviceProp prop;
  if (cudaGetDeviceProperties(&prop, 0) == cudaSuccess) state.SetLabel(prop.name);
  BENCH_CUDA(cudaEventDestroy(start));
  BENCH_CUDA(cudaEventDestroy(stop));
}

std::vector<DeviceBlock> Blocks(size_t n, size_t bytes, size_t offset) {
  std::vector<DeviceBlock> blocks(n);
  for (size_t i = 0; i < n; ++i) blocks[i] = DeviceBlock{Arena() + offset + i * bytes, bytes, 0};
  return blocks;
}

// The entry points, by the fourth argument.
enum Form { kHostList = 0, kDeviceTable = 1, kVerifyHostList = 2 };

// Args: blocks, bytes per block, address offset, Form.
void BM_Checksum(benchmark::State& state) {
  const size_t n = state.range(0), bytes = state.range(1), offset = state.range(2);
  const auto form = static_cast<Form>(state.range(3));
  if (n * bytes + offset > kArenaBytes + 4096) return state.SkipWithError("larger than the arena");
  const std::vector<DeviceBlock> blocks = Blocks(n, bytes, offset);
  DeviceBlock* table = nullptr;
  uint64_t* sums = nullptr;
  uint32_t* flags = nullptr;
  BENCH_CUDA(cudaMalloc(&table, n * sizeof(DeviceBlock)));
  BENCH_CUDA(cudaMemcpy(table, blocks.data(), n * sizeof(DeviceBlock), cudaMemcpyHostToDevice));
  BENCH_CUDA(cudaMalloc(&sums, n * sizeof(uint64_t)));
  BENCH_CUDA(cudaMalloc(&flags, n * sizeof(uint32_t)));
  BENCH_CUDA(cudaMemset(flags, 0, n * sizeof(uint32_t)));
  Timed(state, nullptr, n * bytes, [&] {
    const int count = static_cast<int>(n);
    Status st = form == kHostList      ? ChecksumOnDevice(blocks.data(), count, sums, nullptr)
                : form == kDeviceTable ? ChecksumTableOnDevice(table, count, sums, nullptr)
                                       : VerifyOnDevice(blocks.data(), count, flags, nullptr);
    if (!st.ok()) std::fprintf(stderr, "%s\n", st.ToString().c_str()), std::exit(1);
  });
  BENCH_CUDA(cudaFree(table));
  BENCH_CUDA(cudaFree(sums));
  BENCH_CUDA(cudaFree(flags));
}

constexpr int kCeilingThreads = 512;

int CeilingBlocks() {
  int sms = 132;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  return sms * 4;
}

// 4 loads in flight per thread, then 4 stores.
__global__ void CopyKernel(const uint4* __restrict__ src, uint4* __restrict__ dst, size_t n) {
  const size_t stride = size_t{gridDim.x} * blockDim.x;
  for (size_t i = size_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n; i += 4 * stride) {
    uint4 v[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      if (i + k * stride < n) v[k] = src[i + k * stride];
    }
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      if (i + k * stride < n) dst[i + k * stride] = v[k];
    }
  }
}

// Reads everything once; the xor of all words is stored only if it is zero, which keeps the
// loads without writing anything in practice.
__global__ void ReadKernel(const uint4* __restrict__ src, size_t n, uint32_t* out) {
  const size_t stride = size_t{gridDim.x} * blockDim.x;
  uint32_t acc = 0;
  for (size_t i = size_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n; i += 4 * stride) {
    uint4 v[4] = {};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      if (i + k * stride < n) v[k] = __ldg(src + i + k * stride);
    }
#pragma unroll
    for (int k = 0; k < 4; ++k) acc ^= v[k].x ^ v[k].y ^ v[k].z ^ v[k].w;
  }
  if (acc == 0) out[0] = acc + 1;
}

// Copies the first half of the arena to the second; bytes counts both directions.
void BM_CopyKernelCeiling(benchmark::State& state) {
  const size_t half = kArenaBytes / 2;
  const uint4* src = reinterpret_cast<const uint4*>(Arena());
  uint4* dst = reinterpret_cast<uint4*>(Arena() + half);
  Timed(state, nullptr, 2 * half, [&] {
    CopyKernel<<<CeilingBlocks(), kCeilingThreads>>>(src, dst, half / 16);
    BENCH_CUDA(cudaGetLastError());
  });
}

void BM_ReadKernelCeiling(benchmark::State& state) {
  uint32_t* out = nullptr;
  BENCH_CUDA(cudaMalloc(&out, 4));
  Timed(state, nullptr, kArenaBytes, [&] {
    ReadKernel<<<CeilingBlocks(), kCeilingThreads>>>(reinterpret_cast<const uint4*>(Arena()),
                                                     kArenaBytes / 16, out);
    BENCH_CUDA(cudaGetLastError());
  });
  BENCH_CUDA(cudaFree(out));
}

bool HaveDevice() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

}  // namespace

BENCHMARK(BM_ReadKernelCeiling)->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_CopyKernelCeiling)->UseManualTime()->Unit(benchmark::kMicrosecond);
// 2048 format blocks (8 GiB) at 16-byte, 8-byte and odd addresses, descriptors from the host
// (160 per launch) and from a device table (one launch), and the verifying form.
BENCHMARK(BM_Checksum)
    ->ArgNames({"blocks", "bytes", "offset", "form"})
    ->Args({2048, 4 * kMiB, 0, kHostList})
    ->Args({2048, 4 * kMiB, 8, kHostList})
    ->Args({2048, 4 * kMiB, 1, kHostList})
    ->Args({2048, 4 * kMiB, 0, kDeviceTable})
    ->Args({2048, 4 * kMiB, 1, kDeviceTable})
    ->Args({2048, 4 * kMiB, 0, kVerifyHostList})
    // Fewer blocks per call: a single block is bound by its chain of scrambles.
    ->Args({1, 4 * kMiB, 0, kHostList})
    ->Args({4, 4 * kMiB, 0, kHostList})
    ->Args({16, 4 * kMiB, 0, kHostList})
    ->Args({64, 4 * kMiB, 0, kHostList})
    ->Args({160, 4 * kMiB, 0, kHostList})
    ->Args({512, 4 * kMiB, 0, kHostList})
    ->Args({512, 4 * kMiB, 0, kDeviceTable})
    // Small blocks: the last blocks of many tensors.
    ->Args({65536, 65536, 0, kHostList})
    ->Args({65536, 65536, 0, kDeviceTable})
    ->Args({65536, 4096, 0, kDeviceTable})
    ->Args({65536, 100, 0, kHostList})
    ->Args({65536, 100, 0, kDeviceTable})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (!HaveDevice()) {
    std::printf("checksum_bench: no CUDA device, nothing measured\n");
    return 0;
  }
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
