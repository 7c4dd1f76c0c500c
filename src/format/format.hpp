// File-layout constants and limits of format v1 (see schema/ferry.fbs and docs/SECURITY.md).
#ifndef FERRY_SRC_FORMAT_FORMAT_HPP_
#define FERRY_SRC_FORMAT_FORMAT_HPP_

#include <cstddef>
#include <cstdint>

namespace ferry::format {

inline constexpr char kMagic[8] = {'T', 'F', 'E', 'R', 'R', 'Y', '0', '1'};
inline constexpr size_t kMagicSize = 8;
// footer length (u64) + footer XXH3-64 (u64) + magic.
inline constexpr size_t kTrailerSize = 24;
inline constexpr uint64_t kLargeAlign = 4096;
inline constexpr uint64_t kSmallAlign = 64;
inline constexpr uint64_t kFirstDataOffset = 4096;

// Limits a reader enforces before trusting anything (docs/SECURITY.md).
inline constexpr uint64_t kMaxFooterBytes = uint64_t{1} << 30;
inline constexpr uint64_t kMaxTensors = uint64_t{1} << 24;
inline constexpr uint64_t kMaxDims = 64;
inline constexpr uint64_t kMaxNameBytes = 65536;
inline constexpr uint64_t kMaxBlockSize = uint64_t{1} << 30;
inline constexpr uint64_t kMinBlockSize = 4096;
inline constexpr uint32_t kMaxVerifierDepth = 8;

// Where a tensor of `nbytes` raw bytes starts, given the current end of the data section.
inline uint64_t TensorAlignment(uint64_t stored_bytes) {
  return stored_bytes >= kLargeAlign ? kLargeAlign : kSmallAlign;
}

}  // namespace ferry::format

#endif  // FERRY_SRC_FORMAT_FORMAT_HPP_
