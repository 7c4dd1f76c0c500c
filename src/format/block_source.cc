// Locating, reading, decoding and verifying stored blocks (src/format/block_source.hpp).
#include "format/block_source.hpp"

#include <sys/stat.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "base/util.hpp"
#include "codec/codec.hpp"
#include "codec/planes.hpp"
#include "format/footer.hpp"

namespace ferry {

BlockSource::BlockSource(std::shared_ptr<const ByteSource> bytes, Index index)
    : bytes_(std::move(bytes)),
      path_(bytes_->name()),
      mapping_(bytes_->mapping()),
      index_(std::move(index)) {}

size_t BlockSource::size() const {
  return index_.root->tensors() == nullptr ? 0 : index_.root->tensors()->size();
}

const fb::Tensor* BlockSource::at(size_t i) const {
  return index_.root->tensors()->Get(static_cast<flatbuffers::uoffset_t>(i));
}

int64_t BlockSource::IndexOf(std::string_view name) const {
  return FindSorted(index_.root->tensors(), name, [](const fb::Tensor* t) { return t->name(); });
}

Result<size_t> BlockSource::Lookup(std::string_view name) const {
  int64_t i = IndexOf(name);
  if (i < 0) return Error(StatusCode::kNotFound, path_, ": no tensor named ", Quote(name));
  return static_cast<size_t>(i);
}

TensorRecord BlockSource::Record(size_t i) const {
  const fb::Tensor* t = at(i);
  TensorRecord r;
  r.name = Sv(t->name());
  // Validated at open: 8-byte aligned, little-endian like every platform this builds for.
  if (const auto* shape = t->shape()) r.shape = {shape->data(), shape->size()};
  r.dtype = static_cast<DType>(t->dtype());
  r.encoding = static_cast<Encoding>(t->encoding());
  r.nbytes = t->nbytes();
  r.data_offset = t->data_offset();
  r.data_size = t->data_size();
  r.block_size = t->block_size();
  return r;
}

std::string_view BlockSource::Name(size_t i) const { return Sv(at(i)->name()); }
uint64_t BlockSource::RawSize(size_t i) const { return at(i)->nbytes(); }
uint64_t BlockSource::FileOffset(size_t i) const { return at(i)->data_offset(); }

std::string BlockSource::Where(size_t i) const {
  return StrCat(path_, ": tensor ", Quote(Name(i)));
}

TensorInfo BlockSource::Info(size_t i) const {
  const fb::Tensor* t = at(i);
  TensorInfo info;
  info.name = std::string(Sv(t->name()));
  info.dtype = static_cast<DType>(t->dtype());
  if (t->shape()) info.shape.assign(t->shape()->begin(), t->shape()->end());
  info.nbytes = t->nbytes();
  info.data_offset = t->data_offset();
  info.data_size = t->data_size();
  info.encoding = static_cast<Encoding>(t->encoding());
  info.block_size = t->block_size();
  info.index = i;
  if (t->global_shape()) {
    info.global_shape.assign(t->global_shape()->begin(), t->global_shape()->end());
    info.shard_offset.assign(t->shard_offset()->begin(), t->shard_offset()->end());
  }
  return info;
}

Result<Extent> BlockSource::Locate(std::string_view name, int64_t row_begin,
                                   int64_t row_end) const {
  FERRY_ASSIGN_OR_RETURN(size_t i, Lookup(name));
  return Locate(i, row_begin, row_end);
}

Result<Extent> BlockSource::Locate(size_t i, int64_t row_begin, int64_t row_end) const {
  Extent e;
  e.tensor = i;
  e.info = Info(i);
  e.len = e.info.nbytes;
  if (row_begin == 0 && row_end < 0) return e;
  const int64_t rows = e.info.shape.empty() ? 0 : e.info.shape[0];
  if (row_end < 0) row_end = rows;
  FERRY_ASSIGN_OR_RETURN(auto range, RowRange(i, row_begin, row_end));
  e.begin = range.first;
  e.len = range.second;
  e.info.shape[0] = row_end - row_begin;
  return e;
}

Result<std::pair<uint64_t, uint64_t>> BlockSource::RowRange(size_t i, int64_t row_begin,
                                                            int64_t row_end) const {
  const fb::Tensor* t = at(i);
  if (t->shape() == nullptr || t->shape()->size() == 0) {
    return Error(StatusCode::kInvalidArgument, Where(i), ": a scalar has no rows");
  }
  int64_t rows = t->shape()->Get(0);
  if (row_begin < 0 || row_end < row_begin || row_end > rows) {
    return Error(StatusCode::kInvalidArgument, Where(i), ": rows [", row_begin, ", ", row_end,
                 ") outside [0, ", rows, ")");
  }
  if (rows == 0) return std::make_pair(uint64_t{0}, uint64_t{0});
  uint64_t row_elems = 1;
  for (flatbuffers::uoffset_t d = 1; d < t->shape()->size(); ++d) {
    row_elems *= static_cast<uint64_t>(t->shape()->Get(d));  // bounded: validated at open
  }
  auto dtype = static_cast<DType>(t->dtype());
  if (DTypeStorageBits(dtype) == 4 && row_elems % 2 != 0) {
    return Error(StatusCode::kInvalidArgument, Where(i),
                 ": rows of an odd number of packed FP4 elements do not start on a byte");
  }
  uint64_t row_bytes = *StorageBytes(dtype, row_elems);
  return std::make_pair(static_cast<uint64_t>(row_begin) * row_bytes,
                        static_cast<uint64_t>(row_end - row_begin) * row_bytes);
}

uint64_t BlockSource::NumBlocks(size_t i) const {
  const fb::Tensor* t = at(i);
  return t->nbytes() == 0 ? 0 : (t->nbytes() - 1) / t->block_size() + 1;
}

uint64_t BlockSource::BlockRawSize(size_t i, uint64_t b) const {
  const fb::Tensor* t = at(i);
  return std::min(t->block_size(), t->nbytes() - b * t->block_size());
}

StoredBlock BlockSource::Block(size_t i, uint64_t b) const {
  const fb::Tensor* t = at(i);
  StoredBlock s;
  s.raw_offset = b * t->block_size();
  s.raw_size = BlockRawSize(i, b);
  if (t->encoding() == fb::Encoding::RAW) {
    s.file_offset = t->data_offset() + s.raw_offset;
    s.stored_size = s.raw_size;
    return s;
  }
  const fb::Chunk* ch = t->chunks()->Get(static_cast<flatbuffers::uoffset_t>(b));
  s.file_offset = t->data_offset() + ch->offset();
  s.stored_size = ch->stored_size();
  s.compressed = ch->codec() == fb::ChunkCodec::ZSTD;
  s.planes = ch->codec() == fb::ChunkCodec::PLANES;
  return s;
}

Status BlockSource::Shrank(size_t i, uint64_t file_offset) const {
  struct stat st;
  std::string now = ::fstat(mapping_->fd(), &st) == 0 ? StrCat(st.st_size, " bytes") : "unknown";
  return Error(StatusCode::kDataLoss, Where(i), ": the file shrank after it was opened (",
               mapping_->size(), " bytes then, ", now,
               " now: truncated or rewritten in place?); the read at file offset ", file_offset,
               " faulted");
}

Status BlockSource::ReadFailed(size_t i, const Status& st) const {
  // The source's messages start with its name; the tensor goes after it.
  std::string_view rest = st.message();
  if (rest.starts_with(path_) && rest.substr(path_.size()).starts_with(": ")) {
    rest.remove_prefix(path_.size() + 2);
  }
  return Error(st.code(), Where(i), ": ", rest);
}

Status BlockSource::ReadStoredRange(size_t i, uint64_t offset, uint64_t len, uint8_t* dst) const {
  Status st = bytes_->ReadAt(offset, len, dst);
  return st.ok() ? st : ReadFailed(i, st);
}

Status BlockSource::ReadStoredRanges(std::span<const StoredRange> ranges) const {
  if (ranges.empty()) return Status::Ok();
  std::vector<ReadRange> reads;
  reads.reserve(ranges.size());
  bool one_tensor = true;
  for (const StoredRange& r : ranges) {
    reads.push_back(r.range);
    one_tensor = one_tensor && r.tensor == ranges.front().tensor;
  }
  Status st = bytes_->ReadRanges(reads);
  // Several tensors: the source's message names the offset that failed.
  return st.ok() || !one_tensor ? st : ReadFailed(ranges.front().tensor, st);
}

Status BlockSource::ReadStored(size_t i, uint64_t b, uint8_t* dst) const {
  const StoredBlock s = Block(i, b);
  if (mapping_ == nullptr) return ReadStoredRange(i, s.file_offset, s.stored_size, dst);
  const uint8_t* from = mapping_->data() + s.file_offset;
  if (!mapping_->Guard([&] { std::memcpy(dst, from, s.stored_size); })) {
    return Shrank(i, s.file_offset);
  }
  return Status::Ok();
}

Status BlockSource::CheckSum(size_t i, uint64_t b, const uint8_t* raw) const {
  if (!has_checksums()) return Status::Ok();
  const StoredBlock s = Block(i, b);
  uint64_t sum = 0;
  if (!Guarded([&] { sum = Checksum64(raw, s.raw_size); })) {
    return Shrank(i, s.file_offset);
  }
  return CompareSum(i, b, sum);
}

uint64_t BlockSource::BlockChecksum(size_t i, uint64_t b) const {
  return at(i)->checksums()->Get(static_cast<flatbuffers::uoffset_t>(b));
}

Status BlockSource::ChecksumMismatch(size_t i, uint64_t b) const {
  const StoredBlock s = Block(i, b);
  return Error(StatusCode::kDataLoss, Where(i), ": checksum mismatch in block ", b, " (raw bytes [",
               s.raw_offset, ", ", s.raw_offset + s.raw_size, "), stored at file offset ",
               s.file_offset, ")");
}

Status BlockSource::CompareSum(size_t i, uint64_t b, uint64_t sum) const {
  if (!has_checksums() || sum == BlockChecksum(i, b)) return Status::Ok();
  return ChecksumMismatch(i, b);
}

// Scratch over kRetainedScratchBytes is leased from the process-wide budget: released when
// the block is done, so the lease is never held across blocks.
struct ScratchLease {
  DecodeScratch& scratch;
  ~ScratchLease() { scratch.Release(); }
};

Status BlockSource::CheckStoredSum(size_t i, uint64_t b) const {
  const StoredBlock s = Block(i, b);
  if (mapping_ != nullptr) return CheckSum(i, b, mapping_->data() + s.file_offset);
  if (!has_checksums()) return Status::Ok();
  thread_local DecodeScratch scratch;
  ScratchLease lease{scratch};
  auto got = scratch.Get(s.raw_size);
  if (!got.ok()) {
    return Error(got.status().code(), Where(i), ": verifying block ", b, ": ",
                 got.status().message());
  }
  FERRY_RETURN_IF_ERROR(ReadStoredRange(i, s.file_offset, s.raw_size, *got));
  return CheckSum(i, b, *got);
}

Status BlockSource::VerifyRange(size_t i, uint64_t begin, uint64_t len, const uint8_t* copy) const {
  if (len == 0) return Status::Ok();  // empty tensors have no blocks (block_size 0)
  const fb::Tensor* t = at(i);
  const uint64_t bs = t->block_size(), end = begin + len;
  for (uint64_t b = begin / bs; b * bs < end; ++b) {
    uint64_t bb = b * bs, be = bb + BlockRawSize(i, b);
    if (copy != nullptr && bb >= begin && be <= end) {
      FERRY_RETURN_IF_ERROR(CheckSum(i, b, copy + (bb - begin)));
    } else {
      FERRY_RETURN_IF_ERROR(CheckStoredSum(i, b));
    }
  }
  return Status::Ok();
}

Status BlockSource::VerifyBlock(size_t i, uint64_t b) const {
  if (at(i)->encoding() == fb::Encoding::RAW) return CheckStoredSum(i, b);
  const uint8_t* src = mapping_ ? mapping_->data() + Block(i, b).file_offset : nullptr;
  return DecodeRange(i, b, src, 0, 0, nullptr, true);
}

Status BlockSource::VerifyTensor(size_t i) const {
  for (uint64_t b = 0; b < NumBlocks(i); ++b) FERRY_RETURN_IF_ERROR(VerifyBlock(i, b));
  return Status::Ok();
}

Status BlockSource::DecodeRange(size_t i, uint64_t b, const uint8_t* src, uint64_t lo, uint64_t hi,
                                uint8_t* dst, bool verify) const {
  const fb::Tensor* t = at(i);
  const StoredBlock s = Block(i, b);
  const size_t width = ShuffleWidth(static_cast<DType>(t->dtype()));
  const bool shuffled = t->encoding() == fb::Encoding::SHUFFLE_ZSTD && width > 1;
  // A PLANES block decodes through a second block-sized buffer (`work`).
  auto decode = [&](uint8_t* out, uint8_t* work) -> Status {
    // `src` is in the mapping, or in a buffer a read filled (the guard is then idle).
    Status st;
    bool read = Guarded([&] {
      if (s.planes) {
        st = planes::Decode(src, s.stored_size, out, s.raw_size, work);
      } else if (!s.compressed) {
        std::memcpy(out, src, s.raw_size);
      } else {
        st = ZstdDecompressExact(src, s.stored_size, out, s.raw_size);
      }
    });
    if (!read) return Shrank(i, s.file_offset);
    if (!st.ok()) {
      return Error(StatusCode::kDataLoss, Where(i), s.planes ? ": block " : ": chunk ", b,
                   " at file offset ", s.file_offset, ": ", st.message());
    }
    return Status::Ok();
  };
  const bool whole = lo == 0 && hi == s.raw_size && !shuffled && !s.planes;
  // One block-sized buffer holding the block as stored (still shuffled): the bytes wanted are
  // picked out of it and its checksum computed from it, without a second one. Without `src`,
  // the stored bytes are read in behind it. One lease for all of a block's buffers: two
  // leases per thread could deadlock the shared budget.
  const uint64_t work = whole ? 0 : (s.planes ? 2 * s.raw_size : s.raw_size);
  const uint64_t need = work + (src == nullptr ? s.stored_size : 0);
  thread_local DecodeScratch scratch;
  ScratchLease lease{scratch};
  uint8_t* buf = nullptr;
  if (need > 0) {
    auto got = scratch.Get(need);
    if (!got.ok()) {
      return Error(got.status().code(), Where(i), ": decoding block ", b, ": ",
                   got.status().message());
    }
    buf = *got;
  }
  if (src == nullptr) {
    FERRY_RETURN_IF_ERROR(ReadStoredRange(i, s.file_offset, s.stored_size, buf + work));
    src = buf + work;
  }
  if (whole) {  // straight into the destination
    FERRY_RETURN_IF_ERROR(decode(dst, nullptr));
    return verify ? CheckSum(i, b, dst) : Status::Ok();
  }
  FERRY_RETURN_IF_ERROR(decode(buf, s.planes ? buf + s.raw_size : nullptr));
  if (verify && has_checksums()) {
    FERRY_RETURN_IF_ERROR(CompareSum(
        i, b,
        shuffled ? UnshuffledChecksum64(buf, s.raw_size, width) : Checksum64(buf, s.raw_size)));
  }
  if (hi > lo) {
    if (shuffled) {
      UnshuffleRange(buf, s.raw_size, width, lo, hi, dst);
    } else {
      std::memcpy(dst, buf + lo, hi - lo);
    }
  }
  return Status::Ok();
}

Status BlockSource::ReadRaw(size_t i, uint64_t begin, uint64_t len, uint8_t* dst,
                            const ReadPath& how) const {
  const uint64_t offset = at(i)->data_offset() + begin;
  if (how.direct == nullptr && mapping_ == nullptr) {
    FERRY_RETURN_IF_ERROR(ReadStoredRange(i, offset, len, dst));
    return how.verify ? VerifyRange(i, begin, len, dst) : Status::Ok();
  }
  const uint8_t* src = how.direct == nullptr ? mapping_->data() + offset : nullptr;
  if (how.direct != nullptr) {
    FERRY_ASSIGN_OR_RETURN(src, how.direct->ReadThrough(offset, len));
  }
  bool read = Guarded([&] {
    if (how.streaming) {
      StreamingCopy(dst, src, len);
    } else {
      std::memcpy(dst, src, len);
    }
  });
  if (!read) return Shrank(i, offset);
  // Checked after the copy, in `dst`: the bytes handed out are the bytes verified, even if
  // the file is rewritten under the mapping meanwhile. Not after streaming stores: those
  // bypassed the cache, and reading them back is slow.
  if (how.verify) return VerifyRange(i, begin, len, how.streaming ? nullptr : dst);
  return Status::Ok();
}

Status BlockSource::Read(size_t i, uint64_t begin, uint64_t len, uint8_t* dst,
                         const ReadPath& how) const {
  const fb::Tensor* t = at(i);
  uint64_t end;
  if (AddOverflows(begin, len, &end) || end > t->nbytes()) {
    return Error(StatusCode::kInvalidArgument, Where(i), ": byte range [", begin, ", ", begin + len,
                 ") outside its ", t->nbytes(), " bytes");
  }
  if (len == 0) return Status::Ok();
  if (t->encoding() == fb::Encoding::RAW) return ReadRaw(i, begin, len, dst, how);
  const uint64_t bs = t->block_size();
  for (uint64_t b = begin / bs; b * bs < end; ++b) {
    const StoredBlock s = Block(i, b);
    const uint8_t* src = mapping_ ? mapping_->data() + s.file_offset : nullptr;
    if (how.direct != nullptr) {
      FERRY_ASSIGN_OR_RETURN(src, how.direct->ReadThrough(s.file_offset, s.stored_size));
    }
    uint64_t lo = std::max(begin, s.raw_offset), hi = std::min(end, s.raw_offset + s.raw_size);
    FERRY_RETURN_IF_ERROR(DecodeRange(i, b, src, lo - s.raw_offset, hi - s.raw_offset,
                                      dst + (lo - begin), how.verify));
  }
  return Status::Ok();
}

}  // namespace ferry
