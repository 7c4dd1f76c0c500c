// Where a checkpoint's stored bytes come from: the one interface through which the layers
// above io/ read a file. A local file is mapped; a file on a network file system is read with
// large preads and never mapped (page faults over NFS/Lustre stall); an http(s):// URL or an
// s3:// object is read with parallel range GETs. The format layer, the loader and everything
// above them see only this interface, so a new kind of storage is added here alone.
//
// Thread safety: a ByteSource is immutable after Open; every method may be called from any
// number of threads at once. Lifetime: shared (std::shared_ptr); views into mapping() stay
// valid while the source, or the shared_ptr to its mapping, lives.
#ifndef FERRY_SRC_IO_SOURCE_HPP_
#define FERRY_SRC_IO_SOURCE_HPP_

#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "ferry/status.hpp"
#include "io/io.hpp"

namespace ferry {

// One range of a batched read: source bytes [offset, offset + len) into dst.
struct ReadRange {
  uint64_t offset = 0;
  uint64_t len = 0;
  uint8_t* dst = nullptr;
};

class ByteSource {
 public:
  virtual ~ByteSource() = default;

  // The path or URL as messages print it: never with credentials, signatures or query strings
  // that may carry them.
  virtual const std::string& name() const = 0;
  virtual uint64_t size() const = 0;

  // The whole object mapped read-only, or null where its bytes are reached only by reads
  // (network file systems, HTTP, S3). Views, DMA from the page cache and residency samples
  // need it; every other path works without.
  virtual const std::shared_ptr<const Mapping>& mapping() const;

  // Reads bytes [offset, offset + len) into dst (any alignment). DataLoss, naming name() and
  // the offset, when the source ends before offset + len or changed since it was opened;
  // IoError for a failed read.
  virtual Status ReadAt(uint64_t offset, uint64_t len, uint8_t* dst) const = 0;
  // Reads every range; sources whose reads pay a round trip keep several in flight. The first
  // error wins; the contents of every dst are then unspecified.
  virtual Status ReadRanges(std::span<const ReadRange> ranges) const;

  // Reads of about this many bytes, this many at once, keep the source busy (the loader sizes
  // its pieces and threads by them when there is no mapping).
  virtual uint64_t preferred_read_bytes() const { return uint64_t{4} << 20; }
  virtual int preferred_parallel_reads() const { return 8; }

  // How the bytes are reached and why, for `ferry inspect` (for example "mmap (local ext4)",
  // "pread, no mmap (network file system: nfs)", "HTTP range GETs").
  virtual std::string Describe() const = 0;
};

// How OpenSource reaches what a path or URL names.
struct SourceOptions {
  // Local files: map unless the file system is a network one (false: never map).
  bool allow_mmap = true;
  // Remote sources (http://, https://, s3://); 0 or empty keeps the default, which the
  // environment may set (remote_source.hpp, aws_config.hpp).
  // PEM file of the certificate authorities to trust; empty: AWS_CA_BUNDLE (s3:// only), then
  // CURL_CA_BUNDLE, then SSL_CERT_FILE, else the system's.
  std::string ca_bundle;
  int max_attempts = 0;      // attempts of one request before its error is returned (5)
  int max_in_flight = 0;     // range GETs at once, and connections kept open (8)
  uint64_t piece_bytes = 0;  // bytes per range GET (8 MiB)
};

// Opens a local path, an http:// or https:// URL, or an s3://bucket/key object. NotFound for
// a missing file or object; InvalidArgument for a URL scheme that is not supported.
Result<std::shared_ptr<ByteSource>> OpenSource(const std::string& path_or_url,
                                               const SourceOptions& options = {});

// True for names OpenSource reads over the network (http://, https://, s3://).
bool IsRemoteName(const std::string& path_or_url);

// A URL as messages may print it: without user information ("user:secret@"), query string
// (presigned URLs carry their signature there) or fragment.
std::string PrintableUrl(const std::string& url);

// The file system an fstatfs(2) f_type names: whether its pages are reached over a network
// (mapping them turns every page fault into a round trip that cannot be retried or
// overlapped, and a server hiccup into SIGBUS), so local files there are read, never mapped.
struct FileSystemKind {
  const char* name = nullptr;  // "ext4", "nfs", ...; null for a magic number not listed
  bool network = false;
};
FileSystemKind ClassifyFileSystem(uint64_t magic);

}  // namespace ferry

#endif  // FERRY_SRC_IO_SOURCE_HPP_
