// XXH3-64 with seed 0 and the default secret, the block checksum of the format (Checksum64
// computes it through libxxhash), written once for the host compiler and for CUDA devices: the
// device checks blocks that only ever exist in device memory, and the host tests hold this code
// to libxxhash for every length class.
//
// Besides the whole hash (Hash64) this header holds the pieces the device kernel puts together
// in another order. The long path feeds each of the 8 accumulator lanes with one 8-byte word of
// every 64-byte stripe, and scrambles the lanes after every 1024 bytes (16 stripes, a "stripe
// block"). Between two scrambles a lane only adds, so what a stripe block adds to a lane (its
// contribution) can be summed by any thread, in any order, long before the lane needs it; only
// the scrambles, one per KiB and lane, have to run one after the other.
#ifndef FERRY_SRC_CODEC_XXH3_DEVICE_CUH_
#define FERRY_SRC_CODEC_XXH3_DEVICE_CUH_

#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define FERRY_XXH3_FN __host__ __device__ __forceinline__
#define FERRY_XXH3_UNROLL _Pragma("unroll")
#define FERRY_XXH3_UNROLL16 _Pragma("unroll 16")
#else
#define FERRY_XXH3_FN inline
#define FERRY_XXH3_UNROLL
#define FERRY_XXH3_UNROLL16
#endif

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "xxh3_device.cuh reads words in the host's byte order, which must be little-endian"
#endif

namespace ferry::xxh3 {

inline constexpr uint64_t kPrime32_1 = 0x9E3779B1u;
inline constexpr uint64_t kPrime32_2 = 0x85EBCA77u;
inline constexpr uint64_t kPrime32_3 = 0xC2B2AE3Du;
inline constexpr uint64_t kPrime64_1 = 0x9E3779B185EBCA87ull;
inline constexpr uint64_t kPrime64_2 = 0xC2B2AE3D27D4EB4Full;
inline constexpr uint64_t kPrime64_3 = 0x165667B19E3779F9ull;
inline constexpr uint64_t kPrime64_4 = 0x85EBCA77C2B2AE63ull;
inline constexpr uint64_t kPrime64_5 = 0x27D4EB2F165667C5ull;

inline constexpr int kStripeBytes = 64;
inline constexpr int kStripesPerBlock = 16;  // (secret size - stripe) / 8 secret bytes a stripe
inline constexpr int kStripeBlockBytes = kStripeBytes * kStripesPerBlock;
inline constexpr int kMidSizeMax = 240;  // longer inputs take the long path
inline constexpr int kSecretWords = 24;

// The default secret (192 bytes) as little-endian 64-bit words, so that device code can keep it
// in registers, shared or constant memory and read it at any byte offset (SecretAt).
struct Secret {
  uint64_t w[kSecretWords];
};
inline constexpr Secret kSecret = {{
    0xbe4ba423396cfeb8ull, 0x1cad21f72c81017cull, 0xdb979083e96dd4deull, 0x1f67b3b7a4a44072ull,
    0x78e5c0cc4ee679cbull, 0x2172ffcc7dd05a82ull, 0x8e2443f7744608b8ull, 0x4c263a81e69035e0ull,
    0xcb00c391bb52283cull, 0xa32e531b8b65d088ull, 0x4ef90da297486471ull, 0xd8acdea946ef1938ull,
    0x3f349ce33f76faa8ull, 0x1d4f0bc7c7bbdcf9ull, 0x3159b4cd4be0518aull, 0x647378d9c97e9fc8ull,
    0xc3ebd33483acc5eaull, 0xeb6313faffa081c5ull, 0x49daf0b751dd0d17ull, 0x9e68d429265516d3ull,
    0xfca1477d58be162bull, 0xce31d07ad1b8f88full, 0x280416958f3acb45ull, 0x7e404bbbcafbd7afull,
}};

// Bytes [off, off + 8) of the secret given as words; off <= 184.
FERRY_XXH3_FN uint64_t SecretAt(const uint64_t* sw, unsigned off) {
  const unsigned i = off >> 3, sh = 8 * (off & 7);
  return sh == 0 ? sw[i] : (sw[i] >> sh) | (sw[i + 1] << (64 - sh));
}

FERRY_XXH3_FN uint64_t ReadLE64(const uint8_t* p) {
  uint64_t v;
  memcpy(&v, p, 8);
  return v;
}
FERRY_XXH3_FN uint32_t ReadLE32(const uint8_t* p) {
  uint32_t v;
  memcpy(&v, p, 4);
  return v;
}

// The product of the low and high halves of x, as unsigned 32-bit values (one wide multiply).
FERRY_XXH3_FN uint64_t Mul32x32(uint64_t x) {
#if defined(__CUDA_ARCH__)
  // The compiler turns the portable form into a full 64-bit multiply.
  uint64_t r;
  asm("mul.wide.u32 %0, %1, %2;"
      : "=l"(r)
      : "r"(static_cast<uint32_t>(x)), "r"(static_cast<uint32_t>(x >> 32)));
  return r;
#else
  return uint64_t{static_cast<uint32_t>(x)} * static_cast<uint32_t>(x >> 32);
#endif
}

// The 128-bit product of a and b, its halves xor-ed together.
FERRY_XXH3_FN uint64_t Fold64(uint64_t a, uint64_t b) {
#if defined(__CUDA_ARCH__)
  return (a * b) ^ __umul64hi(a, b);
#else
  const unsigned __int128 p = static_cast<unsigned __int128>(a) * b;
  return static_cast<uint64_t>(p) ^ static_cast<uint64_t>(p >> 64);
#endif
}

FERRY_XXH3_FN uint64_t Rotl64(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

FERRY_XXH3_FN uint64_t Swap64(uint64_t x) {
  x = ((x & 0x00FF00FF00FF00FFull) << 8) | ((x >> 8) & 0x00FF00FF00FF00FFull);
  x = ((x & 0x0000FFFF0000FFFFull) << 16) | ((x >> 16) & 0x0000FFFF0000FFFFull);
  return (x << 32) | (x >> 32);
}

// The final mix of the XXH64 family, used by the shortest inputs.
FERRY_XXH3_FN uint64_t Avalanche64(uint64_t h) {
  h ^= h >> 33;
  h *= kPrime64_2;
  h ^= h >> 29;
  h *= kPrime64_3;
  return h ^ (h >> 32);
}

FERRY_XXH3_FN uint64_t Avalanche(uint64_t h) {
  h ^= h >> 37;
  h *= 0x165667919E3779F9ull;
  return h ^ (h >> 32);
}

FERRY_XXH3_FN uint64_t Rrmxmx(uint64_t h, uint64_t len) {
  h ^= Rotl64(h, 49) ^ Rotl64(h, 24);
  h *= 0x9FB21C651E98DF25ull;
  h ^= (h >> 35) + len;
  h *= 0x9FB21C651E98DF25ull;
  return h ^ (h >> 28);
}

// 16 input bytes against 16 secret bytes at byte offset `off`.
FERRY_XXH3_FN uint64_t Mix16(const uint8_t* in, const uint64_t* sw, unsigned off) {
  return Fold64(ReadLE64(in) ^ SecretAt(sw, off), ReadLE64(in + 8) ^ SecretAt(sw, off + 8));
}

// Inputs of at most 16 bytes.
FERRY_XXH3_FN uint64_t HashUpTo16(const uint8_t* p, size_t len, const uint64_t* sw) {
  if (len > 8) {
    const uint64_t lo = ReadLE64(p) ^ (SecretAt(sw, 24) ^ SecretAt(sw, 32));
    const uint64_t hi = ReadLE64(p + len - 8) ^ (SecretAt(sw, 40) ^ SecretAt(sw, 48));
    return Avalanche(len + Swap64(lo) + hi + Fold64(lo, hi));
  }
  if (len >= 4) {
    const uint64_t first = ReadLE32(p), last = ReadLE32(p + len - 4);
    const uint64_t keyed = (last + (first << 32)) ^ (SecretAt(sw, 8) ^ SecretAt(sw, 16));
    return Rrmxmx(keyed, len);
  }
  if (len > 0) {
    const uint32_t combined = (uint32_t{p[0]} << 16) | (uint32_t{p[len >> 1]} << 24) |
                              uint32_t{p[len - 1]} | (static_cast<uint32_t>(len) << 8);
    const uint64_t bitflip = (sw[0] & 0xFFFFFFFFull) ^ (sw[0] >> 32);
    return Avalanche64(combined ^ bitflip);
  }
  return Avalanche64(SecretAt(sw, 56) ^ SecretAt(sw, 64));
}

// Inputs of 17 to 128 bytes: pairs of 16-byte pieces from both ends, working inwards.
FERRY_XXH3_FN uint64_t Hash17To128(const uint8_t* p, size_t len, const uint64_t* sw) {
  uint64_t acc = len * kPrime64_1;
  if (len > 32) {
    if (len > 64) {
      if (len > 96) {
        acc += Mix16(p + 48, sw, 96);
        acc += Mix16(p + len - 64, sw, 112);
      }
      acc += Mix16(p + 32, sw, 64);
      acc += Mix16(p + len - 48, sw, 80);
    }
    acc += Mix16(p + 16, sw, 32);
    acc += Mix16(p + len - 32, sw, 48);
  }
  acc += Mix16(p, sw, 0);
  acc += Mix16(p + len - 16, sw, 16);
  return Avalanche(acc);
}

// Inputs of 129 to 240 bytes: the first 128 bytes, an avalanche, then the rest in 16-byte
// pieces against the secret from byte 3, and the last 16 bytes against bytes [119, 135).
FERRY_XXH3_FN uint64_t Hash129To240(const uint8_t* p, size_t len, const uint64_t* sw) {
  uint64_t acc = len * kPrime64_1;
  for (unsigned i = 0; i < 8; ++i) acc += Mix16(p + 16 * i, sw, 16 * i);
  acc = Avalanche(acc);
  const unsigned rounds = static_cast<unsigned>(len / 16);
  for (unsigned i = 8; i < rounds; ++i) acc += Mix16(p + 16 * i, sw, 16 * (i - 8) + 3);
  acc += Mix16(p + len - 16, sw, 136 - 17);
  return Avalanche(acc);
}

// --- The long path, lane by lane ---------------------------------------------------------

FERRY_XXH3_FN uint64_t InitLane(int lane) {
  switch (lane) {
    case 0:
      return kPrime32_3;
    case 1:
      return kPrime64_1;
    case 2:
      return kPrime64_2;
    case 3:
      return kPrime64_3;
    case 4:
      return kPrime64_4;
    case 5:
      return kPrime32_2;
    case 6:
      return kPrime64_5;
    default:
      return kPrime32_1;
  }
}

// What one stripe adds to lanes 2p (`even`) and 2p + 1 (`odd`): each lane takes the product of
// the halves of its own keyed word plus the unkeyed word of the other lane of its pair.
FERRY_XXH3_FN void AccumulatePair(uint64_t& even, uint64_t& odd, uint64_t d_even, uint64_t d_odd,
                                  uint64_t k_even, uint64_t k_odd) {
  even += d_odd + Mul32x32(d_even ^ k_even);
  odd += d_even + Mul32x32(d_odd ^ k_odd);
}

// After every stripe block; `key` is secret word 16 + lane.
FERRY_XXH3_FN uint64_t ScrambleLane(uint64_t acc, uint64_t key) {
  acc ^= acc >> 47;
  acc ^= key;
  return acc * kPrime32_1;
}

// The accumulator words merge pairwise: lane `lane` enters as acc ^ SecretAt(11 + 8 * lane).
FERRY_XXH3_FN uint64_t MergeInput(uint64_t acc, int lane, const uint64_t* sw) {
  return acc ^ SecretAt(sw, 11 + 8 * static_cast<unsigned>(lane));
}
FERRY_XXH3_FN uint64_t Merge(const uint64_t acc[8], uint64_t len, const uint64_t* sw) {
  uint64_t h = len * kPrime64_1;
  for (int i = 0; i < 8; i += 2) {
    h += Fold64(MergeInput(acc[i], i, sw), MergeInput(acc[i + 1], i + 1, sw));
  }
  return Avalanche(h);
}

// Loaders of 16 input bytes at a byte offset (a multiple of 16) from the start of an input, as
// two little-endian words. The device kernel picks one per input by the input's alignment; the
// host runs the same code with plain memory reads.
struct Words16 {
  uint64_t lo, hi;
};

// Inputs aligned to 16 bytes: one vector load.
struct Aligned16Loader {
  const uint8_t* p;
  FERRY_XXH3_FN Words16 operator()(uint64_t off) const {
#if defined(__CUDA_ARCH__)
    const ulonglong2 v = __ldg(reinterpret_cast<const ulonglong2*>(p + off));
    return {v.x, v.y};
#else
    Words16 v;
    memcpy(&v, p + off, 16);
    return v;
#endif
  }
};

// Inputs aligned to 8 bytes.
struct Aligned8Loader {
  const uint8_t* p;
  FERRY_XXH3_FN Words16 operator()(uint64_t off) const {
#if defined(__CUDA_ARCH__)
    const unsigned long long* q = reinterpret_cast<const unsigned long long*>(p + off);
    return {__ldg(q), __ldg(q + 1)};
#else
    Words16 v;
    memcpy(&v, p + off, 16);
    return v;
#endif
  }
};

FERRY_XXH3_FN uint32_t FunnelRight(uint32_t lo, uint32_t hi, unsigned bits) {
#if defined(__CUDA_ARCH__)
  return __funnelshift_r(lo, hi, bits);
#else
  return static_cast<uint32_t>(((uint64_t{hi} << 32) | lo) >> (bits & 31));
#endif
}

// Any other alignment: the input starts `4 * kWord + bits / 8` bytes past a 16-byte boundary
// `base`; the two aligned 16-byte words around the wanted bytes are loaded and shifted into
// place. It reads up to 15 bytes before and 16 after the wanted ones, so callers use it only
// where those bytes belong to the input too.
template <int kWord>
struct ShiftLoader {
  const uint8_t* base;
  unsigned bits;  // 0, 8, 16 or 24
  FERRY_XXH3_FN Words16 operator()(uint64_t off) const {
    uint32_t w[8];
#if defined(__CUDA_ARCH__)
    const uint4 a = __ldg(reinterpret_cast<const uint4*>(base + off));
    const uint4 b = __ldg(reinterpret_cast<const uint4*>(base + off + 16));
    w[0] = a.x, w[1] = a.y, w[2] = a.z, w[3] = a.w, w[4] = b.x, w[5] = b.y, w[6] = b.z, w[7] = b.w;
#else
    memcpy(w, base + off, 32);
#endif
    uint32_t o[4];
    FERRY_XXH3_UNROLL
    for (int j = 0; j < 4; ++j) o[j] = FunnelRight(w[j + kWord], w[j + kWord + 1], bits);
    return {(uint64_t{o[1]} << 32) | o[0], (uint64_t{o[3]} << 32) | o[2]};
  }
};

// Any alignment, one byte at a time: for the edges of misaligned inputs.
FERRY_XXH3_FN uint64_t LoadBytes64(const uint8_t* p) {
#if defined(__CUDA_ARCH__)
  uint64_t v = 0;
  FERRY_XXH3_UNROLL
  for (int i = 0; i < 8; ++i) v |= uint64_t{__ldg(p + i)} << (8 * i);
  return v;
#else
  return ReadLE64(p);
#endif
}
struct ByteLoader {
  const uint8_t* p;
  FERRY_XXH3_FN Words16 operator()(uint64_t off) const {
    return {LoadBytes64(p + off), LoadBytes64(p + off + 8)};
  }
};

// ShiftLoader for the stripe blocks at the input's edges: a load whose aligned words would reach
// outside the input reads single bytes instead (at most the first and the last few).
template <int kWord>
struct EdgeShiftLoader {
  const uint8_t* p;
  unsigned r;  // p's offset past a 16-byte boundary, 1 to 15
  uint64_t len;
  FERRY_XXH3_FN Words16 operator()(uint64_t off) const {
    if (off >= 16 && off + 32 <= len + r) return ShiftLoader<kWord>{p - r, 8 * (r & 3)}(off);
    return ByteLoader{p}(off);
  }
};

// 8 bytes at any address.
FERRY_XXH3_FN uint64_t LoadAny64(const uint8_t* p) {
#if defined(__CUDA_ARCH__)
  if ((reinterpret_cast<uintptr_t>(p) & 7) == 0) {
    return __ldg(reinterpret_cast<const unsigned long long*>(p));
  }
#endif
  return LoadBytes64(p);
}

// What stripe block `g` (bytes [1024 g, 1024 g + 1024)) adds to lanes 2p and 2p + 1 before the
// scramble that follows it.
template <class Load>
FERRY_XXH3_FN void StripeBlockPair(const Load& load, uint64_t g, int p, const uint64_t* sw,
                                   uint64_t& even, uint64_t& odd) {
  even = 0;
  odd = 0;
  const uint64_t first = g * kStripeBlockBytes + 16 * static_cast<unsigned>(p);
  FERRY_XXH3_UNROLL
  for (int s = 0; s < kStripesPerBlock; ++s) {
    const Words16 d = load(first + kStripeBytes * s);
    AccumulatePair(even, odd, d.lo, d.hi, sw[s + 2 * p], sw[s + 2 * p + 1]);
  }
}

// How the device loads the stripe blocks of an input, by the input's address: kAligned16 and
// kAligned8 load the words in place; 0 to 3 (the start's 4-byte word within its 16 bytes) shift
// them out of aligned 16-byte loads.
inline constexpr int kAligned16 = 4;
inline constexpr int kAligned8 = 5;
FERRY_XXH3_FN int LoadModeOf(const uint8_t* p) {
  const unsigned r = static_cast<unsigned>(reinterpret_cast<uintptr_t>(p) & 15);
  return r == 0 ? kAligned16 : r == 8 ? kAligned8 : static_cast<int>(r >> 2);
}

// StripeBlockPair for input `p` of `len` bytes in load mode kMode (LoadModeOf(p)). The shifted
// loads stay within the input except in the first stripe block and, for some lengths, the last
// full one: those check each load.
template <int kMode>
FERRY_XXH3_FN void LoadedStripeBlockPair(const uint8_t* p, uint64_t len, uint64_t g, int pair,
                                         const uint64_t* sw, uint64_t& even, uint64_t& odd) {
  if constexpr (kMode == kAligned16) {
    StripeBlockPair(Aligned16Loader{p}, g, pair, sw, even, odd);
  } else if constexpr (kMode == kAligned8) {
    StripeBlockPair(Aligned8Loader{p}, g, pair, sw, even, odd);
  } else {
    const unsigned r = static_cast<unsigned>(reinterpret_cast<uintptr_t>(p) & 15);
    if (g >= 1 && (g + 1) * kStripeBlockBytes + 16 <= len) {
      StripeBlockPair(ShiftLoader<kMode>{p - r, 8 * (r & 3)}, g, pair, sw, even, odd);
    } else {
      StripeBlockPair(EdgeShiftLoader<kMode>{p, r, len}, g, pair, sw, even, odd);
    }
  }
}

// Full stripe blocks of a long input (len > 240); the stripes after them are the tail.
FERRY_XXH3_FN uint64_t FullStripeBlocks(uint64_t len) { return (len - 1) / kStripeBlockBytes; }

// The tail: the stripes of the last, partial stripe block (keyed with the secret from its start,
// as in any stripe block) and then the input's last 64 bytes (overlapping what came before,
// keyed from secret byte 121). It adds to the lanes after the last scramble. TailStripeLane is
// what tail stripe `s` adds to lane `lane`: s < 16 are the partial block's stripes (0 past its
// end), s = 16 the last 64 bytes.
inline constexpr int kTailStripes = kStripesPerBlock + 1;
FERRY_XXH3_FN uint64_t TailStripeLane(const uint8_t* p, uint64_t len, int s, int lane,
                                      const uint64_t* sw) {
  const unsigned own = 8 * static_cast<unsigned>(lane), other = 8 * static_cast<unsigned>(lane ^ 1);
  const uint8_t* q;
  uint64_t key;
  if (s < kStripesPerBlock) {
    const uint64_t start = FullStripeBlocks(len) * kStripeBlockBytes;
    if (static_cast<uint64_t>(s) >= ((len - 1) - start) / kStripeBytes) return 0;
    q = p + start + kStripeBytes * s;
    key = sw[s + lane];
  } else {
    q = p + len - kStripeBytes;
    key = SecretAt(sw, 121 + own);
  }
  return LoadAny64(q + other) + Mul32x32(LoadAny64(q + own) ^ key);
}

// --- The device kernel's schedule ----------------------------------------------------------
// One thread block (CTA) hashes one long input in rounds separated by barriers. In round `it`
// the 256 loader threads sum the stripe blocks of chunk `it` (64 stripe blocks, 4 threads per
// stripe block, one per lane pair) into one half of an Exchange, while the 8 chain threads (one
// per lane) run the scrambles of chunk it - 1 from the other half. The round after the last
// chunk, the loaders compute the tail. Threads of one round share nothing, so the host runs the
// schedule thread after thread to check it.
inline constexpr int kLoaderThreads = 256;
inline constexpr int kChunkBlocks = kLoaderThreads / 4;
static_assert(8 * kTailStripes <= kLoaderThreads, "one loader thread per tail word");

struct Exchange {
  alignas(16) uint64_t contrib[2][kChunkBlocks][8];  // per stripe block of a chunk and lane
  uint64_t tail[kTailStripes][8];                    // per tail stripe and lane
};

FERRY_XXH3_FN uint64_t Chunks(uint64_t len) {
  return (FullStripeBlocks(len) + kChunkBlocks - 1) / kChunkBlocks;
}

// Loader thread `t` (0 to 255) in round `it` (0 to Chunks(len)) of input `p` in load mode kMode.
template <int kMode>
FERRY_XXH3_FN void LoaderRound(const uint8_t* p, uint64_t len, uint64_t it, int t,
                               const uint64_t* sw, Exchange& x) {
  const int local = t >> 2, pair = t & 3;
  const uint64_t g = it * kChunkBlocks + local;
  if (g < FullStripeBlocks(len)) {
    uint64_t even, odd;
    LoadedStripeBlockPair<kMode>(p, len, g, pair, sw, even, odd);
    uint64_t* out = &x.contrib[it & 1][local][2 * pair];
#if defined(__CUDA_ARCH__)
    *reinterpret_cast<ulonglong2*>(out) = make_ulonglong2(even, odd);
#else
    out[0] = even;
    out[1] = odd;
#endif
  } else if (it == Chunks(len) && t < 8 * kTailStripes) {
    x.tail[t >> 3][t & 7] = TailStripeLane(p, len, t >> 3, t & 7, sw);
  }
}

// Chain thread `lane` (0 to 7) in round `it`: returns its accumulator after the scrambles of
// chunk it - 1. `key` is secret word 16 + lane.
FERRY_XXH3_FN uint64_t ChainRound(uint64_t acc, uint64_t len, uint64_t it, int lane, uint64_t key,
                                  const Exchange& x) {
  if (it == 0) return acc;
  const uint64_t c = it - 1;
  const uint64_t* in = &x.contrib[c & 1][0][lane];
  const uint64_t left = FullStripeBlocks(len) - c * kChunkBlocks;
  if (left >= kChunkBlocks) {
    FERRY_XXH3_UNROLL16
    for (int j = 0; j < kChunkBlocks; ++j) acc = ScrambleLane(acc + in[8 * j], key);
  } else {
    for (int j = 0; j < static_cast<int>(left); ++j) acc = ScrambleLane(acc + in[8 * j], key);
  }
  return acc;
}

// After the last round: the lane's accumulator with the tail added, ready for Merge.
FERRY_XXH3_FN uint64_t ChainFinish(uint64_t acc, int lane, const Exchange& x) {
  FERRY_XXH3_UNROLL
  for (int s = 0; s < kTailStripes; ++s) acc += x.tail[s][lane];
  return acc;
}

// Inputs longer than 240 bytes, stripe after stripe as the reference does it.
FERRY_XXH3_FN uint64_t HashLong(const uint8_t* p, uint64_t len, const uint64_t* sw) {
  uint64_t acc[8];
  for (int i = 0; i < 8; ++i) acc[i] = InitLane(i);
  const uint64_t blocks = FullStripeBlocks(len);
  for (uint64_t g = 0; g < blocks; ++g) {
    for (int s = 0; s < kStripesPerBlock; ++s) {
      const uint8_t* q = p + g * kStripeBlockBytes + kStripeBytes * s;
      for (int i = 0; i < 8; i += 2) {
        AccumulatePair(acc[i], acc[i + 1], ReadLE64(q + 8 * i), ReadLE64(q + 8 * i + 8), sw[s + i],
                       sw[s + i + 1]);
      }
    }
    for (int i = 0; i < 8; ++i) acc[i] = ScrambleLane(acc[i], sw[16 + i]);
  }
  for (int s = 0; s < kTailStripes; ++s) {
    for (int i = 0; i < 8; ++i) acc[i] += TailStripeLane(p, len, s, i, sw);
  }
  return Merge(acc, len, sw);
}

// XXH3_64bits(p, len): `sw` holds kSecret (on a device, a copy in device memory).
FERRY_XXH3_FN uint64_t Hash64(const uint8_t* p, uint64_t len, const uint64_t* sw) {
  if (len <= 16) return HashUpTo16(p, static_cast<size_t>(len), sw);
  if (len <= 128) return Hash17To128(p, static_cast<size_t>(len), sw);
  if (len <= kMidSizeMax) return Hash129To240(p, static_cast<size_t>(len), sw);
  return HashLong(p, len, sw);
}

}  // namespace ferry::xxh3

#endif  // FERRY_SRC_CODEC_XXH3_DEVICE_CUH_
