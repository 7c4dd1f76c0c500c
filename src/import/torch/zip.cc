// Central directory, zip64 and local header parsing; see zip.hpp.
#include "import/torch/zip.hpp"

#include <algorithm>
#include <cstring>

#include "base/util.hpp"
#include "format/sniff.hpp"

namespace ferry::torch_import {

namespace {

constexpr uint32_t kLocalSig = 0x04034b50;
constexpr uint32_t kCentralSig = 0x02014b50;
constexpr uint32_t kEndSig = 0x06054b50;
constexpr uint32_t kEnd64Sig = 0x06064b50;
constexpr uint32_t kEnd64LocatorSig = 0x07064b50;
constexpr uint64_t kEndSize = 22;
constexpr uint64_t kCentralSize = 46;
constexpr uint64_t kLocalSize = 30;

uint16_t U16(const uint8_t* p) { return static_cast<uint16_t>(p[0] | (p[1] << 8)); }
uint32_t U32(const uint8_t* p) {
  return uint32_t{p[0]} | (uint32_t{p[1]} << 8) | (uint32_t{p[2]} << 16) | (uint32_t{p[3]} << 24);
}
uint64_t U64(const uint8_t* p) { return uint64_t{U32(p)} | (uint64_t{U32(p + 4)} << 32); }

// The zip64 extended information extra field (id 1) of a central directory entry: only the
// fields whose 32-bit slot is 0xFFFFFFFF are present, in this order.
Status ReadZip64Extra(const uint8_t* extra, uint64_t len, uint64_t* size, uint64_t* csize,
                      uint64_t* offset, const std::string& where) {
  uint64_t pos = 0;
  while (pos + 4 <= len) {
    uint16_t id = U16(extra + pos), n = U16(extra + pos + 2);
    if (pos + 4 + n > len) break;
    if (id == 1) {
      const uint8_t* f = extra + pos + 4;
      uint64_t k = 0;
      for (uint64_t* v : {size, csize, offset}) {
        if (*v != 0xFFFFFFFFu) continue;
        if (k + 8 > n) return Error(StatusCode::kDataLoss, where, ": zip64 extra field too short");
        *v = U64(f + k);
        k += 8;
      }
      return Status::Ok();
    }
    pos += 4 + n;
  }
  if (*size == 0xFFFFFFFFu || *csize == 0xFFFFFFFFu || *offset == 0xFFFFFFFFu) {
    return Error(StatusCode::kDataLoss, where, ": zip64 sizes without a zip64 extra field");
  }
  return Status::Ok();
}

}  // namespace

bool LooksLikeZip(const uint8_t* data, uint64_t size) {
  const FileKind kind = SniffFile(data, size);
  return kind == FileKind::kTorchZip || kind == FileKind::kZip;
}

Result<ZipArchive> ZipArchive::Open(const uint8_t* data, uint64_t size, std::string path,
                                    const Mapping* guard) {
  ZipArchive z;
  z.data_ = data;
  z.size_ = size;
  z.path_ = std::move(path);
  const std::string& p = z.path_;
  if (size < kEndSize) {
    return Error(StatusCode::kDataLoss, p, ": not a zip archive (", size, " bytes)");
  }
  // Headers are parsed from copies taken under the mapping's SIGBUS guard, so a file
  // truncated while it is read gives DataLoss, not a crash.
  auto copy = [&](uint64_t off, uint64_t n, std::vector<uint8_t>* out) -> Status {
    out->resize(n);
    if (n == 0) return Status::Ok();  // no memcpy through the null data() of an empty vector
    auto fn = [&] { std::memcpy(out->data(), data + off, n); };
    if (guard != nullptr ? !guard->Guard(fn) : (fn(), false)) {
      return Error(StatusCode::kDataLoss, p, ": the file shrank while it was read");
    }
    return Status::Ok();
  };
  // The end record sits in the last 22 + 65535 (comment) bytes; search backwards.
  const uint64_t lowest = size > kEndSize + 0xFFFF ? size - kEndSize - 0xFFFF : 0;
  std::vector<uint8_t> tail;
  FERRY_RETURN_IF_ERROR(copy(lowest, size - lowest, &tail));
  auto in_tail = [&](uint64_t off) { return tail.data() + (off - lowest); };
  uint64_t end = UINT64_MAX;
  for (uint64_t pos = size - kEndSize + 1; pos-- > lowest;) {
    if (U32(in_tail(pos)) == kEndSig && pos + kEndSize + U16(in_tail(pos) + 20) == size) {
      end = pos;
      break;
    }
  }
  if (end == UINT64_MAX) {
    return Error(StatusCode::kDataLoss, p, ": no zip end of central directory record");
  }
  const uint8_t* e = in_tail(end);
  if (U16(e + 4) != 0 || U16(e + 6) != 0) {
    return Error(StatusCode::kDataLoss, p, ": multi-disk zip archives are not supported");
  }
  uint64_t count = U16(e + 10), cd_size = U32(e + 12), cd_offset = U32(e + 16);
  uint64_t cd_limit = end;
  if (count == 0xFFFF || cd_size == 0xFFFFFFFFu || cd_offset == 0xFFFFFFFFu) {
    if (end < lowest + 20 || U32(in_tail(end - 20)) != kEnd64LocatorSig) {
      return Error(StatusCode::kDataLoss, p, ": zip64 archive without a zip64 locator at offset ",
                   end);
    }
    uint64_t rec = U64(in_tail(end - 20) + 8);
    std::vector<uint8_t> r64;
    if (rec > end - 20 || end - 20 - rec < 56) {
      return Error(StatusCode::kDataLoss, p, ": bad zip64 end of central directory at offset ",
                   rec);
    }
    FERRY_RETURN_IF_ERROR(copy(rec, 56, &r64));
    if (U32(r64.data()) != kEnd64Sig) {
      return Error(StatusCode::kDataLoss, p, ": bad zip64 end of central directory at offset ",
                   rec);
    }
    count = U64(r64.data() + 32);
    cd_size = U64(r64.data() + 40);
    cd_offset = U64(r64.data() + 48);
    cd_limit = rec;
  }
  if (cd_offset > cd_limit || cd_size > cd_limit - cd_offset) {
    return Error(StatusCode::kDataLoss, p, ": central directory (offset ", cd_offset, ", ", cd_size,
                 " bytes) lies outside the archive");
  }
  if (count > kMaxZipEntries || count > cd_size / kCentralSize) {
    return Error(StatusCode::kDataLoss, p, ": central directory claims ", count, " entries in ",
                 cd_size, " bytes");
  }
  std::vector<uint8_t> dir, local_header;
  FERRY_RETURN_IF_ERROR(copy(cd_offset, cd_size, &dir));
  // [local header offset, data end) of every entry, to refuse overlapping entries.
  std::vector<std::pair<uint64_t, uint64_t>> extents;
  extents.reserve(count);
  z.entries_.reserve(count);
  uint64_t pos = cd_offset;
  const uint64_t cd_end = cd_offset + cd_size;
  for (uint64_t i = 0; i < count; ++i) {
    const uint8_t* c = dir.data() + (pos - cd_offset);
    if (cd_end - pos < kCentralSize || U32(c) != kCentralSig) {
      return Error(StatusCode::kDataLoss, p, ": bad central directory entry ", i, " at offset ",
                   pos);
    }
    uint16_t flags = U16(c + 8), method = U16(c + 10);
    uint64_t csize = U32(c + 20), usize = U32(c + 24);
    uint64_t name_len = U16(c + 28), extra_len = U16(c + 30), comment_len = U16(c + 32);
    uint64_t local = U32(c + 42);
    if (cd_end - pos - kCentralSize < name_len + extra_len + comment_len) {
      return Error(StatusCode::kDataLoss, p, ": central directory entry ", i, " at offset ", pos,
                   " runs past the directory");
    }
    std::string name(reinterpret_cast<const char*>(c + kCentralSize), name_len);
    std::string where = StrCat(p, ": zip entry ", Quote(name));
    FERRY_RETURN_IF_ERROR(
        ReadZip64Extra(c + kCentralSize + name_len, extra_len, &usize, &csize, &local, where));
    if (flags & 1) return Error(StatusCode::kDataLoss, where, " is encrypted");
    if (method == 0 && csize != usize) {
      return Error(StatusCode::kDataLoss, where, " is stored but its sizes differ (", csize,
                   " and ", usize, ")");
    }
    if (local > cd_offset || cd_offset - local < kLocalSize + name_len) {
      return Error(StatusCode::kDataLoss, where, ": no local header at offset ", local);
    }
    FERRY_RETURN_IF_ERROR(copy(local, kLocalSize + name_len, &local_header));
    const uint8_t* l = local_header.data();
    if (U32(l) != kLocalSig) {
      return Error(StatusCode::kDataLoss, where, ": no local header at offset ", local);
    }
    uint64_t lname = U16(l + 26), lextra = U16(l + 28);
    uint64_t data_offset = local + kLocalSize + lname + lextra;
    if (data_offset > cd_offset || csize > cd_offset - data_offset) {
      return Error(StatusCode::kDataLoss, where, ": data (offset ", data_offset, ", ", csize,
                   " bytes) lies outside the archive");
    }
    if (lname != name_len || std::memcmp(l + kLocalSize, name.data(), name_len) != 0 ||
        U16(l + 8) != method) {
      return Error(StatusCode::kDataLoss, where, ": local header at offset ", local,
                   " disagrees with the central directory");
    }
    extents.emplace_back(local, data_offset + csize);
    z.entries_.push_back(ZipEntry{std::move(name), method, data_offset, csize});
    pos += kCentralSize + name_len + extra_len + comment_len;
  }
  std::sort(extents.begin(), extents.end());
  for (size_t i = 1; i < extents.size(); ++i) {
    if (extents[i].first < extents[i - 1].second) {
      return Error(StatusCode::kDataLoss, p, ": zip entries overlap at offset ", extents[i].first);
    }
  }
  std::sort(z.entries_.begin(), z.entries_.end(),
            [](const ZipEntry& a, const ZipEntry& b) { return a.name < b.name; });
  for (size_t i = 1; i < z.entries_.size(); ++i) {
    if (z.entries_[i].name == z.entries_[i - 1].name) {
      return Error(StatusCode::kDataLoss, p, ": zip entry ", Quote(z.entries_[i].name),
                   " appears twice");
    }
  }
  return z;
}

const ZipEntry* ZipArchive::Find(std::string_view name) const {
  auto it = std::lower_bound(entries_.begin(), entries_.end(), name,
                             [](const ZipEntry& e, std::string_view n) { return e.name < n; });
  return it != entries_.end() && it->name == name ? &*it : nullptr;
}

Result<const uint8_t*> ZipArchive::Data(const ZipEntry& entry) const {
  if (entry.method != 0) {
    return Error(StatusCode::kDataLoss, path_, ": zip entry ", Quote(entry.name),
                 " is compressed (method ", entry.method,
                 "); torch.save stores entries uncompressed, and only such archives are read");
  }
  return data_ + entry.data_offset;
}

}  // namespace ferry::torch_import
