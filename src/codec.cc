#include "codec.hpp"

#include <zstd.h>

#include <cstring>

#if defined(__x86_64__)
#include <emmintrin.h>
#endif

#define XXH_INLINE_ALL
#include <xxhash.h>

#include "util.hpp"

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
void ShuffleFixed(const uint8_t* src, uint8_t* dst, size_t count) {
  for (size_t i = 0; i < count; ++i) {
    for (size_t k = 0; k < W; ++k) dst[k * count + i] = src[i * W + k];
  }
}
template <size_t W>
void UnshuffleFixed(const uint8_t* src, uint8_t* dst, size_t count) {
  for (size_t i = 0; i < count; ++i) {
    for (size_t k = 0; k < W; ++k) dst[i * W + k] = src[k * count + i];
  }
}
}  // namespace

void Shuffle(const uint8_t* src, uint8_t* dst, size_t n, size_t itemsize) {
  size_t count = itemsize ? n / itemsize : 0;
  switch (itemsize) {
    case 2:
      ShuffleFixed<2>(src, dst, count);
      break;
    case 4:
      ShuffleFixed<4>(src, dst, count);
      break;
    case 8:
      ShuffleFixed<8>(src, dst, count);
      break;
    default:
      count = 0;
      break;
  }
  size_t done = count * itemsize;
  std::memcpy(dst + done, src + done, n - done);
}

void Unshuffle(const uint8_t* src, uint8_t* dst, size_t n, size_t itemsize) {
  size_t count = itemsize ? n / itemsize : 0;
  switch (itemsize) {
    case 2:
      UnshuffleFixed<2>(src, dst, count);
      break;
    case 4:
      UnshuffleFixed<4>(src, dst, count);
      break;
    case 8:
      UnshuffleFixed<8>(src, dst, count);
      break;
    default:
      count = 0;
      break;
  }
  size_t done = count * itemsize;
  std::memcpy(dst + done, src + done, n - done);
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
    return Error(StatusCode::kDataLoss, "zstd frame decoded to ", r, " bytes, expected ",
                 raw_size);
  }
  return Status::Ok();
}

}  // namespace ferry
