// Byte sources (src/io/source.hpp): local files, mapped or read with pread, and the dispatch
// to remote storage.
#include "io/source.hpp"

#include <sys/statfs.h>

#include <cctype>
#include <cerrno>
#include <cstdio>
#include <string_view>
#include <utility>

#include "base/util.hpp"
#include "io/remote.hpp"

namespace ferry {

const std::shared_ptr<const Mapping>& ByteSource::mapping() const {
  static const std::shared_ptr<const Mapping> kNone;
  return kNone;
}

Status ByteSource::ReadRanges(std::span<const ReadRange> ranges) const {
  for (const ReadRange& r : ranges) FERRY_RETURN_IF_ERROR(ReadAt(r.offset, r.len, r.dst));
  return Status::Ok();
}

namespace {

struct FileSystemRow {
  uint32_t magic;
  FileSystemKind kind;
};

// statfs(2) f_type values (linux/magic.h, and the vendors' own for out-of-tree clients).
constexpr FileSystemRow kFileSystems[] = {
    // Network and cluster file systems whose pages come from a server.
    {0x6969, {"nfs", true}},
    {0x517B, {"smb", true}},
    {0xFF534D42, {"cifs", true}},
    {0xFE534D42, {"smb2", true}},
    {0x0BD00BD0, {"lustre", true}},
    // Every FUSE file system: s3fs, gcsfuse, sshfs, the BeeGFS and GlusterFS clients,
    // virtiofs, ... (a local FUSE file system is rare enough to take the safe path too).
    {0x65735546, {"fuse", true}},
    {0x00C36400, {"ceph", true}},
    {0x47504653, {"gpfs", true}},
    {0x01021997, {"9p", true}},
    {0x5346414F, {"afs", true}},
    {0x6B414653, {"afs", true}},
    {0x73757245, {"coda", true}},
    {0x564C, {"ncp", true}},
    {0x20030528, {"orangefs", true}},
    {0x19830326, {"beegfs", true}},
    {0xAAD7AAEA, {"panfs", true}},
    // Local file systems, named in Describe().
    {0xEF53, {"ext4", false}},
    {0x58465342, {"xfs", false}},
    {0x9123683E, {"btrfs", false}},
    {0x01021994, {"tmpfs", false}},
    {0x858458F6, {"ramfs", false}},
    {0x958458F6, {"hugetlbfs", false}},
    {0x794C7630, {"overlay", false}},
    {0x2FC12FC1, {"zfs", false}},
    {0xF2F52010, {"f2fs", false}},
    {0xCA451A4E, {"bcachefs", false}},
    {0x73717368, {"squashfs", false}},
    {0xE0F5E1E2, {"erofs", false}},
    {0x52654973, {"reiserfs", false}},
    {0x3153464A, {"jfs", false}},
    {0x4D44, {"vfat", false}},
    {0x2011BAB0, {"exfat", false}},
    {0x5346544E, {"ntfs", false}},
    {0x9660, {"iso9660", false}},
};

std::string FileSystemText(uint64_t magic, const FileSystemKind& kind) {
  if (kind.name != nullptr) return kind.name;
  char hex[24];
  std::snprintf(hex, sizeof(hex), "magic 0x%llx", static_cast<unsigned long long>(magic));
  return hex;
}

// A local file: mapped (mapping_ set), or read with pread alone. Reads always use pread on
// the open descriptor, even when the file is mapped: the trailer, the footer and one-shot
// loads then cost no page faults on a mapping used once.
class LocalSource final : public ByteSource {
 public:
  LocalSource(File file, uint64_t size, std::string describe)
      : file_(std::move(file)), fd_(file_.fd()), size_(size), describe_(std::move(describe)) {}
  LocalSource(std::shared_ptr<const Mapping> mapping, std::string describe)
      : mapping_(std::move(mapping)),
        fd_(mapping_->fd()),
        size_(mapping_->size()),
        describe_(std::move(describe)) {}

  const std::string& name() const override { return mapping_ ? mapping_->path() : file_.path(); }
  uint64_t size() const override { return size_; }
  const std::shared_ptr<const Mapping>& mapping() const override { return mapping_; }
  std::string Describe() const override { return describe_; }

  Status ReadAt(uint64_t offset, uint64_t len, uint8_t* dst) const override {
    uint64_t end;
    if (AddOverflows(offset, len, &end) || end > size_) {
      return Error(StatusCode::kDataLoss, name(), ": bytes [", offset, ", ", offset + len,
                   ") lie past the end of the ", size_, "-byte file");
    }
    uint64_t done = 0;
    if (int err = PReadLoop(fd_, dst, len, offset, &done); err != 0) {
      return Error(StatusCode::kIoError, name(), ": read at file offset ", offset + done,
                   " failed ", ErrnoText(err));
    }
    if (done < len) {
      return Error(StatusCode::kDataLoss, name(), ": the file ends at offset ", offset + done,
                   ", inside the ", len, " bytes read at offset ", offset, " (", size_,
                   " bytes when opened: truncated after it was opened?)");
    }
    return Status::Ok();
  }

 private:
  File file_;  // unused (closed) when mapped: the mapping holds the descriptor
  std::shared_ptr<const Mapping> mapping_;
  int fd_;
  uint64_t size_;
  std::string describe_;
};

Result<std::shared_ptr<ByteSource>> OpenLocal(const std::string& path,
                                              const SourceOptions& options) {
  // Refuses non-regular files without blocking (a FIFO would wait for a writer).
  FERRY_ASSIGN_OR_RETURN(File file, File::OpenRead(path));
  struct statfs fs;
  int rc;
  do {
    rc = ::fstatfs(file.fd(), &fs);
  } while (rc != 0 && errno == EINTR);
  // Unknown when fstatfs fails: taken as local, as before file systems were told apart.
  const uint64_t magic = rc == 0 ? static_cast<uint64_t>(fs.f_type) : 0;
  const FileSystemKind kind = rc == 0 ? ClassifyFileSystem(magic) : FileSystemKind{"unknown"};
  const std::string fs_text = FileSystemText(magic, kind);
  if (kind.network || !options.allow_mmap) {
    FERRY_ASSIGN_OR_RETURN(uint64_t size, file.Size());
    std::string why = kind.network ? StrCat("network file system: ", fs_text)
                                   : StrCat("mapping turned off; local file system: ", fs_text);
    return std::shared_ptr<ByteSource>(
        std::make_shared<LocalSource>(std::move(file), size, StrCat("pread, no mmap (", why, ")")));
  }
  FERRY_ASSIGN_OR_RETURN(std::shared_ptr<Mapping> mapping, Mapping::Map(std::move(file)));
  return std::shared_ptr<ByteSource>(std::make_shared<LocalSource>(
      std::move(mapping), StrCat("mmap (local file system: ", fs_text, ")")));
}

bool StartsWithNoCase(const std::string& s, std::string_view prefix) {
  if (s.size() < prefix.size()) return false;
  for (size_t i = 0; i < prefix.size(); ++i) {
    if (std::tolower(static_cast<unsigned char>(s[i])) != prefix[i]) return false;
  }
  return true;
}

// "scheme://..." with an RFC 3986 scheme: a URL rather than a path, when no such file exists.
size_t SchemeLength(const std::string& s) {
  size_t n = 0;
  while (n < s.size() && (std::isalnum(static_cast<unsigned char>(s[n])) || s[n] == '+' ||
                          s[n] == '-' || s[n] == '.')) {
    ++n;
  }
  bool url = n > 0 && std::isalpha(static_cast<unsigned char>(s[0])) && s.compare(n, 3, "://") == 0;
  return url ? n : 0;
}

}  // namespace

FileSystemKind ClassifyFileSystem(uint64_t magic) {
  // f_type is a signed word: 32-bit systems sign-extend the magic numbers above 2^31.
  const auto low = static_cast<uint32_t>(magic);
  for (const FileSystemRow& row : kFileSystems) {
    if (row.magic == low) return row.kind;
  }
  return FileSystemKind{};
}

bool IsRemoteName(const std::string& path_or_url) {
  return StartsWithNoCase(path_or_url, "http://") || StartsWithNoCase(path_or_url, "https://") ||
         StartsWithNoCase(path_or_url, "s3://");
}

Result<std::shared_ptr<ByteSource>> OpenSource(const std::string& path_or_url,
                                               const SourceOptions& options) {
  if (IsRemoteName(path_or_url)) return OpenRemoteSource(path_or_url, options);
  auto local = OpenLocal(path_or_url, options);
  if (!local.ok() && local.status().code() == StatusCode::kNotFound) {
    if (size_t n = SchemeLength(path_or_url); n > 0) {
      return Error(StatusCode::kInvalidArgument, PrintableUrl(path_or_url), ": URL scheme ",
                   Quote(path_or_url.substr(0, n)),
                   " is not supported (http://, https://, s3://), and no local file has this "
                   "name");
    }
  }
  return local;
}

}  // namespace ferry
