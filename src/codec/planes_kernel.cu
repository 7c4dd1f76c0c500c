// PLANES decoder kernel. One CTA of 8 warps expands up to 8 units of one block: it builds the
// decoding table of each coded plane in shared memory, each warp decodes one unit of one plane
// (lane t decodes stream t) into shared memory, then all threads interleave the coded planes
// with the raw planes read from global memory and store whole elements, 16 bytes at a time.
#include <algorithm>
#include <atomic>
#include <cstring>
#include <string>

#include "base/util.hpp"
#include "codec/planes_cuda.hpp"

namespace ferry::planes {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxJobs = 24;
// Shared bytes per (unit, plane) symbol buffer: 32 streams, each padded by one word so lanes
// writing their streams in step hit distinct banks.
constexpr int kStreamStride = kMaxSymbolsPerStream + 4;
constexpr int kUnitBuffer = 32 * kStreamStride;
constexpr int kTableEntries = 1 << kMaxCodeLength;

// Error values: kind in bits 0-3, plane in bits 4-7, unit in bits 8-31.
enum DeviceErrorKind : uint32_t {
  kBadStreamTable = 1,
  kBadCode = 2,
  kBadPadding = 3,
  kBadTable = 4,
};

struct KJob {
  const uint8_t* src;
  uint8_t* dst;
  uint32_t count;
  uint32_t nunits;
  uint32_t first_cta;
  uint16_t sps;
  uint8_t width;
  uint8_t coded;
  uint8_t vec;  // dst is 16-byte aligned
  uint8_t pad[3];
  uint32_t plane_off[kMaxWidth];
  uint8_t mode[kMaxWidth];
  uint8_t max_len[kMaxWidth];
};

struct KParams {
  KJob jobs[kMaxJobs];
  uint32_t* errors;
  int njobs;
  int upc;  // units per CTA
};

__device__ __forceinline__ void Fail(uint32_t* err, uint32_t kind, uint32_t plane, uint32_t unit) {
  atomicCAS(err, 0u, kind | (plane << 4) | (unit << 8));
}

// Canonical decoding table of one coded plane (entry: symbol << 4 | length, 0 = no code).
__device__ void BuildTable(const uint8_t* lengths_nibbles, int max_len, uint16_t* table,
                           uint32_t* err, uint32_t plane) {
  __shared__ uint16_t sorted[256];
  __shared__ uint32_t gcount[kWarps][16];
  __shared__ uint32_t gprefix[kWarps][16];
  __shared__ uint32_t first[16], offset[16], limit[16];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  for (int i = tid; i < kWarps * 16; i += kThreads) (&gcount[0][0])[i] = 0;
  __syncthreads();
  const uint32_t len = (lengths_nibbles[tid >> 1] >> (4 * (tid & 1))) & 15;
  const uint32_t same = __match_any_sync(0xffffffffu, len);
  const uint32_t rank = __popc(same & ((1u << lane) - 1));
  if (rank == 0) gcount[warp][len] = __popc(same);
  __syncthreads();
  if (tid < 16) {
    uint32_t sum = 0;
    for (int g = 0; g < kWarps; ++g) {
      gprefix[g][tid] = sum;
      sum += gcount[g][tid];
    }
    gcount[0][tid] = sum;  // totals per length (gprefix already holds what row 0 was needed for)
  }
  __syncthreads();
  if (tid == 0) {
    uint32_t code = 0, off = 0, prev = 0;
    for (int l = 1; l <= max_len; ++l) {
      code = (code + prev) << 1;
      const uint32_t c = gcount[0][l];
      first[l] = code;
      offset[l] = off;
      limit[l] = (code + c) << (max_len - l);
      off += c;
      prev = c;
    }
    // The host checked the lengths; a table that overflows the code space is still refused.
    if (limit[max_len] > (1u << max_len)) Fail(err, kBadTable, plane, 0);
  }
  __syncthreads();
  if (len > 0 && len <= static_cast<uint32_t>(max_len)) {
    uint32_t pos = offset[len] + gprefix[warp][len] + rank;
    if (pos < 256) sorted[pos] = static_cast<uint16_t>(tid);
  }
  __syncthreads();
  const uint32_t entries = 1u << max_len;
  for (uint32_t v = tid; v < entries; v += kThreads) {
    uint16_t e = 0;
    for (int l = 1; l <= max_len; ++l) {
      if (v < limit[l]) {
        uint32_t idx = offset[l] + ((v >> (max_len - l)) - first[l]);
        e = idx < 256 ? static_cast<uint16_t>(sorted[idx] << 4 | l) : 0;
        break;
      }
    }
    table[__brev(v) >> (32 - max_len)] = e;
  }
}

// Lane `lane` of a warp decodes stream `lane` of one unit into `out` (stride kStreamStride).
__device__ void DecodeUnit(const KJob& j, int k, uint32_t u, const uint16_t* table, uint8_t* out,
                           uint32_t* err) {
  const int lane = threadIdx.x & 31;
  const uint8_t* sec = j.src + j.plane_off[k];
  const uint32_t* utable = reinterpret_cast<const uint32_t*>(sec + kCodedUnitTableOffset);
  const uint32_t a = __ldg(utable + u), b = __ldg(utable + u + 1);
  const uint8_t* unit = sec + a;
  const uint32_t nw = unit[lane];
  uint32_t start = nw;
  for (int d = 1; d < 32; d <<= 1) {
    uint32_t v = __shfl_up_sync(0xffffffffu, start, d);
    if (lane >= d) start += v;
  }
  const uint32_t total = __shfl_sync(0xffffffffu, start, 31);
  start -= nw;
  if (kStreamsPerUnit + 4 * total != b - a) {
    if (lane == 0) Fail(err, kBadStreamTable, k, u);
    return;
  }
  const uint32_t* w = reinterpret_cast<const uint32_t*>(unit + kStreamsPerUnit) + start;
  const uint64_t s0 = uint64_t{u} * (32u * j.sps) + static_cast<uint64_t>(lane) * j.sps;
  const uint32_t nsym =
      s0 >= j.count ? 0u : (j.count - s0 < j.sps ? static_cast<uint32_t>(j.count - s0) : j.sps);
  const int max_len = j.max_len[k];
  const uint32_t mask = (1u << max_len) - 1;
  uint32_t* o = reinterpret_cast<uint32_t*>(out + lane * kStreamStride);
  uint64_t buf = 0;
  int nb = 0;
  uint32_t wi = 0, acc = 0, i = 0;
  bool bad = false;
  for (; i < nsym; ++i) {
    if (nb < 32 && wi < nw) {
      buf |= uint64_t{__ldg(w + wi)} << nb;
      ++wi;
      nb += 32;
    }
    const uint32_t e = table[buf & mask];
    const int len = e & 15;
    if (len == 0 || len > nb) {
      bad = true;
      break;
    }
    buf >>= len;
    nb -= len;
    acc |= (e >> 4) << (8 * (i & 3));
    if ((i & 3) == 3) {
      o[i >> 2] = acc;
      acc = 0;
    }
  }
  if (!bad && (i & 3)) o[i >> 2] = acc;
  if (bad) {
    Fail(err, kBadCode, k, u);
  } else if (wi != nw || buf != 0 || nb >= 32) {
    Fail(err, kBadPadding, k, u);
  }
}

// Bytes of element group [e, e+8) of plane k: raw from global memory, coded from shared.
// `unit_e0` is the first element of the unit whose shared buffers `coded_buf` holds.
__device__ __forceinline__ uint2 PlaneBytes(const KJob& j, int k, uint32_t e, uint32_t unit_e0,
                                            const uint8_t* const* coded_buf) {
  if (j.mode[k] == kPlaneRaw) {
    return __ldg(reinterpret_cast<const uint2*>(j.src + j.plane_off[k] + e));
  }
  const uint32_t r = e - unit_e0;
  const uint32_t t = r / j.sps, i = r - t * j.sps;
  const uint32_t* p = reinterpret_cast<const uint32_t*>(coded_buf[k] + t * kStreamStride + i);
  return make_uint2(p[0], p[1]);
}

__device__ __forceinline__ uint8_t PlaneByte(const KJob& j, int k, uint32_t e, uint32_t unit_e0,
                                             const uint8_t* const* coded_buf) {
  if (j.mode[k] == kPlaneRaw) return j.src[j.plane_off[k] + e];
  const uint32_t r = e - unit_e0;
  const uint32_t t = r / j.sps, i = r - t * j.sps;
  return coded_buf[k][t * kStreamStride + i];
}

__global__ void __launch_bounds__(kThreads) PlanesKernel(const __grid_constant__ KParams P) {
  extern __shared__ __align__(16) uint8_t smem[];
  // Which job: the CTA ranges are ascending.
  int ji = 0;
  while (ji + 1 < P.njobs && blockIdx.x >= P.jobs[ji + 1].first_cta) ++ji;
  const KJob& j = P.jobs[ji];
  uint32_t* err = P.errors + ji;
  const uint32_t usyms = 32u * j.sps;
  const uint32_t cta = blockIdx.x - j.first_cta;
  const uint32_t u0 = cta * P.upc;
  const uint32_t units = min(static_cast<uint32_t>(P.upc), j.nunits - u0);
  const uint32_t e0 = u0 * usyms;
  const uint32_t e1 = min(j.count, e0 + units * usyms);
  uint16_t* tables = reinterpret_cast<uint16_t*>(smem);
  uint8_t* symbols = smem + sizeof(uint16_t) * kTableEntries * j.coded;
  // Shared layout of the symbols: [unit][coded plane][stream][symbol].
  int coded_planes[kMaxWidth];
  int nc = 0;
  for (int k = 0; k < j.width; ++k) {
    if (j.mode[k] == kPlaneHuffman) coded_planes[nc++] = k;
  }
  for (int c = 0; c < nc; ++c) {
    const int k = coded_planes[c];
    BuildTable(j.src + j.plane_off[k] + kCodedLengthsOffset, j.max_len[k],
               tables + c * kTableEntries, err, k);
    __syncthreads();
  }
  const int warp = threadIdx.x >> 5;
  for (int task = warp; task < static_cast<int>(units) * nc; task += kWarps) {
    const int us = task / nc, c = task - us * nc;
    DecodeUnit(j, coded_planes[c], u0 + us, tables + c * kTableEntries,
               symbols + (us * nc + c) * kUnitBuffer, err);
  }
  __syncthreads();
  // Per unit slot, the shared buffer of each plane (null for raw planes).
  const int W = j.width;
  for (uint32_t g = e0 + 8 * threadIdx.x; g < e1; g += 8 * kThreads) {
    const uint32_t us = (g - e0) / usyms;
    const uint8_t* buf[kMaxWidth];
    for (int c = 0; c < nc; ++c) {
      buf[coded_planes[c]] = symbols + (us * nc + c) * kUnitBuffer;
    }
    const uint32_t base = e0 + us * usyms;  // buffers are per unit: offsets from its start
    uint8_t* out = j.dst + static_cast<size_t>(g) * W;
    if (g + 8 <= e1 && j.vec) {
      if (W == 2) {
        uint2 lo = PlaneBytes(j, 0, g, base, buf), hi = PlaneBytes(j, 1, g, base, buf);
        uint4 v;
        v.x = __byte_perm(lo.x, hi.x, 0x5140);
        v.y = __byte_perm(lo.x, hi.x, 0x7362);
        v.z = __byte_perm(lo.y, hi.y, 0x5140);
        v.w = __byte_perm(lo.y, hi.y, 0x7362);
        *reinterpret_cast<uint4*>(out) = v;
        continue;
      }
      if (W == 4) {
        uint2 p0 = PlaneBytes(j, 0, g, base, buf), p1 = PlaneBytes(j, 1, g, base, buf);
        uint2 p2 = PlaneBytes(j, 2, g, base, buf), p3 = PlaneBytes(j, 3, g, base, buf);
        uint32_t x0 = __byte_perm(p0.x, p1.x, 0x5140), x1 = __byte_perm(p0.x, p1.x, 0x7362);
        uint32_t y0 = __byte_perm(p2.x, p3.x, 0x5140), y1 = __byte_perm(p2.x, p3.x, 0x7362);
        uint32_t x2 = __byte_perm(p0.y, p1.y, 0x5140), x3 = __byte_perm(p0.y, p1.y, 0x7362);
        uint32_t y2 = __byte_perm(p2.y, p3.y, 0x5140), y3 = __byte_perm(p2.y, p3.y, 0x7362);
        uint4 a, b;
        a.x = __byte_perm(x0, y0, 0x5410);
        a.y = __byte_perm(x0, y0, 0x7632);
        a.z = __byte_perm(x1, y1, 0x5410);
        a.w = __byte_perm(x1, y1, 0x7632);
        b.x = __byte_perm(x2, y2, 0x5410);
        b.y = __byte_perm(x2, y2, 0x7632);
        b.z = __byte_perm(x3, y3, 0x5410);
        b.w = __byte_perm(x3, y3, 0x7632);
        reinterpret_cast<uint4*>(out)[0] = a;
        reinterpret_cast<uint4*>(out)[1] = b;
        continue;
      }
      if (W == 1) {
        *reinterpret_cast<uint2*>(out) = PlaneBytes(j, 0, g, base, buf);
        continue;
      }
    }
    const uint32_t n = min(8u, e1 - g);
    for (uint32_t i = 0; i < n; ++i) {
      for (int k = 0; k < W; ++k) out[i * W + k] = PlaneByte(j, k, g + i, base, buf);
    }
  }
}

}  // namespace

std::string DeviceErrorText(uint32_t code) {
  const char* what = "corrupt";
  switch (code & 15) {
    case kBadStreamTable:
      what = "stream lengths do not add up to the unit's size";
      break;
    case kBadCode:
      what = "invalid code or a stream that ends early";
      break;
    case kBadPadding:
      what = "stream length or padding does not match its codes";
      break;
    case kBadTable:
      what = "code lengths do not form a prefix code";
      break;
  }
  return StrCat("unit ", code >> 8, " of plane ", (code >> 4) & 15, ": ", what);
}

namespace {

constexpr size_t kMaxShared =
    sizeof(uint16_t) * kTableEntries * kMaxWidth + kWarps * size_t{kUnitBuffer};

// The current device's SM count, with the kernel configured for it (once per device).
Status ConfigureDevice(int* sms_out) {
  static std::atomic<uint64_t> configured{0};
  static std::atomic<int> sm_count[64];
  int device = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e != cudaSuccess) {
    return Error(StatusCode::kCudaError, "planes decode: cudaGetDevice: ", cudaGetErrorString(e));
  }
  int sms = sm_count[device & 63].load(std::memory_order_relaxed);
  if (sms == 0) {
    if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
        sms <= 0) {
      sms = 132;
    }
    sm_count[device & 63].store(sms, std::memory_order_relaxed);
  }
  // The shared-memory opt-in belongs to each device's context.
  const uint64_t bit = uint64_t{1} << (device & 63);
  if (!(configured.load(std::memory_order_acquire) & bit)) {
    e = cudaFuncSetAttribute(PlanesKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             static_cast<int>(kMaxShared));
    if (e != cudaSuccess) {
      return Error(StatusCode::kCudaError,
                   "planes decode: cudaFuncSetAttribute: ", cudaGetErrorString(e));
    }
    configured.fetch_or(bit, std::memory_order_acq_rel);
  }
  *sms_out = sms;
  return Status::Ok();
}

}  // namespace

Status PrepareDevice() {
  int sms = 0;
  return ConfigureDevice(&sms);
}

Status DecodeOnDevice(const DeviceJob* jobs, int n, uint32_t* errors, cudaStream_t stream) {
  if (n <= 0) return Status::Ok();
  int sms = 0;
  FERRY_RETURN_IF_ERROR(ConfigureDevice(&sms));
  cudaError_t e;
  for (int first = 0; first < n;) {
    KParams p;
    std::memset(&p, 0, sizeof(p));
    int coded_max = 0;
    int count = 0;
    for (int i = first; i < n && count < kMaxJobs; ++i, ++count) {
      coded_max = std::max(coded_max, static_cast<int>(jobs[i].layout.coded_planes));
    }
    // Units per CTA: up to one per warp, fewer when the launch is small, so that a single
    // block still spreads over every SM (each CTA then builds its tables for less work).
    uint64_t units = 0;
    for (int i = first; i < first + count; ++i) units += jobs[i].layout.nunits;
    const int upc = static_cast<int>(std::clamp<uint64_t>(
        units / (2 * static_cast<uint64_t>(sms)), 1, std::max(1, kWarps / std::max(coded_max, 1))));
    uint32_t ctas = 0;
    for (int c = 0; c < count; ++c) {
      const DeviceJob& d = jobs[first + c];
      const Layout& l = d.layout;
      if (reinterpret_cast<uintptr_t>(d.src) % 16 != 0) {
        return Error(StatusCode::kInvalidArgument,
                     "planes decode: source block not 16-byte aligned");
      }
      KJob& k = p.jobs[c];
      k.src = d.src;
      k.dst = d.dst;
      k.count = l.count;
      k.nunits = l.nunits;
      k.first_cta = ctas;
      k.sps = static_cast<uint16_t>(l.symbols_per_stream);
      k.width = static_cast<uint8_t>(l.width);
      k.coded = static_cast<uint8_t>(l.coded_planes);
      k.vec = reinterpret_cast<uintptr_t>(d.dst) % 16 == 0;
      for (uint32_t w = 0; w < kMaxWidth; ++w) {
        k.plane_off[w] = l.plane[w].offset;
        k.mode[w] = l.plane[w].mode;
        k.max_len[w] = l.plane[w].max_len;
      }
      ctas += (l.nunits + upc - 1) / upc;
      if (l.tail_size) {
        e = cudaMemcpyAsync(d.dst + size_t{l.count} * l.width, d.src + l.tail_offset, l.tail_size,
                            cudaMemcpyDeviceToDevice, stream);
        if (e != cudaSuccess) {
          return Error(StatusCode::kCudaError, "planes decode: tail copy: ", cudaGetErrorString(e));
        }
      }
    }
    p.errors = errors + first;
    p.njobs = count;
    p.upc = upc;
    if (ctas > 0) {
      size_t shared = sizeof(uint16_t) * kTableEntries * coded_max +
                      static_cast<size_t>(upc) * coded_max * kUnitBuffer;
      if (shared > kMaxShared) shared = kMaxShared;
      PlanesKernel<<<ctas, kThreads, shared, stream>>>(p);
      e = cudaGetLastError();
      if (e != cudaSuccess) {
        return Error(StatusCode::kCudaError,
                     "planes decode: kernel launch: ", cudaGetErrorString(e));
      }
    }
    first += count;
  }
  return Status::Ok();
}

}  // namespace ferry::planes
