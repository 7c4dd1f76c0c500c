// URL parsing, percent-encoding and redaction for the remote sources.
#include "io/url.hpp"

#include <arpa/inet.h>

#include <cctype>
#include <cstdint>

#include "base/util.hpp"

namespace ferry {
namespace {

bool StartsWithNoCase(std::string_view s, std::string_view prefix) {
  if (s.size() < prefix.size()) return false;
  for (size_t i = 0; i < prefix.size(); ++i) {
    if (std::tolower(static_cast<unsigned char>(s[i])) != prefix[i]) return false;
  }
  return true;
}

int DefaultPort(const std::string& scheme) { return scheme == "https" ? 443 : 80; }

}  // namespace

std::string HttpUrl::Authority() const {
  std::string out;
  if (host.find(':') != std::string::npos) {
    out.append("[").append(host).append("]");
  } else {
    out = host;
  }
  if (port != 0 && port != DefaultPort(scheme)) out.append(":").append(std::to_string(port));
  return out;
}

std::string HttpUrl::Origin() const { return scheme + "://" + Authority(); }

std::string HttpUrl::ToString() const {
  std::string out = Origin() + path;
  if (!query.empty()) out += "?" + query;
  return out;
}

Result<HttpUrl> ParseHttpUrl(std::string_view url) {
  auto bad = [&](const char* why) {
    return Error(StatusCode::kInvalidArgument, PrintableUrl(std::string(url)),
                 ": not a usable URL (", why, ")");
  };
  HttpUrl out;
  std::string_view rest;
  if (StartsWithNoCase(url, "https://")) {
    out.scheme = "https";
    rest = url.substr(8);
  } else if (StartsWithNoCase(url, "http://")) {
    out.scheme = "http";
    rest = url.substr(7);
  } else {
    return bad("the scheme is not http:// or https://");
  }
  for (unsigned char c : url) {
    if (c <= 0x20 || c == 0x7f) return bad("spaces and control bytes must be percent-encoded");
  }
  size_t end = rest.find_first_of("/?#");
  std::string_view authority = rest.substr(0, end);
  rest = end == std::string_view::npos ? std::string_view() : rest.substr(end);
  if (size_t at = authority.rfind('@'); at != std::string_view::npos) {
    out.has_userinfo = true;
    authority = authority.substr(at + 1);
  }
  std::string_view port_text;
  if (!authority.empty() && authority[0] == '[') {
    size_t close = authority.find(']');
    if (close == std::string_view::npos) return bad("an IPv6 address without its ']'");
    out.host = std::string(authority.substr(1, close - 1));
    std::string_view after = authority.substr(close + 1);
    if (!after.empty()) {
      if (after[0] != ':') return bad("text after the IPv6 address");
      port_text = after.substr(1);
    }
  } else {
    size_t colon = authority.rfind(':');
    out.host = std::string(authority.substr(0, colon));
    if (colon != std::string_view::npos) port_text = authority.substr(colon + 1);
  }
  if (out.host.empty()) return bad("no host");
  for (char& c : out.host) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (!port_text.empty()) {
    int port = 0;
    for (char c : port_text) {
      if (c < '0' || c > '9' || port > 65535) return bad("the port is not a number");
      port = port * 10 + (c - '0');
    }
    if (port < 1 || port > 65535) return bad("the port is out of range");
    out.port = port;
  }
  size_t hash = rest.find('#');
  if (hash != std::string_view::npos) rest = rest.substr(0, hash);
  size_t q = rest.find('?');
  out.path = std::string(rest.substr(0, q));
  if (q != std::string_view::npos) out.query = std::string(rest.substr(q + 1));
  if (out.path.empty()) out.path.push_back('/');
  return out;
}

Result<S3Url> ParseS3Url(std::string_view url) {
  auto bad = [&](const char* why) {
    return Error(StatusCode::kInvalidArgument, PrintableUrl(std::string(url)),
                 ": not a usable S3 URL (", why, "; expected s3://bucket/key)");
  };
  if (!StartsWithNoCase(url, "s3://")) return bad("the scheme is not s3://");
  std::string_view rest = url.substr(5);
  size_t slash = rest.find('/');
  std::string_view bucket = rest.substr(0, slash);
  if (bucket.size() < 3 || bucket.size() > 63) return bad("a bucket name has 3 to 63 characters");
  for (char c : bucket) {
    bool ok = (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '.' || c == '-';
    if (!ok) return bad("a bucket name has lower-case letters, digits, '.' and '-' only");
  }
  if (slash == std::string_view::npos || slash + 1 == rest.size()) return bad("no object key");
  std::string_view key = rest.substr(slash + 1);
  for (unsigned char c : key) {
    if (c == 0) return bad("the key holds a NUL byte");
  }
  return S3Url{std::string(bucket), std::string(key)};
}

bool IsIpOrLocalhost(std::string_view host) {
  if (host == "localhost") return true;
  std::string h(host);
  unsigned char buf[16];
  return inet_pton(AF_INET, h.c_str(), buf) == 1 || inet_pton(AF_INET6, h.c_str(), buf) == 1;
}

std::string UriEncode(std::string_view s, bool keep_slash) {
  static const char kHex[] = "0123456789ABCDEF";
  std::string out;
  out.reserve(s.size());
  for (unsigned char c : s) {
    bool unreserved = std::isalnum(c) || c == '-' || c == '.' || c == '_' || c == '~';
    if (unreserved || (keep_slash && c == '/')) {
      out += static_cast<char>(c);
    } else {
      out += '%';
      out += kHex[c >> 4];
      out += kHex[c & 15];
    }
  }
  return out;
}

std::string SiblingName(const std::string& base, std::string_view relative) {
  const bool http = StartsWithNoCase(base, "http://") || StartsWithNoCase(base, "https://");
  const bool s3 = StartsWithNoCase(base, "s3://");
  if (!http && !s3) {
    size_t slash = base.rfind('/');
    if (slash == std::string::npos) return "./" + std::string(relative);
    return base.substr(0, slash + 1) + std::string(relative);
  }
  std::string_view b = base;
  const size_t authority = b.find("://") + 3;
  if (http) b = b.substr(0, b.find_first_of("?#", authority));
  // The bucket (s3) or host (http) ends the name when no '/' follows it.
  size_t slash = b.rfind('/');
  std::string out(
      b.substr(0, slash == std::string_view::npos || slash < authority ? b.size() : slash));
  out += '/';
  out += http ? UriEncode(relative, true) : std::string(relative);
  return out;
}

std::string PrintableUrl(const std::string& url_text) {
  std::string_view url = url_text;
  size_t scheme_end = url.find("://");
  std::string out;
  std::string_view rest = url;
  if (scheme_end != std::string_view::npos && url.find_first_of("/?#") > scheme_end) {
    out = std::string(url.substr(0, scheme_end + 3));
    rest = url.substr(scheme_end + 3);
    // User information ends at the last '@' before the query; a password holding an
    // unencoded '/' would hide it from a parser that stops at the first '/'.
    std::string_view before_query = rest.substr(0, rest.find_first_of("?#"));
    size_t at = before_query.rfind('@');
    size_t end = rest.find_first_of("/?#");
    if (at != std::string_view::npos &&
        (at < end || before_query.substr(0, at).find(':') != std::string_view::npos)) {
      rest = rest.substr(at + 1);
    }
  }
  size_t cut = rest.find_first_of("?#");
  out += std::string(rest.substr(0, cut));
  return EscapeBytes(out);
}

}  // namespace ferry
