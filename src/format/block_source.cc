// Locating, reading, decoding and verifying stored blocks (src/format/block_source.hpp).
#include "format/block_source.hpp"

#include <sys/stat.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "codec/codec.hpp"
#include "format/footer.hpp"
#include "codec/planes.hpp"
#include "base/util.hpp"

namespace ferry {

BlockSource::BlockSource(std::string path, std::shared_ptr<const Mapping> mapping, Index index)
    : path_(std::move(path)), mapping_(std::move(mapping)), index_(std::move(index)) {}

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

Status BlockSource::CheckSum(size_t i, uint64_t b, const uint8_t* raw) const {
  if (!has_checksums()) return Status::Ok();
  const StoredBlock s = Block(i, b);
  uint64_t sum = 0;
  if (!mapping_->Guard([&] { sum = Checksum64(raw, s.raw_size); })) {
    return Shrank(i, s.file_offset);
  }
  return CompareSum(i, b, sum);
}

Status BlockSource::CompareSum(size_t i, uint64_t b, uint64_t sum) const {
  if (!has_checksums()) return Status::Ok();
  const StoredBlock s = Block(i, b);
  uint64_t expect = at(i)->checksums()->Get(static_cast<flatbuffers::uoffset_t>(b));
  if (sum != expect) {
    return Error(StatusCode::kDataLoss, Where(i), ": checksum mismatch in block ", b,
                 " (raw bytes [", s.raw_offset, ", ", s.raw_offset + s.raw_size,
                 "), stored at file offset ", s.file_offset, ")");
  }
  return Status::Ok();
}

Status BlockSource::VerifyRange(size_t i, uint64_t begin, uint64_t len, const uint8_t* copy) const {
  if (len == 0) return Status::Ok();  // empty tensors have no blocks (block_size 0)
  const fb::Tensor* t = at(i);
  const uint64_t bs = t->block_size(), end = begin + len;
  for (uint64_t b = begin / bs; b * bs < end; ++b) {
    uint64_t bb = b * bs, be = bb + BlockRawSize(i, b);
    const uint8_t* raw = copy != nullptr && bb >= begin && be <= end
                             ? copy + (bb - begin)
                             : mapping_->data() + t->data_offset() + bb;
    FERRY_RETURN_IF_ERROR(CheckSum(i, b, raw));
  }
  return Status::Ok();
}

Status BlockSource::VerifyBlock(size_t i, uint64_t b) const {
  const StoredBlock s = Block(i, b);
  if (at(i)->encoding() == fb::Encoding::RAW) {
    return CheckSum(i, b, mapping_->data() + s.file_offset);
  }
  return DecodeRange(i, b, mapping_->data() + s.file_offset, 0, 0, nullptr, true);
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
    // `src` is in the mapping, or in a buffer a direct read filled (the guard is then idle).
    Status st;
    bool read = mapping_->Guard([&] {
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
  if (lo == 0 && hi == s.raw_size && !shuffled && !s.planes) {  // straight into the destination
    FERRY_RETURN_IF_ERROR(decode(dst, nullptr));
    return verify ? CheckSum(i, b, dst) : Status::Ok();
  }
  // One block-sized buffer holding the block as stored (still shuffled): the bytes wanted are
  // picked out of it and its checksum computed from it, without a second one. Scratch over
  // kRetainedScratchBytes is leased from the process-wide budget and released after the block.
  thread_local DecodeScratch scratch;
  struct Release {
    DecodeScratch& scratch;
    ~Release() { scratch.Release(); }
  } release{scratch};
  // One lease for both of a PLANES block's buffers: two leases per thread could deadlock the
  // shared budget.
  auto got = scratch.Get(s.planes ? 2 * s.raw_size : s.raw_size);
  if (!got.ok()) {
    return Error(got.status().code(), Where(i), ": decoding block ", b, ": ",
                 got.status().message());
  }
  uint8_t* buf = *got;
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
  const uint8_t* src = mapping_->data() + offset;
  if (how.direct != nullptr) {
    FERRY_ASSIGN_OR_RETURN(src, how.direct->ReadThrough(offset, len));
  }
  bool read = mapping_->Guard([&] {
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
    const uint8_t* src = mapping_->data() + s.file_offset;
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
