// The one seam between a checkpoint's stored bytes and everything that consumes them: the
// Reader's public methods, the loader, the distributed loader, sharded checkpoints and the
// `ferry` command locate, read, decode and verify a tensor's stored blocks only through here.
//
// A tensor is stored as blocks of `block_size` raw bytes (the last one shorter). A raw tensor's
// blocks lie back to back; an encoded tensor has one stored block per raw block (zstd, or kept
// as is where compression did not pay), listed in its block table. Every block has an XXH3-64
// checksum of its raw bytes, except in safetensors files, which store none.
//
// Thread safety: a BlockSource is immutable after construction; every method may be called
// from any number of threads at once. Reads that decode use per-thread scratch buffers.
#ifndef FERRY_SRC_FORMAT_BLOCK_SOURCE_HPP_
#define FERRY_SRC_FORMAT_BLOCK_SOURCE_HPP_

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>

#include "ferry/ferry.hpp"
#include "io/io.hpp"
#include "io/source.hpp"

namespace ferry {

namespace fb {
struct Checkpoint;
struct Tensor;
}  // namespace fb

// One tensor's index entry, read in place: `name` and `shape` point into the index and stay
// valid as long as the BlockSource. Building one allocates nothing.
struct TensorRecord {
  std::string_view name;
  std::span<const int64_t> shape;
  DType dtype = DType::kU8;
  Encoding encoding = Encoding::kRaw;
  uint64_t nbytes = 0;
  uint64_t data_offset = 0;  // absolute file offset of the stored bytes
  uint64_t data_size = 0;    // stored bytes
  uint64_t block_size = 0;   // raw bytes per block (0 for an empty tensor)
};

// A byte range of one stored tensor: the whole tensor, or rows of its dimension 0.
struct Extent {
  size_t tensor = 0;   // index in the source, in name order
  uint64_t begin = 0;  // raw bytes [begin, begin + len) of the tensor
  uint64_t len = 0;
  TensorInfo info;  // `shape` narrowed to the rows
  // File offset of the first stored byte of a raw range (the tensor's start if encoded).
  uint64_t file_offset() const { return info.data_offset + begin; }
};

// Where one stored block lies and what it holds.
struct StoredBlock {
  uint64_t file_offset = 0;  // absolute offset of its stored bytes
  uint64_t stored_size = 0;
  uint64_t raw_offset = 0;  // of its raw bytes within the tensor
  uint64_t raw_size = 0;
  bool compressed = false;  // a zstd frame; otherwise the raw bytes themselves
  bool planes = false;      // a PLANES block (docs/PLANES.md); `compressed` is then false
};

// How a read reaches the file and what it does with the bytes.
struct ReadPath {
  bool verify = false;  // check the checksum of every block read
  // Write raw bytes with non-temporal stores (DMA staging buffers the CPU does not read
  // again); such bytes are verified in the file instead of in `dst`.
  bool streaming = false;
  // Read stored bytes with O_DIRECT through this file instead of the mapping or the source
  // (null: the mapping where there is one, else ByteSource::ReadAt).
  const DirectFile* direct = nullptr;
};

class BlockSource {
 public:
  // The parsed index and the memory it points into (a copy of the footer, or an index
  // synthesized from a safetensors header).
  struct Index {
    const fb::Checkpoint* root = nullptr;
    std::shared_ptr<const void> memory;
    bool safetensors = false;  // no checksums; tensors at any byte offset
  };
  BlockSource(std::shared_ptr<const ByteSource> bytes, Index index);

  const std::string& path() const { return path_; }
  bool safetensors() const { return index_.safetensors; }
  bool has_checksums() const { return !index_.safetensors; }
  // Where the stored bytes come from.
  const ByteSource& bytes() const { return *bytes_; }
  // The whole file, mapped read-only, or null where the source is read without a mapping
  // (network file systems, remote storage, mapping turned off). Views and DMA from the page
  // cache need it; every read here works either way.
  const std::shared_ptr<const Mapping>& mapping() const { return mapping_; }

  // ---- tensors ----
  size_t size() const;
  TensorRecord Record(size_t i) const;
  // Index of `name`, or -1 (O(log n)).
  int64_t IndexOf(std::string_view name) const;
  // As IndexOf; NotFound names the file and the tensor.
  Result<size_t> Lookup(std::string_view name) const;
  TensorInfo Info(size_t i) const;
  std::string_view Name(size_t i) const;
  uint64_t RawSize(size_t i) const;
  // Absolute file offset of the tensor's stored bytes.
  uint64_t FileOffset(size_t i) const;
  // "<path>: tensor 'name'", for messages.
  std::string Where(size_t i) const;

  // Rows [row_begin, row_end) of tensor `name` (row_end < 0: through the last row); (0, -1)
  // is the whole tensor, scalars included.
  Result<Extent> Locate(std::string_view name, int64_t row_begin = 0, int64_t row_end = -1) const;
  Result<Extent> Locate(size_t i, int64_t row_begin = 0, int64_t row_end = -1) const;
  // Byte range {begin, len} of rows [row_begin, row_end) of dimension 0.
  Result<std::pair<uint64_t, uint64_t>> RowRange(size_t i, int64_t row_begin,
                                                 int64_t row_end) const;

  // ---- blocks ----
  uint64_t NumBlocks(size_t i) const;
  StoredBlock Block(size_t i, uint64_t b) const;

  // Copies raw bytes [begin, begin + len) of tensor i into dst, decoding stored blocks as
  // needed. Blocks cut by the range are decoded into per-thread scratch (docs/SECURITY.md,
  // "Memory for decoding").
  Status Read(size_t i, uint64_t begin, uint64_t len, uint8_t* dst, const ReadPath& how) const;
  // Copies file bytes [offset, offset + len) of raw tensor i into dst as they are stored
  // (from the source, never the mapping: one-shot loads avoid faulting in a mapping used once).
  Status ReadStoredRange(size_t i, uint64_t offset, uint64_t len, uint8_t* dst) const;
  // Many ReadStoredRange calls as one ByteSource::ReadRanges, so a remote source keeps them
  // in flight together (and joins neighbours into one request). `tensor` names the tensor
  // each range belongs to in messages.
  struct StoredRange {
    size_t tensor = 0;
    ReadRange range;
  };
  Status ReadStoredRanges(std::span<const StoredRange> ranges) const;
  // Copies block b's stored bytes (Block(i, b).stored_size of them) into dst, undecoded.
  Status ReadStored(size_t i, uint64_t b, uint8_t* dst) const;
  // Checks every block of raw tensor i that overlaps raw bytes [begin, begin + len). Blocks
  // lying wholly inside the range are checked in `copy` (those bytes, at copy[0] = byte
  // `begin`), so what is handed out is what was verified; blocks cut by the range, or all of
  // them when `copy` is null, are checked in the file.
  Status VerifyRange(size_t i, uint64_t begin, uint64_t len, const uint8_t* copy) const;
  // Checks stored block b of tensor i (decoding it if encoded).
  Status VerifyBlock(size_t i, uint64_t b) const;
  // Block b's recorded checksum (XXH3-64 of its raw bytes), for checks made elsewhere (on the
  // device); meaningful only where has_checksums().
  uint64_t BlockChecksum(size_t i, uint64_t b) const;
  // The DataLoss every checksum check reports for block b of tensor i, naming the file, the
  // tensor, the block, its raw byte range and its file offset.
  Status ChecksumMismatch(size_t i, uint64_t b) const;
  Status VerifyTensor(size_t i) const;

  // The index itself, for the format layer (and tests): the generated types are incomplete
  // everywhere else (tests/check_layers.py), so layers above read it through the accessors
  // above.
  const fb::Checkpoint* index() const { return index_.root; }
  const fb::Tensor* at(size_t i) const;

 private:
  uint64_t BlockRawSize(size_t i, uint64_t b) const;
  Status CheckSum(size_t i, uint64_t b, const uint8_t* raw) const;
  // DataLoss unless `sum` is block b's recorded checksum.
  Status CompareSum(size_t i, uint64_t b, uint64_t sum) const;
  // Checks raw block b where it is stored (mapped, or read into scratch).
  Status CheckStoredSum(size_t i, uint64_t b) const;
  // Decodes encoded block b, whose stored bytes are at `src` (null: read from the source
  // first), and copies its raw bytes [lo, hi) (block-relative) to dst, verifying the whole
  // block when asked. Needs at most one block of scratch (DecodeScratch; none for a whole
  // unshuffled block in memory), plus room for the stored bytes when it reads them itself,
  // whatever the range; lo == hi with verify checks the block alone.
  Status DecodeRange(size_t i, uint64_t b, const uint8_t* src, uint64_t lo, uint64_t hi,
                     uint8_t* dst, bool verify) const;
  Status ReadRaw(size_t i, uint64_t begin, uint64_t len, uint8_t* dst, const ReadPath& how) const;
  // Runs fn(), which may read the mapping, guarded against the file shrinking under it
  // (Mapping::Guard); without a mapping there is nothing to fault, and fn() just runs.
  template <typename Fn>
  [[nodiscard]] bool Guarded(Fn&& fn) const {
    if (mapping_ == nullptr) {
      fn();
      return true;
    }
    return mapping_->Guard(fn);
  }
  // DataLoss for a read of tensor i at `file_offset` that faulted (Mapping::Guard).
  Status Shrank(size_t i, uint64_t file_offset) const;
  // A failed read of the source, renamed to tensor i ("<path>: tensor 'x': ...").
  Status ReadFailed(size_t i, const Status& st) const;

  std::shared_ptr<const ByteSource> bytes_;
  std::string path_;
  std::shared_ptr<const Mapping> mapping_;
  Index index_;
};

// The source options a Reader's StorageOptions ask for.
SourceOptions ToSourceOptions(const StorageOptions& storage);

// Opens a Reader over `bytes` (Reader::Open is this over OpenSource(path)).
Result<std::shared_ptr<Reader>> OpenReader(std::shared_ptr<const ByteSource> bytes,
                                           ReaderOptions options = {});

// The stored data behind a Reader (defined in reader.cc, a friend of Reader).
const BlockSource& BlocksOf(const Reader& reader);

}  // namespace ferry

#endif  // FERRY_SRC_FORMAT_BLOCK_SOURCE_HPP_
