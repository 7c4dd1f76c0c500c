// Opening a checkpoint: both ends of the file read once, then the footer located by the
// trailer (or a safetensors header), read, checked and parsed into the index a Reader keeps.
#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "base/util.hpp"
#include "base/worker_pool.hpp"
#include "ferry/ferry.hpp"
#include "format/block_source.hpp"
#include "format/footer.hpp"
#include "format/format.hpp"
#include "format/safetensors.hpp"
#include "io/source.hpp"

namespace ferry {

namespace {

// Bytes read from each end of a file at open: the head tells the formats apart and often
// holds a whole safetensors header; the tail holds the trailer and often the whole footer.
constexpr uint64_t kEndBytes = uint64_t{64} << 10;

// The first and last bytes of a file, read once each.
struct FileEnds {
  uint64_t size = 0;
  std::vector<uint8_t> head;  // bytes [0, head.size())
  std::vector<uint8_t> tail;  // bytes [size - tail.size(), size)
  uint64_t tail_offset() const { return size - tail.size(); }
};

Result<FileEnds> ReadEnds(const ByteSource& bytes) {
  FileEnds ends;
  ends.size = bytes.size();
  const uint64_t n = std::min(ends.size, kEndBytes);
  ends.head.resize(n);
  ends.tail.resize(n);
  FERRY_RETURN_IF_ERROR(bytes.ReadAt(0, n, ends.head.data()));
  FERRY_RETURN_IF_ERROR(bytes.ReadAt(ends.size - n, n, ends.tail.data()));
  return ends;
}

// A safetensors file: an index synthesized from its JSON header, without checksums.
Result<BlockSource::Index> SafetensorsHeaderIndex(const ByteSource& bytes, const FileEnds& ends) {
  const std::string& path = bytes.name();
  // ParseSafetensors reads the length, then the header it gives (or nothing more when the
  // length is out of bounds): the head holds both unless the header is large.
  const uint8_t* file = ends.head.data();
  std::vector<uint8_t> header;
  if (ends.size >= 8) {
    const uint64_t n = LoadU64(file);
    if (n <= kMaxSafetensorsHeaderBytes && n <= ends.size - 8 && 8 + n > ends.head.size()) {
      header.resize(8 + n);
      FERRY_RETURN_IF_ERROR(bytes.ReadAt(0, 8 + n, header.data()));
      file = header.data();
    }
  }
  auto synthesized = std::make_shared<std::vector<uint64_t>>();
  FERRY_ASSIGN_OR_RETURN(uint64_t index_size,
                         ParseSafetensors(file, ends.size, path, synthesized.get()));
  FooterRules rules;
  rules.checksums = false;
  rules.alignment = 1;
  BlockSource::Index index;
  FERRY_ASSIGN_OR_RETURN(
      index.root, ParseFooter(reinterpret_cast<const uint8_t*>(synthesized->data()), index_size,
                              ends.size, path, rules));
  index.memory = std::move(synthesized);
  index.safetensors = true;
  return index;
}

// Footers from this size on are read in slices on parallel threads and hashed beside their
// parse: a 100,000-tensor footer (20 MiB) is otherwise one long copy into fresh pages, then
// one long hash, then the parse, one after the other.
constexpr uint64_t kParallelFooterBytes = uint64_t{4} << 20;

// The footer's bytes into `dst`, in slices of at least kParallelFooterBytes / 2 on threads.
Status ReadFooterBytes(const ByteSource& bytes, const FooterLocation& loc, uint8_t* dst) {
  const uint64_t slice = kParallelFooterBytes / 2;
  const int parts = static_cast<int>(
      std::clamp<uint64_t>(loc.size / slice, 1, static_cast<uint64_t>(DefaultThreads(8))));
  if (parts == 1) return bytes.ReadAt(loc.offset, loc.size, dst);
  std::vector<Status> status(parts);
  RunParts(parts, [&](int k) {
    const uint64_t begin = loc.size * k / parts, end = loc.size * (k + 1) / parts;
    status[k] = bytes.ReadAt(loc.offset + begin, end - begin, dst + begin);
  });
  for (Status& st : status) FERRY_RETURN_IF_ERROR(st);
  return Status::Ok();
}

// Our own files: the footer located by the trailer, read, checked and parsed.
Result<BlockSource::Index> FooterIndex(const ByteSource& bytes, const FileEnds& ends) {
  const std::string& path = bytes.name();
  const uint8_t* trailer = ends.tail.size() >= format::kTrailerSize
                               ? ends.tail.data() + ends.tail.size() - format::kTrailerSize
                               : nullptr;
  FERRY_ASSIGN_OR_RETURN(FooterLocation loc, ParseTrailer(ends.head.data(), ends.head.size(),
                                                          trailer, ends.size, path));
  // The writer pads the footer to 8 bytes so the mapping's page alignment carries over.
  if (loc.offset % 8 != 0) {
    return Error(StatusCode::kDataLoss, path, ": footer offset ", loc.offset,
                 " is not 8-byte aligned");
  }
  // The index is a copy, not a view of the file: a file truncated or rewritten after open
  // must not turn every later lookup into a SIGBUS. Not value-initialised: zero-filling a
  // large index first would double the cost of the copy.
  std::shared_ptr<uint64_t[]> footer(new uint64_t[(loc.size + 7) / 8]);
  auto* copy = reinterpret_cast<uint8_t*>(footer.get());
  if (loc.offset >= ends.tail_offset()) {
    std::memcpy(copy, ends.tail.data() + (loc.offset - ends.tail_offset()), loc.size);
  } else {
    FERRY_RETURN_IF_ERROR(ReadFooterBytes(bytes, loc, copy));
  }
  // Checked on the copy: the bytes verified are the bytes parsed even if the file changes
  // meanwhile. A large footer is hashed on one thread while others check its tables: parsing
  // is safe on any bytes, and a checksum mismatch is what is reported when both fail.
  Status sum;
  Result<const fb::Checkpoint*> root = Status::Ok();
  if (loc.size < kParallelFooterBytes) {
    sum = CheckFooterSum(copy, loc, path);
    if (sum.ok()) root = ParseFooter(copy, loc.size, loc.offset, path);
  } else {
    RunParts(2, [&](int part) {
      if (part == 0) {
        sum = CheckFooterSum(copy, loc, path);
      } else {
        root = ParseFooter(copy, loc.size, loc.offset, path);
      }
    });
  }
  FERRY_RETURN_IF_ERROR(sum);
  BlockSource::Index index;
  FERRY_ASSIGN_OR_RETURN(index.root, std::move(root));
  index.memory = std::move(footer);
  return index;
}

}  // namespace

Result<std::shared_ptr<Reader>> OpenReader(std::shared_ptr<const ByteSource> bytes,
                                           ReaderOptions options) {
  FERRY_ASSIGN_OR_RETURN(FileEnds ends, ReadEnds(*bytes));
  const bool safetensors = LooksLikeSafetensors(ends.head.data(), ends.size);
  FERRY_ASSIGN_OR_RETURN(BlockSource::Index index, safetensors
                                                       ? SafetensorsHeaderIndex(*bytes, ends)
                                                       : FooterIndex(*bytes, ends));
  std::shared_ptr<Reader> reader(
      new Reader(std::make_unique<BlockSource>(std::move(bytes), std::move(index))));
  if (options.verify_on_open && !safetensors) FERRY_RETURN_IF_ERROR(reader->VerifyAll());
  return reader;
}

SourceOptions ToSourceOptions(const StorageOptions& storage) {
  SourceOptions out;
  out.ca_bundle = storage.ca_bundle;
  out.max_attempts = storage.max_attempts;
  out.max_in_flight = storage.max_in_flight;
  out.piece_bytes = storage.piece_bytes;
  return out;
}

Result<std::shared_ptr<Reader>> Reader::Open(const std::string& path, ReaderOptions options) {
  FERRY_ASSIGN_OR_RETURN(std::shared_ptr<ByteSource> bytes,
                         OpenSource(path, ToSourceOptions(options.storage)));
  return OpenReader(std::move(bytes), options);
}

}  // namespace ferry
