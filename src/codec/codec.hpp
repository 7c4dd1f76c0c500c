// Checksums, byte shuffle and zstd chunks: the pure, allocation-light transforms of the format.
#ifndef FERRY_SRC_CODEC_CODEC_HPP_
#define FERRY_SRC_CODEC_CODEC_HPP_

#include <cstddef>
#include <cstdint>
#include <memory>

#include "ferry/ferry.hpp"

namespace ferry {

// XXH3-64 with seed 0 (Checkpoint.checksum_algo == XXH3_64).
uint64_t Checksum64(const void* data, size_t size);

// Bytes copied, then hashed, per step where a copy is checked as it goes: the hash reads
// what the copy just wrote while it is still in L2 (a 4 MiB block hashed after its copy is
// read back from L3 or memory).
inline constexpr size_t kChecksumStep = size_t{256} << 10;

// Incremental XXH3-64, for sources that arrive in pieces.
class StreamingChecksum {
 public:
  StreamingChecksum();
  StreamingChecksum(const StreamingChecksum&) = delete;
  StreamingChecksum& operator=(const StreamingChecksum&) = delete;
  void Reset();  // back to the empty input
  void Update(const void* data, size_t size);
  uint64_t Digest() const;

  // Room for XXH3_state_t (checked where it is defined): held in place, so a hash costs no
  // allocation.
  static constexpr size_t kStateBytes = 640;
  static constexpr size_t kStateAlign = 64;

 private:
  alignas(kStateAlign) unsigned char state_[kStateBytes];
};

// Splits `n` bytes of `itemsize`-byte elements into itemsize planes (byte k of every element,
// plane after plane). A trailing partial element (n % itemsize bytes) is copied as is.
void Shuffle(const uint8_t* src, uint8_t* dst, size_t n, size_t itemsize);
void Unshuffle(const uint8_t* src, uint8_t* dst, size_t n, size_t itemsize);

// Bytes [begin, end) of what Unshuffle(src, ..., n, itemsize) would write, into dst[0, end -
// begin): a few rows of a huge shuffled block without a second block-sized buffer.
void UnshuffleRange(const uint8_t* src, size_t n, size_t itemsize, size_t begin, size_t end,
                    uint8_t* dst);
// Checksum64 of the unshuffled form of `n` shuffled bytes, unshuffling a small piece at a time.
uint64_t UnshuffledChecksum64(const uint8_t* src, size_t n, size_t itemsize);

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

// Scratch memory for decoding one block at a time: uninitialised (every byte is written by the
// decoder before it is read, so zero-filling would only cost a pass over memory), grown on
// demand. Buffers above kRetainedScratchBytes are leased from a process-wide budget of
// kDecodeScratchBudget bytes for the duration of one block: a thread that needs a lease
// waits while others hold it, so huge blocks decode one or a few at a time instead of one per
// thread, and Release() (after each block) hands both lease and memory back. Buffers up to
// kRetainedScratchBytes are kept between calls, as repeated small decodes would otherwise
// fault in fresh pages each time. Not thread-safe: one per thread.
inline constexpr uint64_t kRetainedScratchBytes = uint64_t{8} << 20;
inline constexpr uint64_t kDecodeScratchBudget = uint64_t{1} << 30;

class DecodeScratch {
 public:
  DecodeScratch() = default;
  ~DecodeScratch() { Release(); }
  DecodeScratch(const DecodeScratch&) = delete;
  DecodeScratch& operator=(const DecodeScratch&) = delete;

  // `n` bytes, or ResourceExhausted when they cannot be allocated.
  Result<uint8_t*> Get(uint64_t n);
  // Frees a leased buffer (keeps a small one).
  void Release();

 private:
  std::unique_ptr<uint8_t[]> data_;
  uint64_t capacity_ = 0;
  uint64_t leased_ = 0;
};

}  // namespace ferry

#endif  // FERRY_SRC_CODEC_CODEC_HPP_
