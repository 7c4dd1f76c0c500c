// ByteSources over the network: an http(s):// URL or an s3:// object read with parallel
// range GETs (http_client.hpp). Opening sends one small suffix-range GET that learns the size
// and the ETag and keeps the object's last tail_bytes (where a checkpoint's trailer and footer
// are), so a reader's first reads cost no further round trip. Every later request carries
// If-Match with that ETag (If-Unmodified-Since where the server gives only Last-Modified), and
// every answer's Content-Range, Content-Length, ETag and body length are checked: an object
// replaced while it is read is DataLoss, a short or inconsistent answer is retried from the
// first byte not yet received, and no byte lands in a buffer unless it is the byte asked for.
//
// Thread safety: as ByteSource (immutable after Open, every method callable concurrently).
#ifndef FERRY_SRC_IO_REMOTE_SOURCE_HPP_
#define FERRY_SRC_IO_REMOTE_SOURCE_HPP_

#include <cstdint>
#include <memory>
#include <string>

#include "ferry/status.hpp"
#include "io/aws_config.hpp"
#include "io/http_client.hpp"
#include "io/source.hpp"

namespace ferry {

struct RemoteOptions {
  // max_in_flight is the source's preferred_parallel_reads().
  HttpOptions http;
  // Reads are split into range GETs of at most this many bytes (preferred_read_bytes()).
  uint64_t piece_bytes = uint64_t{8} << 20;
  // Bytes at the end of the object fetched by the opening request and kept.
  uint64_t tail_bytes = uint64_t{64} << 10;
};

// The options OpenRemoteSource starts from: the defaults, with the CA bundle named by
// CURL_CA_BUNDLE or SSL_CERT_FILE (the variables curl and OpenSSL users already set).
RemoteOptions DefaultRemoteOptions(const EnvLookup& env);

// What SourceOptions set in code, over `base`: every field that is not 0 or empty replaces
// the base's. InvalidArgument for attempts outside [0, kMaxAttempts] or in-flight counts
// outside [0, kMaxInFlight].
inline constexpr int kMaxAttempts = 100;
inline constexpr int kMaxInFlight = 256;
Result<RemoteOptions> WithSourceOptions(RemoteOptions base, const SourceOptions& options);

// InvalidArgument for a malformed URL or one with user information (credentials never travel
// in URLs); NotFound when the server answers 404; IoError for other failures (each naming the
// URL without its query string).
Result<std::shared_ptr<ByteSource>> OpenHttpSource(const std::string& url,
                                                   const RemoteOptions& options);

// As OpenHttpSource, for s3://bucket/key with these settings (aws_config.hpp). The CA bundle
// of the settings applies when options.http.ca_bundle is empty.
Result<std::shared_ptr<ByteSource>> OpenS3Source(const std::string& url,
                                                 const AwsSettings& settings,
                                                 const RemoteOptions& options);

}  // namespace ferry

#endif  // FERRY_SRC_IO_REMOTE_SOURCE_HPP_
