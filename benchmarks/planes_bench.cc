// PLANES encoding: ratio on synthetic llama-like and real weights, CPU encode/decode speed per
// core, GPU decode speed (CUDA events, warm, median), and the host-to-device pipeline the
// loader runs (compressed bytes over the link, decoded on the device) beside the pinned
// host-to-device ceiling measured in the same run.
//
//   planes_bench [--minilm=model.safetensors] [--gpu_mib=1024] [--skip_cpu]
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "base/fp8.hpp"
#include "codec/codec.hpp"
#include "codec/planes.hpp"
#include "ferry/ferry.hpp"
#include "planes_data.hpp"

#ifdef FERRY_HAVE_CUDA_KERNELS
#include <cuda_runtime.h>

#include "codec/planes_cuda.hpp"
#endif

namespace {

using namespace ferry;

constexpr size_t kBlock = size_t{4} << 20;

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

template <typename Fn>
void Parallel(size_t n, Fn fn) {
  unsigned threads = std::max(1u, std::min(16u, std::thread::hardware_concurrency()));
  std::atomic<size_t> next{0};
  std::vector<std::thread> pool;
  for (unsigned t = 0; t < threads; ++t) {
    pool.emplace_back([&] {
      for (size_t i; (i = next.fetch_add(1)) < n;) fn(i);
    });
  }
  for (auto& th : pool) th.join();
}

// Llama-like bf16 tensors: linear layers N(0, s) with s varying by layer and by output row
// (weights after training are not one Gaussian), and norm weights near 1.
std::vector<uint8_t> LlamaLike(size_t bytes, uint64_t seed) {
  std::vector<uint8_t> out(bytes);
  std::mt19937_64 rng(seed);
  const size_t row = 4096;  // elements
  const size_t rows = bytes / 2 / row;
  static const float kLayerStd[] = {0.008f, 0.012f, 0.02f, 0.025f, 0.035f, 0.05f};
  std::normal_distribution<float> jitter(0.0f, 0.25f);
  for (size_t r = 0; r < rows; ++r) {
    float s = kLayerStd[(r / 1024) % 6] * std::exp(jitter(rng));
    bool norm = r % 997 == 0;
    std::normal_distribution<float> d(norm ? 1.0f : 0.0f, norm ? 0.05f : s);
    for (size_t i = 0; i < row; ++i) {
      uint16_t b = testing::FloatToBf16(d(rng));
      std::memcpy(&out[(r * row + i) * 2], &b, 2);
    }
  }
  return out;
}

struct Encoded {
  std::vector<std::vector<uint8_t>> blocks;  // empty: stored raw
  std::vector<planes::Layout> layouts;
  size_t raw = 0, stored = 0;
};

Encoded EncodeAll(const uint8_t* data, size_t n, size_t width) {
  Encoded e;
  size_t nb = (n + kBlock - 1) / kBlock;
  e.blocks.resize(nb);
  e.layouts.resize(nb);
  e.raw = n;
  Parallel(nb, [&](size_t b) {
    size_t len = std::min(kBlock, n - b * kBlock);
    std::vector<uint8_t> out(planes::Bound(len)), scratch(len);
    size_t s = planes::Encode(data + b * kBlock, len, width, out.data(), scratch.data(), 0.02);
    out.resize(s);
    if (s) planes::Parse(out.data(), s, len, &e.layouts[b]);
    e.blocks[b] = std::move(out);
  });
  for (size_t b = 0; b < nb; ++b) {
    e.stored += e.blocks[b].empty() ? std::min(kBlock, n - b * kBlock) : e.blocks[b].size();
  }
  return e;
}

size_t ShuffleZstdSize(const uint8_t* data, size_t n, size_t width) {
  size_t nb = (n + kBlock - 1) / kBlock;
  std::vector<size_t> sizes(nb);
  Parallel(nb, [&](size_t b) {
    size_t len = std::min(kBlock, n - b * kBlock);
    std::vector<uint8_t> sh(len), out(CompressBound(len));
    Shuffle(data + b * kBlock, sh.data(), len, width);
    auto r = ZstdCompress(sh.data(), len, out.data(), out.size(), 1);
    sizes[b] = r.ok() ? std::min(*r, len) : len;
  });
  size_t total = 0;
  for (size_t s : sizes) total += s;
  return total;
}

// Each tensor in its own blocks, as the writer stores them: per-tensor scaled fp8 tensors have
// histograms of their own, which blocks mixing tensors would blur.
void PrintRatioPerTensor(const char* what, const std::vector<std::vector<uint8_t>>& tensors,
                         size_t width) {
  size_t raw = 0, stored = 0, z = 0;
  for (const std::vector<uint8_t>& t : tensors) {
    Encoded e = EncodeAll(t.data(), t.size(), width);
    raw += e.raw;
    stored += e.stored;
    z += ShuffleZstdSize(t.data(), t.size(), width);
  }
  std::printf("ratio  %-34s %9.1f MiB  planes %.3fx  shuffle+zstd-1 %.3fx (per tensor)\n", what,
              raw / 1048576.0, static_cast<double>(raw) / stored, static_cast<double>(raw) / z);
}

void PrintRatio(const char* what, const uint8_t* data, size_t n, size_t width) {
  Encoded e = EncodeAll(data, n, width);
  size_t z = ShuffleZstdSize(data, n, width);
  std::printf("ratio  %-34s %9.1f MiB  planes %.3fx  shuffle+zstd-1 %.3fx\n", what, n / 1048576.0,
              static_cast<double>(e.raw) / e.stored, static_cast<double>(n) / z);
}

// fp8 as per-tensor scaled conversions make it: each tensor divided by its largest magnitude
// over the format's largest finite value, then rounded.
std::vector<uint8_t> ScaledFp8(const std::vector<float>& v, const Fp8Layout& format) {
  float amax = 0;
  for (float x : v) amax = std::max(amax, std::fabs(x));
  const float to_max = amax > 0 ? Fp8ToFloat(format.max_finite, format) / amax : 1.0f;
  std::vector<uint8_t> out;
  out.reserve(v.size());
  for (float x : v) out.push_back(FloatToFp8(x * to_max, format));
  return out;
}

// Real weights: every floating-point tensor of a safetensors file, as stored (f32), rounded
// to bf16, and scaled per tensor to fp8 (E4M3FN, E5M2).
void RealWeights(const std::string& path) {
  auto reader = Reader::Open(path);
  if (!reader.ok()) {
    std::printf("minilm: %s\n", reader.status().ToString().c_str());
    return;
  }
  std::vector<uint8_t> f32, bf16;
  std::vector<std::vector<uint8_t>> e4m3, e5m2;
  for (size_t i = 0; i < (*reader)->num_tensors(); ++i) {
    TensorInfo t = (*reader)->tensor(i);
    if (t.dtype != DType::kF32) continue;
    std::vector<uint8_t> buf(t.nbytes);
    if (!(*reader)->ReadInto(t.name, buf.data(), buf.size()).ok()) continue;
    f32.insert(f32.end(), buf.begin(), buf.end());
    std::vector<float> values(buf.size() / 4);
    std::memcpy(values.data(), buf.data(), values.size() * 4);
    e4m3.push_back(ScaledFp8(values, kE4M3FN));
    e5m2.push_back(ScaledFp8(values, kE5M2));
    for (size_t k = 0; k + 4 <= buf.size(); k += 4) {
      float v;
      std::memcpy(&v, &buf[k], 4);
      uint16_t b = testing::FloatToBf16(v);
      bf16.push_back(static_cast<uint8_t>(b));
      bf16.push_back(static_cast<uint8_t>(b >> 8));
    }
  }
  // Tensor boundaries are ignored (one stream of 4 MiB blocks): the per-tensor figure is within
  // a fraction of a percent for a file of this size.
  PrintRatio("all-MiniLM-L6-v2 bf16", bf16.data(), bf16.size(), 2);
  PrintRatio("all-MiniLM-L6-v2 f32", f32.data(), f32.size(), 4);
  PrintRatioPerTensor("all-MiniLM-L6-v2 fp8 e4m3fn", e4m3, 1);
  PrintRatioPerTensor("all-MiniLM-L6-v2 fp8 e5m2", e5m2, 1);
}

void CpuSpeed(const std::vector<uint8_t>& data, size_t width, const char* what) {
  const size_t n = std::min<size_t>(data.size(), 64u << 20);
  std::vector<uint8_t> out(planes::Bound(kBlock)), scratch(kBlock), dec(kBlock);
  std::vector<std::vector<uint8_t>> enc;
  double t0 = Now();
  for (size_t off = 0; off < n; off += kBlock) {
    size_t s = planes::Encode(data.data() + off, kBlock, width, out.data(), scratch.data(), 0.02);
    enc.emplace_back(out.begin(), out.begin() + s);
  }
  double enc_s = Now() - t0;
  std::vector<double> runs;
  for (int r = 0; r < 5; ++r) {
    t0 = Now();
    for (size_t b = 0; b < enc.size(); ++b) {
      Status st = planes::Decode(enc[b].data(), enc[b].size(), dec.data(), kBlock, scratch.data());
      if (!st.ok()) std::printf("decode failed: %s\n", st.ToString().c_str());
    }
    runs.push_back(Now() - t0);
  }
  std::printf("cpu    encode %-6s 1 thread                %7.2f GB/s of input\n", what,
              n / enc_s / 1e9);
  std::printf("cpu    decode %-6s 1 thread                %7.2f GB/s of output (median of 5)\n",
              what, n / Median(runs) / 1e9);
}

#ifdef FERRY_HAVE_CUDA_KERNELS
#define CK(call)                                                                           \
  do {                                                                                     \
    cudaError_t e_ = (call);                                                               \
    if (e_ != cudaSuccess) {                                                               \
      std::printf("CUDA error %s at %s:%d\n", cudaGetErrorString(e_), __FILE__, __LINE__); \
      return;                                                                              \
    }                                                                                      \
  } while (0)

void GpuSpeed(const std::vector<uint8_t>& data, size_t width, const char* what) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("gpu    no CUDA device: GPU figures skipped\n");
    return;
  }
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  const size_t n = data.size();
  Encoded e = EncodeAll(data.data(), n, width);
  const size_t nb = e.blocks.size();
  // Compressed blocks packed at 256-byte offsets, as the loader's device slots hold them.
  std::vector<size_t> off(nb);
  size_t total = 0;
  for (size_t b = 0; b < nb; ++b) {
    off[b] = total;
    total += (e.blocks[b].size() + 255) / 256 * 256;
  }
  uint8_t *pinned = nullptr, *dsrc = nullptr, *ddst = nullptr, *dcopy = nullptr;
  uint32_t* derr = nullptr;
  CK(cudaHostAlloc(&pinned, total, cudaHostAllocDefault));
  for (size_t b = 0; b < nb; ++b)
    std::memcpy(pinned + off[b], e.blocks[b].data(), e.blocks[b].size());
  CK(cudaMalloc(&dsrc, total));
  CK(cudaMalloc(&ddst, n));
  CK(cudaMalloc(&dcopy, n));
  CK(cudaMalloc(&derr, 4 * nb));
  CK(cudaMemset(derr, 0, 4 * nb));
  CK(cudaMemcpy(dsrc, pinned, total, cudaMemcpyHostToDevice));
  std::vector<planes::DeviceJob> jobs(nb);
  for (size_t b = 0; b < nb; ++b) jobs[b] = {dsrc + off[b], ddst + b * kBlock, e.layouts[b]};
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaEvent_t a, z;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&z));
  auto timed = [&](auto&& body, int reps) {
    std::vector<double> ms;
    for (int r = 0; r < reps + 2; ++r) {
      cudaEventRecord(a, s);
      body();
      cudaEventRecord(z, s);
      cudaEventSynchronize(z);
      float t = 0;
      cudaEventElapsedTime(&t, a, z);
      if (r >= 2) ms.push_back(t);
    }
    return Median(ms) / 1e3;
  };
  double dec =
      timed([&] { planes::DecodeOnDevice(jobs.data(), static_cast<int>(nb), derr, s); }, 10);
  std::vector<uint32_t> errs(nb);
  CK(cudaMemcpy(errs.data(), derr, 4 * nb, cudaMemcpyDeviceToHost));
  std::vector<uint8_t> back(n);
  CK(cudaMemcpy(back.data(), ddst, n, cudaMemcpyDeviceToHost));
  bool exact = back == data && std::all_of(errs.begin(), errs.end(), [](uint32_t v) { return !v; });
  // One block per call, as a loader that decodes each 4 MiB slot on its own would launch.
  double dec1 = timed(
      [&] {
        for (size_t b = 0; b < nb; ++b) planes::DecodeOnDevice(&jobs[b], 1, derr + b, s);
      },
      5);
  double d2d = timed([&] { cudaMemcpyAsync(dcopy, ddst, n, cudaMemcpyDeviceToDevice, s); }, 10);
  // The link: pinned host -> device, one copy of the compressed size in 256 MiB pieces.
  double h2d = timed(
      [&] {
        for (size_t o = 0; o < total; o += 256u << 20) {
          cudaMemcpyAsync(dsrc + o, pinned + o, std::min<size_t>(256u << 20, total - o),
                          cudaMemcpyHostToDevice, s);
        }
      },
      5);
  // The loader's pipeline without the file: groups of 16 blocks copied into one of 3 device
  // slots on a copy stream, decoded on the caller's stream once the copy lands.
  const size_t group = 16;
  const int slots = 3;
  cudaStream_t cs;
  CK(cudaStreamCreateWithFlags(&cs, cudaStreamNonBlocking));
  std::vector<cudaEvent_t> copied(slots), freed(slots);
  for (int i = 0; i < slots; ++i) {
    CK(cudaEventCreateWithFlags(&copied[i], cudaEventDisableTiming));
    CK(cudaEventCreateWithFlags(&freed[i], cudaEventDisableTiming));
  }
  size_t slot_bytes = 0;
  for (size_t g = 0; g < nb; g += group) {
    size_t end = std::min(nb, g + group);
    size_t last = end - 1;
    slot_bytes = std::max(slot_bytes, off[last] + e.blocks[last].size() - off[g]);
  }
  uint8_t* dslots = nullptr;
  CK(cudaMalloc(&dslots, slot_bytes * slots + 256));
  double pipe = timed(
      [&] {
        int k = 0;
        for (size_t g = 0; g < nb; g += group, k = (k + 1) % slots) {
          size_t end = std::min(nb, g + group), last = end - 1;
          size_t bytes = off[last] + e.blocks[last].size() - off[g];
          uint8_t* slot = dslots + k * ((slot_bytes + 255) / 256 * 256);
          cudaStreamWaitEvent(cs, freed[k], 0);
          cudaMemcpyAsync(slot, pinned + off[g], bytes, cudaMemcpyHostToDevice, cs);
          cudaEventRecord(copied[k], cs);
          cudaStreamWaitEvent(s, copied[k], 0);
          std::vector<planes::DeviceJob> gj(jobs.begin() + g, jobs.begin() + end);
          for (size_t b = g; b < end; ++b) gj[b - g].src = slot + (off[b] - off[g]);
          planes::DecodeOnDevice(gj.data(), static_cast<int>(gj.size()), derr + g, s);
          cudaEventRecord(freed[k], s);
        }
      },
      5);
  CK(cudaMemcpy(back.data(), ddst, n, cudaMemcpyDeviceToHost));
  exact = exact && back == data;
  std::printf("gpu    device: %s, %d SMs\n", prop.name, prop.multiProcessorCount);
  std::printf(
      "gpu    decode %s %zu MiB, 24 blocks per launch  %7.1f GB/s of output (median of 10)%s\n",
      what, n >> 20, n / dec / 1e9, exact ? "" : "  MISMATCH");
  std::printf("gpu    decode %s, one launch per 4 MiB block   %7.1f GB/s of output\n", what,
              n / dec1 / 1e9);
  std::printf(
      "gpu    device-to-device copy of the output       %7.1f GB/s (memory ceiling reference)\n",
      n / d2d / 1e9);
  std::printf("link   pinned host->device, 256 MiB pieces       %7.1f GB/s (the PCIe ceiling)\n",
              total / h2d / 1e9);
  std::printf(
      "pipe   %s pinned compressed -> device slots -> decode %6.1f GB/s of output "
      "(ratio %.3fx; ceiling x ratio = %.1f)\n",
      what, n / pipe / 1e9, static_cast<double>(n) / e.stored,
      total / h2d / 1e9 * static_cast<double>(n) / total);
  cudaFreeHost(pinned);
  cudaFree(dsrc);
  cudaFree(ddst);
  cudaFree(dcopy);
  cudaFree(derr);
  cudaFree(dslots);
}
#endif

}  // namespace

int main(int argc, char** argv) {
  std::string minilm;
  size_t gpu_mib = 1024;
  bool skip_cpu = false;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a.rfind("--minilm=", 0) == 0) {
      minilm = a.substr(9);
    } else if (a.rfind("--gpu_mib=", 0) == 0) {
      gpu_mib = std::stoul(a.substr(10));
    } else if (a == "--skip_cpu") {
      skip_cpu = true;
    } else {
      std::fprintf(stderr, "usage: planes_bench [--minilm=FILE] [--gpu_mib=N] [--skip_cpu]\n");
      return 2;
    }
  }
  std::printf("host   %u hardware threads\n", std::thread::hardware_concurrency());
  std::vector<uint8_t> llama = LlamaLike(size_t{256} << 20, 1);
  PrintRatio("synthetic llama-like bf16", llama.data(), llama.size(), 2);
  std::vector<uint8_t> normal = testing::NormalWeights(size_t{64} << 20, 2, 0.02f, 2);
  PrintRatio("N(0, 0.02) bf16", normal.data(), normal.size(), 2);
  std::vector<uint8_t> f16 = testing::NormalWeights(size_t{64} << 20, 2, 0.02f, 3, true);
  PrintRatio("N(0, 0.02) f16", f16.data(), f16.size(), 2);
  std::vector<uint8_t> f32 = testing::NormalWeights(size_t{64} << 20, 4, 0.02f, 4);
  PrintRatio("N(0, 0.02) f32", f32.data(), f32.size(), 4);
  if (!minilm.empty()) RealWeights(minilm);
  std::vector<uint8_t> fp8 = testing::Fp8Weights(size_t{64} << 20, kE4M3FN, 6);
  PrintRatio("N(0, s) rows, scaled fp8 e4m3fn", fp8.data(), fp8.size(), 1);
  std::vector<uint8_t> fp8b = testing::Fp8Weights(size_t{64} << 20, kE5M2, 7);
  PrintRatio("N(0, s) rows, scaled fp8 e5m2", fp8b.data(), fp8b.size(), 1);
  if (!skip_cpu) {
    CpuSpeed(llama, 2, "bf16");
    CpuSpeed(fp8, 1, "e4m3");
  }
#ifdef FERRY_HAVE_CUDA_KERNELS
  std::vector<uint8_t> gpu_data = LlamaLike(gpu_mib << 20, 5);
  GpuSpeed(gpu_data, 2, "bf16");
  std::vector<uint8_t> gpu_fp8 = testing::Fp8Weights(gpu_mib << 20, kE4M3FN, 8);
  GpuSpeed(gpu_fp8, 1, "e4m3");
#else
  std::printf("gpu    built without CUDA kernels\n");
#endif
  return 0;
}
