// A read-only view of a zip archive held in memory (a file mapping or a byte string), for the
// archives torch.save writes. Only what those need: stored (uncompressed) entries, read in
// place. Every offset and length is checked against the span before it is used.
//
// Why not libzip or minizip: the point of reading torch checkpoints here is zero-copy access
// to each stored entry's bytes inside the mapping. libzip has no call that returns an entry's
// data offset; minizip's unzGetCurrentFileZStreamPos64 does, but only through its file
// callback layer, and the same parser must also run over archives nested inside other
// buffers (DCP data files, TransformerEngine's io.BytesIO extra state) and under the fuzzer.
// The format subset is small: end of central directory (and its zip64 form), central
// directory entries, local headers.
#ifndef FERRY_SRC_IMPORT_TORCH_ZIP_HPP_
#define FERRY_SRC_IMPORT_TORCH_ZIP_HPP_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "ferry/ferry.hpp"
#include "io/io.hpp"

namespace ferry::torch_import {

struct ZipEntry {
  std::string name;
  uint16_t method = 0;       // 0: stored; anything else is refused when the entry is read
  uint64_t data_offset = 0;  // of the entry's bytes, relative to the archive start
  uint64_t size = 0;         // stored bytes (== uncompressed bytes for method 0)
};

// Limits: an archive with more entries, or a name longer than this, is refused.
inline constexpr uint64_t kMaxZipEntries = uint64_t{1} << 20;

class ZipArchive {
 public:
  // Parses the central directory of the archive at [data, data + size). `path` names the
  // file (and where in it the archive lies) in messages. Entries must lie inside the span,
  // before the central directory, must not overlap one another, and each local header must
  // agree with its central directory entry. The bytes must outlive the archive. Headers are
  // read from copies taken under `guard` (the mapping holding the bytes, or null for memory).
  static Result<ZipArchive> Open(const uint8_t* data, uint64_t size, std::string path,
                                 const Mapping* guard = nullptr);

  const std::vector<ZipEntry>& entries() const { return entries_; }
  // nullptr when absent.
  const ZipEntry* Find(std::string_view name) const;
  // The bytes of a stored entry; DataLoss naming the entry for a compressed one.
  Result<const uint8_t*> Data(const ZipEntry& entry) const;
  const uint8_t* base() const { return data_; }
  uint64_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  const uint8_t* data_ = nullptr;
  uint64_t size_ = 0;
  std::string path_;
  std::vector<ZipEntry> entries_;  // sorted by name
};

// True when the span starts with a local file header ("PK\3\4") or is an empty archive.
bool LooksLikeZip(const uint8_t* data, uint64_t size);

}  // namespace ferry::torch_import

#endif  // FERRY_SRC_IMPORT_TORCH_ZIP_HPP_
