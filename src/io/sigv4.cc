// SigV4 signing over OpenSSL's SHA-256 and HMAC.
#include "io/sigv4.hpp"

#include <openssl/evp.h>
#include <openssl/hmac.h>

#include <algorithm>
#include <cctype>
#include <map>

#include "io/url.hpp"

namespace ferry {
namespace {

std::string Hex(const unsigned char* p, size_t n) {
  static const char kHex[] = "0123456789abcdef";
  std::string out(2 * n, '0');
  for (size_t i = 0; i < n; ++i) {
    out[2 * i] = kHex[p[i] >> 4];
    out[2 * i + 1] = kHex[p[i] & 15];
  }
  return out;
}

std::string Hmac(std::string_view key, std::string_view data) {
  unsigned char out[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()),
       reinterpret_cast<const unsigned char*>(data.data()), data.size(), out, &len);
  return std::string(reinterpret_cast<const char*>(out), len);
}

std::string Digest(const EVP_MD* md, const void* data, size_t size) {
  unsigned char out[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  EVP_Digest(data, size, out, &len, md, nullptr);
  return std::string(reinterpret_cast<const char*>(out), len);
}

// Header values: leading and trailing spaces trimmed, runs of spaces collapsed to one.
std::string TrimValue(std::string_view v) {
  std::string out;
  bool space = false;
  for (char c : v) {
    if (c == ' ' || c == '\t') {
      space = !out.empty();
      continue;
    }
    if (space) out += ' ';
    space = false;
    out += c;
  }
  return out;
}

}  // namespace

std::string Sha256Hex(const void* data, size_t size) {
  std::string d = Digest(EVP_sha256(), data, size);
  return Hex(reinterpret_cast<const unsigned char*>(d.data()), d.size());
}

std::string Md5Base64(const void* data, size_t size) {
  std::string d = Digest(EVP_md5(), data, size);
  unsigned char out[32];
  int n = EVP_EncodeBlock(out, reinterpret_cast<const unsigned char*>(d.data()),
                          static_cast<int>(d.size()));
  return std::string(reinterpret_cast<const char*>(out), n);
}

std::string AmzDate(std::time_t t) {
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y%m%dT%H%M%SZ", &tm);
  return buf;
}

std::string CanonicalQuery(const std::vector<std::pair<std::string, std::string>>& query) {
  std::vector<std::pair<std::string, std::string>> encoded;
  encoded.reserve(query.size());
  for (const auto& [name, value] : query) {
    encoded.emplace_back(UriEncode(name, false), UriEncode(value, false));
  }
  std::sort(encoded.begin(), encoded.end());
  std::string out;
  for (const auto& [name, value] : encoded) {
    if (!out.empty()) out += '&';
    out += name + "=" + value;
  }
  return out;
}

std::string CanonicalRequest(const SigV4Request& request, std::string* signed_headers) {
  std::map<std::string, std::string> headers;
  for (const auto& [name, value] : request.headers) {
    std::string lower = name;
    for (char& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    std::string& joined = headers[lower];
    if (!joined.empty()) joined += ',';
    joined += TrimValue(value);
  }
  std::string out =
      request.method + "\n" + request.canonical_uri + "\n" + CanonicalQuery(request.query) + "\n";
  signed_headers->clear();
  for (const auto& [name, value] : headers) {
    out += name + ":" + value + "\n";
    if (!signed_headers->empty()) *signed_headers += ';';
    *signed_headers += name;
  }
  out += "\n" + *signed_headers + "\n" + request.payload_sha256;
  return out;
}

std::string SigV4Authorization(const SigV4Request& request, const AwsCredentials& credentials,
                               std::string_view region, std::string_view service,
                               std::string_view amz_date) {
  std::string signed_headers;
  std::string canonical = CanonicalRequest(request, &signed_headers);
  std::string day(amz_date.substr(0, 8));
  std::string scope =
      day + "/" + std::string(region) + "/" + std::string(service) + "/aws4_request";
  std::string to_sign =
      "AWS4-HMAC-SHA256\n" + std::string(amz_date) + "\n" + scope + "\n" + Sha256Hex(canonical);
  std::string key = Hmac("AWS4" + credentials.secret_access_key, day);
  key = Hmac(key, region);
  key = Hmac(key, service);
  key = Hmac(key, "aws4_request");
  std::string mac = Hmac(key, to_sign);
  return "AWS4-HMAC-SHA256 Credential=" + credentials.access_key_id + "/" + scope +
         ", SignedHeaders=" + signed_headers +
         ", Signature=" + Hex(reinterpret_cast<const unsigned char*>(mac.data()), mac.size());
}

}  // namespace ferry
