// The footer of a TensorFerry file: locating it from the trailer, checking its checksum, and
// parsing and validating the index it holds. Used by Reader::Open and the fuzzers.
#ifndef FERRY_SRC_FORMAT_FOOTER_HPP_
#define FERRY_SRC_FORMAT_FOOTER_HPP_

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

#include "ferry/ferry.hpp"
#include "ferry_generated.h"

namespace ferry {

// A little-endian u64 at any alignment (the format is little-endian, as is every platform
// this builds for).
inline uint64_t LoadU64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

inline std::string_view Sv(const flatbuffers::String* s) {
  return s == nullptr ? std::string_view() : std::string_view(s->data(), s->size());
}

// Binary search over a name-sorted vector of tables with a string key.
template <typename T, typename KeyFn>
int64_t FindSorted(const flatbuffers::Vector<flatbuffers::Offset<T>>* v, std::string_view key,
                   KeyFn key_of) {
  if (v == nullptr) return -1;
  size_t lo = 0, hi = v->size();
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    std::string_view k = Sv(key_of(v->Get(static_cast<flatbuffers::uoffset_t>(mid))));
    if (k < key) {
      lo = mid + 1;
    } else if (key < k) {
      hi = mid;
    } else {
      return static_cast<int64_t>(mid);
    }
  }
  return -1;
}

// What ParseFooter demands beyond the schema. Our own files keep the defaults; an index
// synthesized from a safetensors header (src/format/safetensors.hpp) describes tensors that have no
// checksums and lie back to back at any byte offset.
struct FooterRules {
  bool checksums = true;    // false: every tensor must have none
  uint64_t alignment = 64;  // of every non-empty tensor's data offset
};

// Parses and validates a footer held in memory. `data_end` is the file offset where the
// footer starts (every tensor extent must end at or before it). This is the entry point
// fuzzers drive; it performs no I/O and trusts nothing in `footer`.
Result<const fb::Checkpoint*> ParseFooter(const uint8_t* footer, uint64_t size, uint64_t data_end,
                                          const std::string& path, const FooterRules& rules = {});

// Where the footer is (from the trailer) and the checksum it must have.
struct FooterLocation {
  uint64_t offset = 0;
  uint64_t size = 0;
  uint64_t checksum = 0;  // XXH3-64 the trailer records for the footer
};
// Trailer only: magic at both ends, a footer length that fits the file.
Result<FooterLocation> ReadTrailer(const uint8_t* file, uint64_t file_size,
                                   const std::string& path);
// As ReadTrailer, from the file's first `head_size` bytes (`head`: at least kMagicSize unless
// the file is shorter; more lets a file of another kind be recognised in the message) and its
// last kTrailerSize bytes (`trailer`, not read when the file is too short for it).
Result<FooterLocation> ParseTrailer(const uint8_t* head, uint64_t head_size, const uint8_t* trailer,
                                    uint64_t file_size, const std::string& path);
// DataLoss unless `footer` (loc.size bytes) hashes to the trailer's checksum.
Status CheckFooterSum(const uint8_t* footer, const FooterLocation& loc, const std::string& path);
// ReadTrailer, then CheckFooterSum in place.
Result<FooterLocation> LocateFooter(const uint8_t* file, uint64_t file_size,
                                    const std::string& path);

}  // namespace ferry

#endif  // FERRY_SRC_FORMAT_FOOTER_HPP_
