#include "codec/codec.hpp"

#include <zstd.h>

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <new>

#if defined(__x86_64__)
#include <emmintrin.h>
#endif

#define XXH_INLINE_ALL
#include <xxhash.h>

#include "base/util.hpp"

namespace ferry {

uint64_t Checksum64(const void* data, size_t size) { return XXH3_64bits(data, size); }

StreamingChecksum::StreamingChecksum() : state_(XXH3_createState()) {
  XXH3_64bits_reset(static_cast<XXH3_state_t*>(state_));
}
StreamingChecksum::~StreamingChecksum() { XXH3_freeState(static_cast<XXH3_state_t*>(state_)); }
void StreamingChecksum::Update(const void* data, size_t size) {
  XXH3_64bits_update(static_cast<XXH3_state_t*>(state_), data, size);
}
uint64_t StreamingChecksum::Digest() const {
  return XXH3_64bits_digest(static_cast<const XXH3_state_t*>(state_));
}

namespace {
template <size_t W>
void ShuffleFixed(const uint8_t* src, uint8_t* dst, size_t count, size_t from) {
  for (size_t i = from; i < count; ++i) {
    for (size_t k = 0; k < W; ++k) dst[k * count + i] = src[i * W + k];
  }
}
// Planes `stride` bytes apart: a whole block's planes (stride == count), or a run of elements
// in the middle of one (UnshuffleRange).
template <size_t W>
void UnshuffleStrided(const uint8_t* src, size_t stride, uint8_t* dst, size_t count, size_t from) {
  for (size_t i = from; i < count; ++i) {
    for (size_t k = 0; k < W; ++k) dst[i * W + k] = src[k * stride + i];
  }
}
template <size_t W>
void UnshuffleFixed(const uint8_t* src, uint8_t* dst, size_t count, size_t from) {
  UnshuffleStrided<W>(src, count, dst, count, from);
}

#if defined(__x86_64__)
// SSE2 (baseline on x86-64): 16 elements per step; the scalar loops finish the tail.
inline __m128i Load(const uint8_t* p) {
  return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
}
inline void Store(uint8_t* p, __m128i v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), v); }

// Splits 32 bytes of 2-byte elements into their low and high bytes.
inline void Split2(__m128i v0, __m128i v1, __m128i* lo, __m128i* hi) {
  const __m128i mask = _mm_set1_epi16(0x00ff);
  *lo = _mm_packus_epi16(_mm_and_si128(v0, mask), _mm_and_si128(v1, mask));
  *hi = _mm_packus_epi16(_mm_srli_epi16(v0, 8), _mm_srli_epi16(v1, 8));
}

size_t Shuffle2(const uint8_t* src, uint8_t* dst, size_t count) {
  size_t i = 0;
  for (; i + 16 <= count; i += 16) {
    __m128i lo, hi;
    Split2(Load(src + 2 * i), Load(src + 2 * i + 16), &lo, &hi);
    Store(dst + i, lo);
    Store(dst + count + i, hi);
  }
  return i;
}

size_t Shuffle4(const uint8_t* src, uint8_t* dst, size_t count) {
  size_t i = 0;
  for (; i + 16 <= count; i += 16) {
    const uint8_t* s = src + 4 * i;
    // Bytes (0,2) and (1,3) of each element, then each pair split again.
    __m128i e0, o0, e1, o1;
    Split2(Load(s), Load(s + 16), &e0, &o0);
    Split2(Load(s + 32), Load(s + 48), &e1, &o1);
    __m128i b0, b2, b1, b3;
    Split2(e0, e1, &b0, &b2);
    Split2(o0, o1, &b1, &b3);
    Store(dst + i, b0);
    Store(dst + count + i, b1);
    Store(dst + 2 * count + i, b2);
    Store(dst + 3 * count + i, b3);
  }
  return i;
}

size_t Unshuffle2Strided(const uint8_t* src, size_t stride, uint8_t* dst, size_t count) {
  size_t i = 0;
  for (; i + 16 <= count; i += 16) {
    __m128i a = Load(src + i), b = Load(src + stride + i);
    Store(dst + 2 * i, _mm_unpacklo_epi8(a, b));
    Store(dst + 2 * i + 16, _mm_unpackhi_epi8(a, b));
  }
  return i;
}

size_t Unshuffle4Strided(const uint8_t* src, size_t stride, uint8_t* dst, size_t count) {
  size_t i = 0;
  for (; i + 16 <= count; i += 16) {
    __m128i a0 = Load(src + i), a1 = Load(src + stride + i);
    __m128i a2 = Load(src + 2 * stride + i), a3 = Load(src + 3 * stride + i);
    __m128i t0 = _mm_unpacklo_epi8(a0, a1), t1 = _mm_unpackhi_epi8(a0, a1);
    __m128i t2 = _mm_unpacklo_epi8(a2, a3), t3 = _mm_unpackhi_epi8(a2, a3);
    uint8_t* d = dst + 4 * i;
    Store(d, _mm_unpacklo_epi16(t0, t2));
    Store(d + 16, _mm_unpackhi_epi16(t0, t2));
    Store(d + 32, _mm_unpacklo_epi16(t1, t3));
    Store(d + 48, _mm_unpackhi_epi16(t1, t3));
  }
  return i;
}
#else
size_t Shuffle2(const uint8_t*, uint8_t*, size_t) { return 0; }
size_t Shuffle4(const uint8_t*, uint8_t*, size_t) { return 0; }
size_t Unshuffle2Strided(const uint8_t*, size_t, uint8_t*, size_t) { return 0; }
size_t Unshuffle4Strided(const uint8_t*, size_t, uint8_t*, size_t) { return 0; }
#endif
size_t Unshuffle2(const uint8_t* src, uint8_t* dst, size_t count) {
  return Unshuffle2Strided(src, count, dst, count);
}
size_t Unshuffle4(const uint8_t* src, uint8_t* dst, size_t count) {
  return Unshuffle4Strided(src, count, dst, count);
}
}  // namespace

namespace {
// Both directions share the dispatch: a SIMD head for 2- and 4-byte elements, a scalar tail,
// and trailing bytes of a partial element copied as they are.
template <size_t (*Simd2)(const uint8_t*, uint8_t*, size_t),
          size_t (*Simd4)(const uint8_t*, uint8_t*, size_t), template <size_t> class Scalar>
void Transpose(const uint8_t* src, uint8_t* dst, size_t n, size_t itemsize) {
  size_t count = itemsize ? n / itemsize : 0;
  switch (itemsize) {
    case 2:
      Scalar<2>::Run(src, dst, count, Simd2(src, dst, count));
      break;
    case 4:
      Scalar<4>::Run(src, dst, count, Simd4(src, dst, count));
      break;
    case 8:
      Scalar<8>::Run(src, dst, count, 0);
      break;
    default:
      count = 0;
      break;
  }
  size_t done = count * itemsize;
  // memcpy with a null pointer is undefined even for zero bytes (empty tensors pass null).
  if (n > done) std::memcpy(dst + done, src + done, n - done);
}

template <size_t W>
struct ShuffleScalar {
  static void Run(const uint8_t* s, uint8_t* d, size_t c, size_t f) { ShuffleFixed<W>(s, d, c, f); }
};
template <size_t W>
struct UnshuffleScalar {
  static void Run(const uint8_t* s, uint8_t* d, size_t c, size_t f) {
    UnshuffleFixed<W>(s, d, c, f);
  }
};
}  // namespace

void Shuffle(const uint8_t* src, uint8_t* dst, size_t n, size_t itemsize) {
  Transpose<Shuffle2, Shuffle4, ShuffleScalar>(src, dst, n, itemsize);
}

void Unshuffle(const uint8_t* src, uint8_t* dst, size_t n, size_t itemsize) {
  Transpose<Unshuffle2, Unshuffle4, UnshuffleScalar>(src, dst, n, itemsize);
}

void UnshuffleRange(const uint8_t* src, size_t n, size_t itemsize, size_t begin, size_t end,
                    uint8_t* dst) {
  if (itemsize != 2 && itemsize != 4 && itemsize != 8) {  // Unshuffle copies these as they are
    if (end > begin) std::memcpy(dst, src + begin, end - begin);
    return;
  }
  const size_t count = n / itemsize, whole = count * itemsize;
  auto scalar = [&](size_t from, size_t to) {
    for (size_t r = from; r < to; ++r) dst[r - begin] = src[(r % itemsize) * count + r / itemsize];
  };
  const size_t stop = std::clamp(whole, begin, end);  // bytes past it: the partial element
  // Whole elements go through the SIMD transposes (planes `count` bytes apart): a division per
  // byte, as in the scalar form, made shuffle+zstd loads 5-9x slower than their zstd decode.
  size_t first = std::min(stop, (begin + itemsize - 1) / itemsize * itemsize);
  size_t last = std::max(first, stop / itemsize * itemsize);
  scalar(begin, first);
  const size_t e0 = first / itemsize, elems = (last - first) / itemsize;
  uint8_t* out = dst + (first - begin);
  switch (itemsize) {
    case 2:
      UnshuffleStrided<2>(src + e0, count, out, elems,
                          Unshuffle2Strided(src + e0, count, out, elems));
      break;
    case 4:
      UnshuffleStrided<4>(src + e0, count, out, elems,
                          Unshuffle4Strided(src + e0, count, out, elems));
      break;
    default:
      UnshuffleStrided<8>(src + e0, count, out, elems, 0);
      break;
  }
  scalar(last, stop);
  // The trailing partial element is stored as is, after the planes.
  if (stop < end) std::memcpy(dst + (stop - begin), src + stop, end - stop);
}

uint64_t UnshuffledChecksum64(const uint8_t* src, size_t n, size_t itemsize) {
  if (itemsize <= 1) return Checksum64(src, n);
  StreamingChecksum sum;
  uint8_t piece[16384];
  for (size_t r = 0; r < n; r += sizeof(piece)) {
    size_t len = std::min(sizeof(piece), n - r);
    UnshuffleRange(src, n, itemsize, r, r + len, piece);
    sum.Update(piece, len);
  }
  return sum.Digest();
}

namespace {
struct ScratchBudget {
  std::mutex mu;
  std::condition_variable cv;
  uint64_t used = 0;
};
ScratchBudget& Budget() {
  static ScratchBudget* budget = new ScratchBudget();  // never destroyed: threads outlive main
  return *budget;
}
}  // namespace

Result<uint8_t*> DecodeScratch::Get(uint64_t n) {
  if (n <= capacity_) return data_.get();
  Release();
  data_.reset();
  capacity_ = 0;
  if (n > kRetainedScratchBytes) {
    ScratchBudget& b = Budget();
    std::unique_lock<std::mutex> lock(b.mu);
    // Alone, any block may go (n <= kMaxBlockSize); otherwise wait for room.
    b.cv.wait(lock, [&] { return b.used == 0 || b.used + n <= kDecodeScratchBudget; });
    b.used += n;
    leased_ = n;
  }
  data_.reset(new (std::nothrow) uint8_t[n]);
  if (!data_) {
    Release();
    return Error(StatusCode::kResourceExhausted, "cannot allocate ", n, " bytes of decode scratch");
  }
  capacity_ = n;
  return data_.get();
}

void DecodeScratch::Release() {
  if (leased_ == 0) return;
  data_.reset();
  capacity_ = 0;
  ScratchBudget& b = Budget();
  {
    std::lock_guard<std::mutex> lock(b.mu);
    b.used -= leased_;
  }
  leased_ = 0;
  b.cv.notify_all();
}

void StreamingCopy(void* dst, const void* src, size_t n) {
#if defined(__x86_64__)
  auto* d = static_cast<uint8_t*>(dst);
  auto* s = static_cast<const uint8_t*>(src);
  if (n < 4096) {
    std::memcpy(d, s, n);
    return;
  }
  size_t head = (16 - (reinterpret_cast<uintptr_t>(d) & 15)) & 15;
  std::memcpy(d, s, head);
  d += head;
  s += head;
  n -= head;
  size_t blocks = n / 64;
  for (size_t i = 0; i < blocks; ++i) {
    __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s));
    __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 16));
    __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 32));
    __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(d), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + 48), e);
    s += 64;
    d += 64;
  }
  // Streaming stores are weakly ordered: fence before the DMA is enqueued by this thread.
  _mm_sfence();
  std::memcpy(d, s, n - blocks * 64);
#else
  std::memcpy(dst, src, n);
#endif
}

size_t ShuffleWidth(DType dtype) {
  int bits = DTypeStorageBits(dtype);
  if (dtype == DType::kC64) return 4;   // two F32 parts
  if (dtype == DType::kC128) return 8;  // two F64 parts
  if (bits == 16 || bits == 32 || bits == 64) return static_cast<size_t>(bits / 8);
  return 1;
}

size_t CompressBound(size_t raw) { return ZSTD_compressBound(raw); }

Result<size_t> ZstdCompress(const void* src, size_t n, void* dst, size_t capacity, int level) {
  size_t r = ZSTD_compress(dst, capacity, src, n, level);
  if (ZSTD_isError(r)) {
    return Error(StatusCode::kInternal, "zstd compression failed: ", ZSTD_getErrorName(r));
  }
  return r;
}

Status ZstdDecompressExact(const void* src, size_t n, void* dst, size_t raw_size) {
  // ZSTD_decompress never writes past `raw_size`; a frame that needs more fails with
  // dstSize_tooSmall, which is exactly the "never trust the frame's claim" rule.
  thread_local std::unique_ptr<ZSTD_DCtx, size_t (*)(ZSTD_DCtx*)> ctx(ZSTD_createDCtx(),
                                                                      ZSTD_freeDCtx);
  ZSTD_DCtx* dctx = ctx.get();
  if (dctx == nullptr) return Error(StatusCode::kResourceExhausted, "zstd context allocation");
  size_t r = ZSTD_decompressDCtx(dctx, dst, raw_size, src, n);
  if (ZSTD_isError(r)) {
    return Error(StatusCode::kDataLoss, "corrupt zstd frame (", ZSTD_getErrorName(r), ")");
  }
  if (r != raw_size) {
    return Error(StatusCode::kDataLoss, "zstd frame decoded to ", r, " bytes, expected ", raw_size);
  }
  return Status::Ok();
}

}  // namespace ferry
