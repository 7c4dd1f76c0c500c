// XXH3-64 of many device blocks in one launch: one thread block (CTA) per block.
//
// The long path scrambles its 8 accumulator lanes after every KiB of input, one scramble after
// the other, but everything between two scrambles is a sum (xxh3_device.cuh). So 8 loader warps
// read the input in 64 KiB chunks at full width, each thread summing 16 stripes of one lane pair
// of one KiB (16-byte loads; 4 threads read each 64-byte stripe), and leave what each KiB adds
// to each lane in shared memory, while a ninth warp runs the 64 scrambles of the previous chunk
// (double buffer, one barrier per chunk; the schedule is xxh3::LoaderRound and ChainRound, which
// the host tests run). A block then takes about as long as its chunk loads or its scramble chain,
// whichever is longer, and batches of many blocks keep the memory bus busy.
#include <algorithm>
#include <cstring>

#include "base/util.hpp"
#include "codec/checksum_cuda.hpp"
#include "codec/xxh3_device.cuh"

namespace ferry {
namespace {

constexpr int kLoaderWarps = xxh3::kLoaderThreads / 32;
constexpr int kChainWarp = kLoaderWarps;
constexpr int kThreads = 32 * (kLoaderWarps + 1);
// Block descriptors travel as kernel parameters, which every driver takes up to 4 KiB.
constexpr int kMaxBlocksPerLaunch = 160;

struct KBlock {
  const uint8_t* data;
  uint64_t size;
  uint64_t expected;
};
static_assert(sizeof(KBlock) == sizeof(DeviceBlock), "a device table is read as KBlocks");

struct KOut {
  uint64_t* sums;      // null: compare with the expected sums instead
  uint32_t* mismatch;  // null: store the sums
};

// Descriptors as kernel parameters.
struct KParams {
  KBlock blocks[kMaxBlocksPerLaunch];
  KOut out;
  __device__ const KBlock& Get(unsigned i) const { return blocks[i]; }
};
static_assert(sizeof(KParams) <= 4096, "kernel parameters must fit in 4 KiB");

// Descriptors in device memory.
struct KTable {
  const KBlock* blocks;
  KOut out;
  __device__ const KBlock& Get(unsigned i) const { return blocks[i]; }
};

struct Shared {
  uint64_t secret[xxh3::kSecretWords];
  xxh3::Exchange x;
};

__constant__ xxh3::Secret kDeviceSecret = xxh3::kSecret;

__device__ __forceinline__ uint64_t ShortHash(const uint8_t* p, uint64_t len, const uint64_t* sw) {
  if (len <= 16) return xxh3::HashUpTo16(p, len, sw);
  if (len <= 128) return xxh3::Hash17To128(p, len, sw);
  return xxh3::Hash129To240(p, len, sw);
}

// The long path of one block; all threads of the CTA call it, and the result is valid in
// thread 0 of the chain warp.
template <int kMode>
__device__ __forceinline__ uint64_t LongHash(const uint8_t* p, uint64_t len, Shared& sh) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const uint64_t* sw = sh.secret;
  const uint64_t chunks = xxh3::Chunks(len);
  const bool chain = warp == kChainWarp && lane < 8;
  const uint64_t key = chain ? sw[16 + lane] : 0;
  uint64_t acc = chain ? xxh3::InitLane(lane) : 0;
  for (uint64_t it = 0; it <= chunks; ++it) {
    if (warp < kLoaderWarps) {
      xxh3::LoaderRound<kMode>(p, len, it, threadIdx.x, sw, sh.x);
    } else if (chain) {
      acc = xxh3::ChainRound(acc, len, it, lane, key, sh.x);
    }
    __syncthreads();
  }
  if (chain) acc = xxh3::ChainFinish(acc, lane, sh.x);
  if (warp != kChainWarp) return 0;
  // Lanes 2i and 2i + 1 fold into one word, and lane 0 sums the four.
  const uint64_t m = lane < 8 ? xxh3::MergeInput(acc, lane, sw) : 0;
  const uint64_t partner = __shfl_down_sync(0xFFFFFFFFu, m, 1);
  uint64_t f = (lane < 8 && (lane & 1) == 0) ? xxh3::Fold64(m, partner) : 0;
  f += __shfl_down_sync(0xFFFFFFFFu, f, 2);
  f += __shfl_down_sync(0xFFFFFFFFu, f, 4);
  return xxh3::Avalanche(len * xxh3::kPrime64_1 + f);
}

template <class Blocks>
__global__ void __launch_bounds__(kThreads, 2) Xxh3Kernel(const __grid_constant__ Blocks k) {
  __shared__ Shared sh;
  if (threadIdx.x < xxh3::kSecretWords) sh.secret[threadIdx.x] = kDeviceSecret.w[threadIdx.x];
  __syncthreads();
  // The expected sum is read again at the end rather than held in a register throughout.
  const uint8_t* const data = k.Get(blockIdx.x).data;
  const uint64_t size = k.Get(blockIdx.x).size;
  uint64_t h;
  if (data == nullptr && size > 0) {
    // Only a device table can hold one (host descriptors are checked): no sum, a mismatch.
    if (threadIdx.x != 0) return;
    h = ~k.Get(blockIdx.x).expected;
  } else if (size <= xxh3::kMidSizeMax) {
    if (threadIdx.x != 0) return;
    h = ShortHash(data, size, sh.secret);
  } else {
    switch (xxh3::LoadModeOf(data)) {
      case xxh3::kAligned16:
        h = LongHash<xxh3::kAligned16>(data, size, sh);
        break;
      case xxh3::kAligned8:
        h = LongHash<xxh3::kAligned8>(data, size, sh);
        break;
      case 0:
        h = LongHash<0>(data, size, sh);
        break;
      case 1:
        h = LongHash<1>(data, size, sh);
        break;
      case 2:
        h = LongHash<2>(data, size, sh);
        break;
      default:
        h = LongHash<3>(data, size, sh);
        break;
    }
    if (threadIdx.x != 32 * kChainWarp) return;
  }
  if (k.out.sums != nullptr) {
    k.out.sums[blockIdx.x] = h;
  } else if (h != k.Get(blockIdx.x).expected && k.out.mismatch[blockIdx.x] == 0) {
    k.out.mismatch[blockIdx.x] = kChecksumMismatch;
  }
}

Status LaunchError(const char* what) {
  const cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess) return Status::Ok();
  return Error(StatusCode::kCudaError, what, ": kernel launch: ", cudaGetErrorString(e));
}

Status CheckCall(const char* what, const DeviceBlock* blocks, int n, KOut out) {
  if (n < 0) return Error(StatusCode::kInvalidArgument, what, ": negative block count ", n);
  if (n > 0 && (blocks == nullptr || (out.sums == nullptr && out.mismatch == nullptr))) {
    return Error(StatusCode::kInvalidArgument, what, ": null ",
                 blocks == nullptr ? "block array" : "output array", " for ", n, " blocks");
  }
  return Status::Ok();
}

Status Launch(const char* what, const DeviceBlock* blocks, int n, KOut out, cudaStream_t stream) {
  FERRY_RETURN_IF_ERROR(CheckCall(what, blocks, n, out));
  // Every descriptor is checked before anything is enqueued.
  for (int i = 0; i < n; ++i) {
    if (blocks[i].size > 0 && blocks[i].data == nullptr) {
      return Error(StatusCode::kInvalidArgument, what, ": block ", i, " of ", blocks[i].size,
                   " bytes has no data pointer");
    }
  }
  for (int first = 0; first < n;) {
    const int count = std::min(n - first, kMaxBlocksPerLaunch);
    KParams k;
    std::memset(&k, 0, sizeof(k));
    for (int c = 0; c < count; ++c) {
      const DeviceBlock& d = blocks[first + c];
      k.blocks[c] = KBlock{static_cast<const uint8_t*>(d.data), d.size, d.expected};
    }
    k.out.sums = out.sums != nullptr ? out.sums + first : nullptr;
    k.out.mismatch = out.sums == nullptr ? out.mismatch + first : nullptr;
    Xxh3Kernel<<<count, kThreads, 0, stream>>>(k);
    FERRY_RETURN_IF_ERROR(LaunchError(what));
    first += count;
  }
  return Status::Ok();
}

Status LaunchTable(const char* what, const DeviceBlock* table, int n, KOut out,
                   cudaStream_t stream) {
  FERRY_RETURN_IF_ERROR(CheckCall(what, table, n, out));
  if (n == 0) return Status::Ok();
  Xxh3Kernel<<<n, kThreads, 0, stream>>>(KTable{reinterpret_cast<const KBlock*>(table), out});
  return LaunchError(what);
}

}  // namespace

Status ChecksumOnDevice(const DeviceBlock* blocks, int n, uint64_t* sums, cudaStream_t stream) {
  return Launch("device checksum", blocks, n, KOut{sums, nullptr}, stream);
}

Status VerifyOnDevice(const DeviceBlock* blocks, int n, uint32_t* mismatch, cudaStream_t stream) {
  return Launch("device checksum verify", blocks, n, KOut{nullptr, mismatch}, stream);
}

Status ChecksumTableOnDevice(const DeviceBlock* table, int n, uint64_t* sums, cudaStream_t stream) {
  return LaunchTable("device checksum", table, n, KOut{sums, nullptr}, stream);
}

Status VerifyTableOnDevice(const DeviceBlock* table, int n, uint32_t* mismatch,
                           cudaStream_t stream) {
  return LaunchTable("device checksum verify", table, n, KOut{nullptr, mismatch}, stream);
}

}  // namespace ferry
