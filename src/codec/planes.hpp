// The PLANES block codec: byte planes, low-entropy planes canonical-Huffman coded in units that
// a GPU warp decodes independently (docs/PLANES.md is the normative description).
//
// A block of `raw_size` bytes of W-byte elements (W = 1, 2, 4 or 8) is split into W planes
// (byte k of every element). Each plane is stored raw or Huffman coded; trailing bytes of a
// partial element are stored raw. The stored bytes describe themselves: a fixed header, a
// plane directory, per coded plane a code-length table and a unit offset table.
#ifndef FERRY_SRC_CODEC_PLANES_HPP_
#define FERRY_SRC_CODEC_PLANES_HPP_

#include <cstddef>
#include <cstdint>

#include "ferry/status.hpp"

namespace ferry::planes {

inline constexpr uint8_t kVersion = 1;
inline constexpr size_t kHeaderSize = 96;
inline constexpr size_t kMaxWidth = 8;
inline constexpr uint32_t kStreamsPerUnit = 32;
inline constexpr uint32_t kMaxSymbolsPerStream = 256;
// Symbols per stream the encoder writes: 256 keeps the per-unit overhead (32 length bytes and
// the stream padding) near 3% of a coded plane while one warp still decodes a unit fast.
inline constexpr uint32_t kSymbolsPerStream = 256;
inline constexpr int kMaxCodeLength = 11;
// Byte offsets inside a coded plane section.
inline constexpr size_t kCodedLengthsOffset = 8;
inline constexpr size_t kCodedUnitTableOffset = 8 + 128;

enum PlaneMode : uint8_t { kPlaneRaw = 0, kPlaneHuffman = 1 };

// What a block's header says, after every bound was checked against the stored size.
struct Layout {
  uint32_t raw_size = 0;
  uint32_t width = 0;
  uint32_t count = 0;  // whole elements: raw_size / width
  uint32_t symbols_per_stream = 0;
  uint32_t tail_offset = 0;  // raw_size - count * width trailing bytes, stored raw
  uint32_t tail_size = 0;
  uint32_t coded_planes = 0;
  uint32_t nunits = 0;  // ceil(count / (32 * symbols_per_stream))
  struct Plane {
    uint8_t mode = kPlaneRaw;
    uint8_t max_len = 0;
    uint32_t offset = 0;  // of the section, from the block start
    uint32_t size = 0;
  } plane[kMaxWidth];
};

// Largest stored block for `raw` bytes (a plane is never stored larger than raw).
size_t Bound(size_t raw);

// `width` is the element width the planes split (ShuffleWidth of the dtype: 1, 2, 4 or 8).
// Encodes one block. `scratch` holds at least n bytes. Returns the stored size, or 0 when the
// coding does not save at least `min_savings` of n (the caller then stores the block raw);
// a negative `min_savings` always encodes.
// `out` holds Bound(n) bytes.
size_t Encode(const uint8_t* raw, size_t n, size_t width, uint8_t* out, uint8_t* scratch,
              double min_savings);

// Parses and bounds-checks the header, the plane directory, every code-length table and every
// unit offset table. The unit contents (stream lengths, codes, padding) are checked by the
// decoders as they run. Messages are relative ("unit 3 of plane 1: ..."); callers prefix the
// tensor and block.
Status Parse(const uint8_t* src, size_t n, size_t raw_size, Layout* out);

// Decodes a parsed block into dst (raw_size bytes). `scratch` holds raw_size bytes.
Status DecodeParsed(const uint8_t* src, const Layout& layout, uint8_t* dst, uint8_t* scratch);

// Parse + DecodeParsed.
Status Decode(const uint8_t* src, size_t n, uint8_t* dst, size_t raw_size, uint8_t* scratch);

// Canonical code lengths (0: absent) from symbol frequencies, no code longer than max_len.
// Exposed for tests.
void BuildLengths(const uint64_t freq[256], int max_len, uint8_t lengths[256]);

}  // namespace ferry::planes

#endif  // FERRY_SRC_CODEC_PLANES_HPP_
