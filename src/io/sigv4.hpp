// AWS Signature Version 4 (HMAC-SHA256 over a canonical request), written here rather than
// left to libcurl's CURLOPT_AWS_SIGV4: libcurl before 8.x sends no x-amz-content-sha256 (S3
// refuses such requests), and a signer whose date is an argument can be checked against the
// AWS test-suite vectors. SHA-256 and HMAC come from OpenSSL's libcrypto, which libcurl's
// OpenSSL build loads anyway. Pure functions, thread-safe.
#ifndef FERRY_SRC_IO_SIGV4_HPP_
#define FERRY_SRC_IO_SIGV4_HPP_

#include <cstddef>
#include <ctime>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace ferry {

// Lower-case hex of SHA-256(data).
std::string Sha256Hex(const void* data, size_t size);
inline std::string Sha256Hex(std::string_view s) { return Sha256Hex(s.data(), s.size()); }
// SHA-256 of the empty string, the payload hash of every request without a body.
inline constexpr const char* kEmptySha256 =
    "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";

// Base64 of MD5(data) (Content-MD5 of uploaded parts).
std::string Md5Base64(const void* data, size_t size);

struct AwsCredentials {
  std::string access_key_id;
  std::string secret_access_key;
  std::string session_token;  // empty unless temporary credentials
  bool empty() const { return access_key_id.empty() || secret_access_key.empty(); }
};

struct SigV4Request {
  std::string method;
  // The path exactly as sent, already percent-encoded (S3 encodes keys once, so the canonical
  // URI is the path itself).
  std::string canonical_uri;
  // Query parameters decoded (name, value); the canonical query string encodes and sorts them.
  std::vector<std::pair<std::string, std::string>> query;
  // Every header to sign, as sent (names in any case; duplicates are joined with ',').
  std::vector<std::pair<std::string, std::string>> headers;
  // Hex SHA-256 of the body (kEmptySha256 for none), or "UNSIGNED-PAYLOAD".
  std::string payload_sha256 = kEmptySha256;
};

// "YYYYMMDDTHHMMSSZ" of a UTC time.
std::string AmzDate(std::time_t t);

// The canonical query string: each name and value UriEncoded (with '/' encoded), sorted by
// name then value, joined as name=value with '&'.
std::string CanonicalQuery(const std::vector<std::pair<std::string, std::string>>& query);

// The canonical request of the SigV4 specification; *signed_headers gets the ';'-joined
// lower-case header names.
std::string CanonicalRequest(const SigV4Request& request, std::string* signed_headers);

// The Authorization header value for `request` signed at amz_date ("YYYYMMDDTHHMMSSZ", which
// must also be the request's x-amz-date header) for region and service.
std::string SigV4Authorization(const SigV4Request& request, const AwsCredentials& credentials,
                               std::string_view region, std::string_view service,
                               std::string_view amz_date);

}  // namespace ferry

#endif  // FERRY_SRC_IO_SIGV4_HPP_
