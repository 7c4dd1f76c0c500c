// Reader internals shared by the host reader, the CUDA loader and the C API.
#ifndef FERRY_SRC_READER_IMPL_HPP_
#define FERRY_SRC_READER_IMPL_HPP_

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "ferry/ferry.hpp"
#include "ferry_generated.h"
#include "io.hpp"

namespace ferry {

// What ParseFooter demands beyond the schema. Our own files keep the defaults; an index
// synthesized from a safetensors header (src/safetensors.hpp) describes tensors that have no
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
// DataLoss unless `footer` (loc.size bytes) hashes to the trailer's checksum.
Status CheckFooterSum(const uint8_t* footer, const FooterLocation& loc, const std::string& path);
// ReadTrailer, then CheckFooterSum in place.
Result<FooterLocation> LocateFooter(const uint8_t* file, uint64_t file_size,
                                    const std::string& path);

class Reader::Impl {
 public:
  std::string path;
  std::shared_ptr<Mapping> mapping;
  const fb::Checkpoint* checkpoint = nullptr;
  // Our own files: `checkpoint` points into this copy of the footer (8-byte aligned), so a
  // file truncated after open cannot fault on index lookups.
  std::unique_ptr<uint64_t[]> footer_copy;
  // A .safetensors file: `checkpoint` points into `synthesized`, an index built from its JSON
  // header, and there are no checksums, so verification has nothing to check.
  bool safetensors = false;
  bool has_checksums = true;
  std::vector<uint64_t> synthesized;

  const uint8_t* base() const { return mapping->data(); }
  size_t size() const;
  const fb::Tensor* at(size_t i) const { return checkpoint->tensors()->Get(i); }
  // Index of `name`, or -1.
  int64_t IndexOf(std::string_view name) const;
  Result<size_t> Lookup(std::string_view name) const;
  TensorInfo Info(size_t i) const;
  uint64_t NumBlocks(size_t i) const;
  // Raw length of block b of tensor i.
  uint64_t BlockRawSize(size_t i, uint64_t b) const;

  // Decodes block b of tensor i into dst (BlockRawSize bytes), verifying its checksum when
  // asked. `scratch` must hold BlockRawSize bytes for SHUFFLE_ZSTD and PLANES tensors (else unused).
  Status DecodeBlock(size_t i, uint64_t b, uint8_t* dst, uint8_t* scratch, bool verify) const;
  // As DecodeBlock for an encoded tensor whose chunk b's stored bytes are at `src` (read by
  // the caller, e.g. with O_DIRECT, instead of through the mapping).
  Status DecodeStored(size_t i, uint64_t b, const uint8_t* src, uint8_t* dst, uint8_t* scratch,
                      bool verify) const;
  Status VerifyBlock(size_t i, uint64_t b, const uint8_t* raw) const;
  // Checks every block of raw tensor i that overlaps raw bytes [begin, begin + len). Blocks
  // lying wholly inside the range are checked in `copy` (those bytes, at copy[0] = byte
  // `begin`), so what is handed out is what was verified; blocks cut by the range, or all
  // of them when `copy` is null, are checked in the mapping.
  Status VerifyRawRange(size_t i, uint64_t begin, uint64_t len, const uint8_t* copy) const;
  // Copies raw bytes [begin, begin + len) of tensor i into dst, decoding as needed.
  // `streaming` copies raw bytes with non-temporal stores (for DMA staging buffers that the
  // CPU will not read again).
  Status ReadRange(size_t i, uint64_t begin, uint64_t len, uint8_t* dst, bool verify,
                   bool streaming = false) const;
  // Byte range of rows [row_begin, row_end) of dim 0.
  Result<std::pair<uint64_t, uint64_t>> RowRange(size_t i, int64_t row_begin,
                                                 int64_t row_end) const;

  // "<path>: tensor 'name'" for messages.
  std::string Where(size_t i) const;
  // DataLoss for a read of tensor i at `file_offset` that faulted (Mapping::Guard).
  Status Shrank(size_t i, uint64_t file_offset) const;
};

}  // namespace ferry

#endif  // FERRY_SRC_READER_IMPL_HPP_
