// URLs of remote sources: http(s):// and s3://bucket/key parsed, percent-encoded for requests,
// and redacted for messages. Pure functions, thread-safe.
#ifndef FERRY_SRC_IO_URL_HPP_
#define FERRY_SRC_IO_URL_HPP_

#include <string>
#include <string_view>

#include "ferry/status.hpp"
#include "io/source.hpp"

namespace ferry {

// An http:// or https:// URL, split. The path and query are kept as written (already
// percent-encoded: the server sees exactly what the user wrote).
struct HttpUrl {
  std::string scheme;  // "http" or "https", lower case
  std::string host;    // a name, an IPv4 address, or an IPv6 address without brackets
  int port = 0;        // 0: the scheme's default
  std::string path;    // starts with '/'
  std::string query;   // without the '?'; empty when absent
  bool has_userinfo = false;

  // host[:port], IPv6 in brackets, the port only when it is not the scheme's default: the
  // Host header a client sends for this URL.
  std::string Authority() const;
  // scheme://authority
  std::string Origin() const;
  // The URL as sent, without user information (credentials go in headers, never in URLs).
  std::string ToString() const;
};

// InvalidArgument, naming the redacted URL, for anything that is not an absolute http(s) URL
// with a host; control bytes and spaces must be percent-encoded.
Result<HttpUrl> ParseHttpUrl(std::string_view url);

// s3://bucket/key. The key is taken literally (as the AWS CLI does: "%20" is three
// characters of the key) and percent-encoded when a request is built.
struct S3Url {
  std::string bucket;
  std::string key;
};
// InvalidArgument for a missing or invalid bucket name (3-63 characters: lower-case letters,
// digits, '.', '-'), or an empty key.
Result<S3Url> ParseS3Url(std::string_view url);

// True for a host that is an IPv4 or IPv6 literal, or "localhost".
bool IsIpOrLocalhost(std::string_view host);

// RFC 3986 percent-encoding as SigV4 wants it: unreserved characters (A-Z a-z 0-9 - . _ ~)
// kept, every other byte as %XX in upper-case hex; '/' kept when keep_slash.
std::string UriEncode(std::string_view s, bool keep_slash);

// What `relative` names beside `base`, for the shards an index lists: `relative` is a plain
// relative path (no empty, "." or ".." component: checked by the caller). A local path gets a
// sibling in its directory ("./" prefixed when it has none); an s3:// object a key with the
// same prefix (taken literally, as keys are); an http(s):// URL the same path level, the
// relative part percent-encoded ('/' kept) and the query and fragment dropped (a presigned
// URL's signature covers its own object only).
std::string SiblingName(const std::string& base, std::string_view relative);

// PrintableUrl (source.hpp) is the URL as messages print it: no user information, query
// string or fragment, control bytes escaped; defined in url.cc.

}  // namespace ferry

#endif  // FERRY_SRC_IO_URL_HPP_
