// Checksums, byte shuffle and zstd chunks: the pure, allocation-light transforms of the format.
#ifndef FERRY_SRC_CODEC_HPP_
#define FERRY_SRC_CODEC_HPP_

#include <cstddef>
#include <cstdint>
#include <memory>

#include "ferry/ferry.hpp"

namespace ferry {

// XXH3-64 with seed 0 (Checkpoint.checksum_algo == XXH3_64).
uint64_t Checksum64(const void* data, size_t size);

// Incremental XXH3-64, for sources that arrive in pieces.
class StreamingChecksum {
 public:
  StreamingChecksum();
  ~StreamingChecksum();
  void Update(const void* data, size_t size);
  uint64_t Digest() const;

 private:
  void* state_;
};

// Splits `n` bytes of `itemsize`-byte elements into itemsize planes (byte k of every element,
// plane after plane). A trailing partial element (n % itemsize bytes) is copied as is.
void Shuffle(const uint8_t* src, uint8_t* dst, size_t n, size_t itemsize);
void Unshuffle(const uint8_t* src, uint8_t* dst, size_t n, size_t itemsize);

// memcpy with non-temporal stores where the destination allows it: the bytes go to memory
// without first reading the destination lines into cache, which matters for pinned staging
// buffers that only the DMA engine reads next.
void StreamingCopy(void* dst, const void* src, size_t n);

// The element width the byte shuffle uses for `dtype` (1 means shuffling is a no-op).
size_t ShuffleWidth(DType dtype);

// Upper bound of one compressed chunk of `raw` bytes.
size_t CompressBound(size_t raw);
// Compresses src into dst (capacity CompressBound(n)); returns the compressed size.
Result<size_t> ZstdCompress(const void* src, size_t n, void* dst, size_t capacity, int level);
// Decompresses exactly `raw_size` bytes. A frame that would produce more or fewer bytes is
// DataLoss, whatever size the frame itself claims.
Status ZstdDecompressExact(const void* src, size_t n, void* dst, size_t raw_size);

}  // namespace ferry

#endif  // FERRY_SRC_CODEC_HPP_
