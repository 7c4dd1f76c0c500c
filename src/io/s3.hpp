// S3 requests: where an object lives (endpoint, path-style or virtual-hosted addressing, the
// key percent-encoded once) and how a request to it is signed (SigV4, or unsigned when no
// credentials were found). Pure functions, thread-safe.
#ifndef FERRY_SRC_IO_S3_HPP_
#define FERRY_SRC_IO_S3_HPP_

#include <ctime>
#include <string>
#include <utility>
#include <vector>

#include "ferry/status.hpp"
#include "io/aws_config.hpp"
#include "io/url.hpp"

namespace ferry {

using QueryParams = std::vector<std::pair<std::string, std::string>>;

struct S3Object {
  std::string bucket;
  std::string key;
  HttpUrl url;  // the object's URL without a query: scheme, host, port, encoded path
  bool path_style = true;
  // "s3://bucket/key" as messages print it.
  std::string Name() const;
};

// The object's address under `settings` (endpoint, region, addressing style).
// InvalidArgument for an endpoint that is not an http(s) URL, or virtual-hosted addressing
// asked for a bucket name that cannot be a host name.
Result<S3Object> ResolveS3Object(const S3Url& url, const AwsSettings& settings);

// The URL of a request to the object with these query parameters (encoded as SigV4 wants).
std::string S3RequestUrl(const S3Object& object, const QueryParams& query);

// Appends the Host, x-amz-* and Authorization headers of a SigV4-signed request ("Name:
// value"), signed at `now`; nothing but Host when the settings hold no credentials.
void S3Authorize(const AwsSettings& settings, const S3Object& object, const std::string& method,
                 const QueryParams& query, const std::string& payload_sha256, std::time_t now,
                 std::vector<std::string>* headers);

}  // namespace ferry

#endif  // FERRY_SRC_IO_S3_HPP_
