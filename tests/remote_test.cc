// Remote sources and the S3 sink against real servers on 127.0.0.1 (tests/servers/servers.py:
// nginx over HTTP and HTTPS, moto's S3 server with signature checking, a fault-injecting
// server; found as servers/test_servers.hpp says), plus URL parsing, SigV4 against the AWS
// test-suite vectors, and the AWS settings precedence.
#include "io/remote.hpp"

#include <fcntl.h>
#include <openssl/evp.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>

#include "base/util.hpp"
#include "ferry/ferry.hpp"
#include "gtest/gtest.h"
#include "io/aws_config.hpp"
#include "io/http_client.hpp"
#include "io/remote_sink.hpp"
#include "io/remote_source.hpp"
#include "io/s3.hpp"
#include "io/sigv4.hpp"
#include "io/url.hpp"
#include "servers/test_servers.hpp"
#include "test_util.hpp"

namespace ferry {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

std::string Md5Hex(const std::vector<uint8_t>& bytes) {
  unsigned char d[EVP_MAX_MD_SIZE];
  unsigned int n = 0;
  EVP_Digest(bytes.data(), bytes.size(), d, &n, EVP_md5(), nullptr);
  std::string out;
  for (unsigned int i = 0; i < n; ++i)
    out += StrCat(std::hex, std::setw(2), std::setfill('0'), int{d[i]});
  return out;
}

// Reads the whole source in one call and, separately, in many ranges (some in the tail).
void ExpectSameBytes(const ByteSource& src, const std::vector<uint8_t>& expect) {
  ASSERT_EQ(src.size(), expect.size());
  std::vector<uint8_t> whole(expect.size());
  ASSERT_TRUE(src.ReadAt(0, whole.size(), whole.data()).ok());
  EXPECT_TRUE(whole == expect);
  if (expect.empty()) return;
  std::mt19937_64 rng(7);
  std::vector<std::vector<uint8_t>> bufs;
  std::vector<ReadRange> ranges;
  for (int i = 0; i < 40; ++i) {
    uint64_t off = rng() % expect.size();
    uint64_t len = 1 + rng() % std::min<uint64_t>(expect.size() - off, 3 << 20);
    if (i % 4 == 0) {  // the last bytes, from the opening request
      len = 1 + rng() % std::min<uint64_t>(expect.size(), 1000);
      off = expect.size() - len;
    }
    bufs.emplace_back(len);
    ranges.push_back({off, len, bufs.back().data()});
  }
  ASSERT_TRUE(src.ReadRanges(ranges).ok());
  for (size_t i = 0; i < ranges.size(); ++i) {
    EXPECT_EQ(0, memcmp(bufs[i].data(), expect.data() + ranges[i].offset, ranges[i].len))
        << "range " << i << " at " << ranges[i].offset;
  }
}

// ---- URLs ----------------------------------------------------------------------------------

TEST(UrlTest, ParsesHttpUrls) {
  auto u = ParseHttpUrl("HTTPS://Example.COM:8443/a/b%20c?x=1#frag");
  ASSERT_TRUE(u.ok()) << u.status().ToString();
  EXPECT_EQ(u->scheme, "https");
  EXPECT_EQ(u->host, "example.com");
  EXPECT_EQ(u->port, 8443);
  EXPECT_EQ(u->path, "/a/b%20c");
  EXPECT_EQ(u->query, "x=1");
  EXPECT_EQ(u->ToString(), "https://example.com:8443/a/b%20c?x=1");
  EXPECT_EQ(ParseHttpUrl("http://h:80")->Authority(), "h");
  EXPECT_EQ(ParseHttpUrl("http://h:80")->path, "/");
  auto v6 = ParseHttpUrl("http://[::1]:9000/k");
  ASSERT_TRUE(v6.ok());
  EXPECT_EQ(v6->host, "::1");
  EXPECT_EQ(v6->Authority(), "[::1]:9000");
  EXPECT_TRUE(ParseHttpUrl("http://u:p@h/x")->has_userinfo);
}

TEST(UrlTest, RejectsUnusableUrls) {
  EXPECT_EQ(ParseHttpUrl("ftp://x/y").status().ToString(),
            "InvalidArgument: ftp://x/y: not a usable URL (the scheme is not http:// or https://)");
  EXPECT_EQ(ParseHttpUrl("http:///x").status().ToString(),
            "InvalidArgument: http:///x: not a usable URL (no host)");
  EXPECT_EQ(ParseHttpUrl("http://h:99999/").status().ToString(),
            "InvalidArgument: http://h:99999/: not a usable URL (the port is out of range)");
  EXPECT_EQ(ParseHttpUrl("http://h/a b").status().ToString(),
            "InvalidArgument: http://h/a b: not a usable URL (spaces and control bytes must be "
            "percent-encoded)");
  EXPECT_EQ(ParseHttpUrl("http://u:secret@h/a\n").status().ToString(),
            "InvalidArgument: http://h/a\\x0a: not a usable URL (spaces and control bytes must "
            "be percent-encoded)");
}

TEST(UrlTest, ParsesS3Urls) {
  auto u = ParseS3Url("s3://my-bucket.v2/dir/a b+c.bin");
  ASSERT_TRUE(u.ok());
  EXPECT_EQ(u->bucket, "my-bucket.v2");
  EXPECT_EQ(u->key, "dir/a b+c.bin");
  EXPECT_EQ(ParseS3Url("s3://Bucket/k").status().ToString(),
            "InvalidArgument: s3://Bucket/k: not a usable S3 URL (a bucket name has lower-case "
            "letters, digits, '.' and '-' only; expected s3://bucket/key)");
  EXPECT_EQ(ParseS3Url("s3://bucket").status().ToString(),
            "InvalidArgument: s3://bucket: not a usable S3 URL (no object key; expected "
            "s3://bucket/key)");
  EXPECT_FALSE(ParseS3Url("s3://bucket/").ok());
  EXPECT_FALSE(ParseS3Url("s3://ab/k").ok());
}

TEST(UrlTest, EncodesAndRedacts) {
  EXPECT_EQ(UriEncode("a b/\xc3\xa9+~-._", true), "a%20b/%C3%A9%2B~-._");
  EXPECT_EQ(UriEncode("a/b", false), "a%2Fb");
  EXPECT_EQ(PrintableUrl("https://user:pass@host:1/p?X-Amz-Signature=abc&X-Amz-Credential=def"),
            "https://host:1/p");
  EXPECT_EQ(PrintableUrl("http://host/p#frag"), "http://host/p");
  EXPECT_EQ(PrintableUrl("not a url?token=1"), "not a url");
  EXPECT_EQ(PrintableUrl("http://u:pa/ss@host/p"), "http://host/p");
  EXPECT_EQ(PrintableUrl("http://host/a@b"), "http://host/a@b");
  EXPECT_TRUE(IsIpOrLocalhost("127.0.0.1"));
  EXPECT_TRUE(IsIpOrLocalhost("::1"));
  EXPECT_TRUE(IsIpOrLocalhost("localhost"));
  EXPECT_FALSE(IsIpOrLocalhost("s3.amazonaws.com"));
}

// ---- SigV4 ---------------------------------------------------------------------------------

// The AWS Signature Version 4 test suite (service "service", us-east-1, 2015-08-30T12:36:00Z,
// key AKIDEXAMPLE), as its requests and expected Authorization headers are published.
struct Vector {
  const char* name;
  const char* method;
  const char* uri;
  std::vector<std::pair<std::string, std::string>> query;
  std::vector<std::pair<std::string, std::string>> headers;  // besides host and x-amz-date
  const char* body;
  const char* signed_headers;
  const char* signature;
};

const char kStsToken[] =
    "AQoDYXdzEPT//////////wEXAMPLEtc764bNrC9SAPBSM22wDOk4x4HIZ8j4FZTwdQWLWsKWHGBuFqwAeMicRXmxf"
    "pSPfIeoIYRqTflfKD8YUuwthAx7mSEI/qkPpKPi/kMcGdQrmGdeehM4IC1NtBmUpp2wUE8phUZampKsburEDy0KP"
    "kyQDYwT7WZ0wq5VSXDvp75YU9HFvlRd8Tx6q6fE8YQcHNVXAkiY9q6d+xo0rKwT38xVqr7ZD0u0iPPkUL64lIZbq"
    "BAz+scqKmlzm8FDrypNC9Yjc8fPOLn9FX9KSYvKTr4rvx3iSIlTJabIQwj2ICCR/oLxBA==";

const std::vector<Vector>& Vectors() {
  static const std::vector<Vector> v = {
      {"get-vanilla",
       "GET",
       "/",
       {},
       {},
       "",
       "host;x-amz-date",
       "5fa00fa31553b73ebf1942676e86291e8372ff2a2260956d9b8aae1d763fbf31"},
      {"get-vanilla-empty-query-key",
       "GET",
       "/",
       {{"Param1", "value1"}},
       {},
       "",
       "host;x-amz-date",
       "a67d582fa61cc504c4bae71f336f98b97f1ea3c7a6bfe1b6e45aec72011b9aeb"},
      {"get-vanilla-query-order-key-case",
       "GET",
       "/",
       {{"Param2", "value2"}, {"Param1", "value1"}},
       {},
       "",
       "host;x-amz-date",
       "b97d918cfa904a5beff61c982a1b6f458b799221646efd99d3219ec94cdf2500"},
      {"get-vanilla-query-order-key",
       "GET",
       "/",
       {{"Param1", "value2"}, {"Param1", "Value1"}},
       {},
       "",
       "host;x-amz-date",
       "eedbc4e291e521cf13422ffca22be7d2eb8146eecf653089df300a15b2382bd1"},
      {"get-vanilla-query-order-value",
       "GET",
       "/",
       {{"Param1", "value2"}, {"Param1", "value1"}},
       {},
       "",
       "host;x-amz-date",
       "5772eed61e12b33fae39ee5e7012498b51d56abc0abb7c60486157bd471c4694"},
      {"get-vanilla-query-unreserved",
       "GET",
       "/",
       {{"-._~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz",
         "-._~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"}},
       {},
       "",
       "host;x-amz-date",
       "9c3e54bfcdf0b19771a7f523ee5669cdf59bc7cc0884027167c21bb143a40197"},
      {"get-vanilla-utf8-query",
       "GET",
       "/",
       {{"\xe1\x88\xb4", "bar"}},
       {},
       "",
       "host;x-amz-date",
       "2cdec8eed098649ff3a119c94853b13c643bcf08f8b0a1d91e12c9027818dd04"},
      {"get-unreserved",
       "GET",
       "/-._~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz",
       {},
       {},
       "",
       "host;x-amz-date",
       "07ef7494c76fa4850883e2b006601f940f8a34d404d0cfa977f52a65bbf5f24f"},
      {"get-utf8",
       "GET",
       "/%E1%88%B4",
       {},
       {},
       "",
       "host;x-amz-date",
       "8318018e0b0f223aa2bbf98705b62bb787dc9c0e678f255a891fd03141be5d85"},
      {"get-header-key-duplicate",
       "GET",
       "/",
       {},
       {{"My-Header1", "value2"}, {"My-Header1", "value2"}, {"My-Header1", "value1"}},
       "",
       "host;my-header1;x-amz-date",
       "c9d5ea9f3f72853aea855b47ea873832890dbdd183b4468f858259531a5138ea"},
      {"get-header-value-order",
       "GET",
       "/",
       {},
       {{"My-Header1", "value4"},
        {"My-Header1", "value1"},
        {"My-Header1", "value3"},
        {"My-Header1", "value2"}},
       "",
       "host;my-header1;x-amz-date",
       "08c7e5a9acfcfeb3ab6b2185e75ce8b1deb5e634ec47601a50643f830c755c01"},
      {"get-header-value-trim",
       "GET",
       "/",
       {},
       {{"My-Header1", " value1"}, {"My-Header2", " \"a   b   c\""}},
       "",
       "host;my-header1;my-header2;x-amz-date",
       "acc3ed3afb60bb290fc8d2dd0098b9911fcaa05412b367055dee359757a9c736"},
      {"post-vanilla",
       "POST",
       "/",
       {},
       {},
       "",
       "host;x-amz-date",
       "5da7c1a2acd57cee7505fc6676e4e544621c30862966e37dddb68e92efbe5d6b"},
      {"post-vanilla-query",
       "POST",
       "/",
       {{"Param1", "value1"}},
       {},
       "",
       "host;x-amz-date",
       "28038455d6de14eafc1f9222cf5aa6f1a96197d7deb8263271d420d138af7f11"},
      {"post-vanilla-query-nonunreserved",
       "POST",
       "/",
       {{"@#$%^", ""}, {"+", "/,?><`\";:\\|][{}"}},
       {},
       "",
       "host;x-amz-date",
       "66c82657c86e26fb25238d0e69f011edc4c6df5ae71119d7cb98ed9b87393c1e"},
      {"post-vanilla-query-space",
       "POST",
       "/",
       {{"p", ""}},
       {},
       "",
       "host;x-amz-date",
       "e71688addb58a26418614085fb730ba3faa623b461c17f48f2fbdb9361b94a9b"},
      {"post-header-key-sort",
       "POST",
       "/",
       {},
       {{"My-Header1", "value1"}},
       "",
       "host;my-header1;x-amz-date",
       "c5410059b04c1ee005303aed430f6e6645f61f4dc9e1461ec8f8916fdf18852c"},
      {"post-header-value-case",
       "POST",
       "/",
       {},
       {{"My-Header1", "VALUE1"}},
       "",
       "host;my-header1;x-amz-date",
       "cdbc9802e29d2942e5e10b5bccfdd67c5f22c7c4e8ae67b53629efa58b974b7d"},
      {"post-x-www-form-urlencoded",
       "POST",
       "/",
       {},
       {{"Content-Type", "application/x-www-form-urlencoded"}},
       "Param1=value1",
       "content-type;host;x-amz-date",
       "ff11897932ad3f4e8b18135d722051e5ac45fc38421b1da7b9d196a0fe09473a"},
      {"post-x-www-form-urlencoded-parameters",
       "POST",
       "/",
       {},
       {{"Content-Type", "application/x-www-form-urlencoded; charset=utf8"}},
       "Param1=value1",
       "content-type;host;x-amz-date",
       "1a72ec8f64bd914b0e42e42607c7fbce7fb2c7465f63e3092b3b0d39fa77a6fe"},
      {"post-sts-header-before",
       "POST",
       "/",
       {},
       {{"X-Amz-Security-Token", kStsToken}},
       "",
       "host;x-amz-date;x-amz-security-token",
       "85d96828115b5dc0cfc3bd16ad9e210dd772bbebba041836c64533a82be05ead"},
  };
  return v;
}

TEST(SigV4Test, AwsTestSuiteVectors) {
  AwsCredentials creds{"AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY", ""};
  for (const Vector& v : Vectors()) {
    SigV4Request req;
    req.method = v.method;
    req.canonical_uri = v.uri;
    req.query = v.query;
    req.headers = {{"Host", "example.amazonaws.com"}, {"X-Amz-Date", "20150830T123600Z"}};
    for (const auto& h : v.headers) req.headers.push_back(h);
    req.payload_sha256 = Sha256Hex(std::string_view(v.body));
    EXPECT_EQ(SigV4Authorization(req, creds, "us-east-1", "service", "20150830T123600Z"),
              std::string("AWS4-HMAC-SHA256 Credential=AKIDEXAMPLE/20150830/us-east-1/service/"
                          "aws4_request, SignedHeaders=") +
                  v.signed_headers + ", Signature=" + v.signature)
        << v.name;
  }
}

TEST(SigV4Test, CanonicalRequestOfTheSuite) {
  SigV4Request req;
  req.method = "GET";
  req.canonical_uri = "/";
  req.query = {{"Param2", "value2"}, {"Param1", "value1"}};
  req.headers = {{"Host", "example.amazonaws.com"},
                 {"X-Amz-Date", "20150830T123600Z"},
                 {"My-Header2", "  \"a   b   c\"  "}};
  std::string signed_headers;
  EXPECT_EQ(CanonicalRequest(req, &signed_headers),
            "GET\n/\nParam1=value1&Param2=value2\nhost:example.amazonaws.com\n"
            "my-header2:\"a b c\"\nx-amz-date:20150830T123600Z\n\nhost;my-header2;x-amz-date\n"
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(signed_headers, "host;my-header2;x-amz-date");
}

// The S3 documentation's "GET Object" example (a range of examplebucket/test.txt).
TEST(SigV4Test, S3GetObjectExample) {
  SigV4Request req;
  req.method = "GET";
  req.canonical_uri = "/test.txt";
  req.headers = {{"Host", "examplebucket.s3.amazonaws.com"},
                 {"Range", "bytes=0-9"},
                 {"x-amz-content-sha256", kEmptySha256},
                 {"x-amz-date", "20130524T000000Z"}};
  AwsCredentials creds{"AKIAIOSFODNN7EXAMPLE", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY", ""};
  EXPECT_EQ(SigV4Authorization(req, creds, "us-east-1", "s3", "20130524T000000Z"),
            "AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/20130524/us-east-1/s3/aws4_request, "
            "SignedHeaders=host;range;x-amz-content-sha256;x-amz-date, "
            "Signature=f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41");
}

TEST(SigV4Test, DigestsAndDates) {
  EXPECT_EQ(Sha256Hex(std::string_view("")), kEmptySha256);
  EXPECT_EQ(Sha256Hex(std::string_view("abc")),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(Md5Base64("", 0), "1B2M2Y8AsgTpgAmY7PhCfg==");
  EXPECT_EQ(AmzDate(1440938160), "20150830T123600Z");
}

// ---- AWS settings --------------------------------------------------------------------------

class AwsSettingsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("ferry_aws_" + std::to_string(getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::create_directories(dir_ / ".aws");
    env_["HOME"] = dir_.string();
  }
  void TearDown() override { fs::remove_all(dir_); }

  void Write(const std::string& rel, const std::string& text) { std::ofstream(dir_ / rel) << text; }
  Result<AwsSettings> Resolve() {
    return ResolveAwsSettings([this](const std::string& n) -> std::optional<std::string> {
      auto it = env_.find(n);
      if (it == env_.end()) return std::nullopt;
      return it->second;
    });
  }

  fs::path dir_;
  std::map<std::string, std::string> env_;
};

TEST_F(AwsSettingsTest, EnvironmentBeatsFilesAndFilesFollowTheProfile) {
  Write(".aws/credentials",
        "[default]\naws_access_key_id = FILEKEY\naws_secret_access_key = filesecret\n"
        "[dev]\naws_access_key_id=DEVKEY\naws_secret_access_key=devsecret\n"
        "aws_session_token=devtoken\n");
  Write(".aws/config",
        "[default]\nregion = eu-west-1\n[profile dev]\nregion = ap-south-1\n"
        "s3 =\n  addressing_style = path\n  endpoint_url = http://127.0.0.1:9\n");
  auto s = Resolve();
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  EXPECT_EQ(s->credentials.access_key_id, "FILEKEY");
  EXPECT_EQ(s->credentials_source, "shared credentials file");
  EXPECT_EQ(s->region, "eu-west-1");
  EXPECT_EQ(s->addressing_style, "auto");
  EXPECT_EQ(s->endpoint, "");

  env_["AWS_PROFILE"] = "dev";
  s = Resolve();
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->credentials.access_key_id, "DEVKEY");
  EXPECT_EQ(s->credentials.session_token, "devtoken");
  EXPECT_EQ(s->region, "ap-south-1");
  EXPECT_EQ(s->addressing_style, "path");
  EXPECT_EQ(s->endpoint, "http://127.0.0.1:9");

  env_["AWS_ACCESS_KEY_ID"] = "ENVKEY";
  env_["AWS_SECRET_ACCESS_KEY"] = "envsecret";
  env_["AWS_DEFAULT_REGION"] = "us-west-1";
  env_["AWS_ENDPOINT_URL"] = "http://generic:1";
  env_["AWS_S3_ADDRESSING_STYLE"] = "virtual";
  s = Resolve();
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->credentials.access_key_id, "ENVKEY");
  EXPECT_EQ(s->credentials.session_token, "");
  EXPECT_EQ(s->credentials_source, "environment");
  EXPECT_EQ(s->region, "us-west-1");
  EXPECT_EQ(s->endpoint, "http://generic:1");
  EXPECT_EQ(s->addressing_style, "virtual");

  env_["AWS_REGION"] = "us-west-2";
  env_["AWS_ENDPOINT_URL_S3"] = "http://s3only:2";
  s = Resolve();
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->region, "us-west-2");
  EXPECT_EQ(s->endpoint, "http://s3only:2");
}

TEST_F(AwsSettingsTest, ConfigFileKeysExplicitFilesAndNoCredentials) {
  auto s = Resolve();
  ASSERT_TRUE(s.ok());
  EXPECT_TRUE(s->credentials.empty());
  EXPECT_EQ(s->credentials_source, "none");
  EXPECT_EQ(s->region, "us-east-1");

  Write("other_config",
        "# comment\n[profile ci]\naws_access_key_id = CFGKEY\naws_secret_access_key = c\n"
        "endpoint_url = http://e:3\nca_bundle = /ca.pem\n");
  env_["AWS_CONFIG_FILE"] = (dir_ / "other_config").string();
  env_["AWS_PROFILE"] = "ci";
  s = Resolve();
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->credentials.access_key_id, "CFGKEY");
  EXPECT_EQ(s->credentials_source, "config file");
  EXPECT_EQ(s->endpoint, "http://e:3");
  EXPECT_EQ(s->ca_bundle, "/ca.pem");

  Write("creds", "[ci]\naws_access_key_id = CREDKEY\naws_secret_access_key = d\n");
  env_["AWS_SHARED_CREDENTIALS_FILE"] = (dir_ / "creds").string();
  s = Resolve();
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->credentials.access_key_id, "CREDKEY");
}

TEST_F(AwsSettingsTest, MistakesAreNamed) {
  env_["AWS_PROFILE"] = "nope";
  EXPECT_EQ(Resolve().status().ToString(),
            "NotFound: AWS profile 'nope' (AWS_PROFILE) is in neither " +
                (dir_ / ".aws/credentials").string() + " nor " + (dir_ / ".aws/config").string());
  env_.erase("AWS_PROFILE");
  env_["AWS_S3_ADDRESSING_STYLE"] = "sideways";
  EXPECT_EQ(Resolve().status().ToString(),
            "InvalidArgument: AWS_S3_ADDRESSING_STYLE is 'sideways'; expected path, virtual or "
            "auto");
}

TEST(S3AddressTest, PathStyleForLocalEndpointsVirtualForAws) {
  AwsSettings aws;
  aws.region = "eu-west-1";
  auto o = ResolveS3Object(*ParseS3Url("s3://ferry/dir/a b.bin"), aws);
  ASSERT_TRUE(o.ok());
  EXPECT_FALSE(o->path_style);
  EXPECT_EQ(S3RequestUrl(*o, {}), "https://ferry.s3.eu-west-1.amazonaws.com/dir/a%20b.bin");
  EXPECT_EQ(S3RequestUrl(*o, {{"uploadId", "a/b"}, {"partNumber", "2"}}),
            "https://ferry.s3.eu-west-1.amazonaws.com/dir/a%20b.bin?partNumber=2&uploadId=a%2Fb");
  EXPECT_EQ(o->Name(), "s3://ferry/dir/a b.bin");
  // Dots in the bucket: path-style (TLS names), unless virtual is forced, which is refused.
  EXPECT_EQ(S3RequestUrl(*ResolveS3Object(*ParseS3Url("s3://a.b/k"), aws), {}),
            "https://s3.eu-west-1.amazonaws.com/a.b/k");
  for (const char* ep : {"http://127.0.0.1:9000", "http://localhost:9000/", "http://[::1]:1"}) {
    aws.endpoint = ep;
    EXPECT_TRUE(ResolveS3Object(*ParseS3Url("s3://ferry/k"), aws)->path_style) << ep;
  }
  aws.endpoint = "https://storage.example.com/prefix";
  EXPECT_EQ(S3RequestUrl(*ResolveS3Object(*ParseS3Url("s3://ferry/k"), aws), {}),
            "https://ferry.storage.example.com/prefix/k");
  aws.addressing_style = "path";
  EXPECT_EQ(S3RequestUrl(*ResolveS3Object(*ParseS3Url("s3://ferry/k"), aws), {}),
            "https://storage.example.com/prefix/ferry/k");
  aws.addressing_style = "virtual";
  EXPECT_EQ(ResolveS3Object(*ParseS3Url("s3://a.b/k"), aws).status().ToString(),
            "InvalidArgument: s3://a.b: a bucket name with dots cannot be addressed "
            "virtual-hosted over https; use path-style addressing (AWS_S3_ADDRESSING_STYLE=path)");
  aws.endpoint = "ftp://x";
  EXPECT_EQ(ResolveS3Object(*ParseS3Url("s3://ferry/k"), aws).status().ToString(),
            "InvalidArgument: the S3 endpoint ftp://x is not an http(s) URL");
}

TEST(S3AddressTest, SignsWithSessionTokenOrNotAtAll) {
  AwsSettings aws;
  aws.endpoint = "http://127.0.0.1:9000";
  auto o = ResolveS3Object(*ParseS3Url("s3://ferry/k"), aws);
  std::vector<std::string> headers;
  S3Authorize(aws, *o, "GET", {}, kEmptySha256, 1440938160, &headers);
  EXPECT_EQ(headers, std::vector<std::string>{"Host: 127.0.0.1:9000"});
  aws.credentials = {"AKID", "SECRETKEY", "TOKEN"};
  headers.clear();
  S3Authorize(aws, *o, "GET", {}, kEmptySha256, 1440938160, &headers);
  ASSERT_EQ(headers.size(), 5u);
  EXPECT_EQ(headers[1], std::string("x-amz-content-sha256: ") + kEmptySha256);
  EXPECT_EQ(headers[2], "x-amz-date: 20150830T123600Z");
  EXPECT_EQ(headers[3], "x-amz-security-token: TOKEN");
  EXPECT_EQ(headers[4].rfind("Authorization: AWS4-HMAC-SHA256 Credential=AKID/20150830/us-east-1/"
                             "s3/aws4_request, SignedHeaders=host;x-amz-content-sha256;"
                             "x-amz-date;x-amz-security-token, Signature=",
                             0),
            0u)
      << headers[4];
  for (const std::string& h : headers) EXPECT_EQ(h.find("SECRETKEY"), std::string::npos);
}

// ---- HTTP and HTTPS through nginx ----------------------------------------------------------

RemoteOptions SmallPieces() {
  RemoteOptions o;
  o.piece_bytes = 1 << 20;  // several GETs per read, all in flight together
  return o;
}

TEST(HttpSourceTest, ReadsEqualTheFilesOverHttp) {
  REQUIRE_SERVER("nginx");
  for (const auto& [name, size] : Servers().info["seed"].items()) {
    std::string url = Info("http") + "/" + UriEncode(name, true);
    auto src = OpenHttpSource(url, SmallPieces());
    ASSERT_TRUE(src.ok()) << src.status().ToString();
    EXPECT_EQ((*src)->name(), url);
    EXPECT_EQ((*src)->size(), size.get<uint64_t>());
    EXPECT_EQ((*src)->mapping(), nullptr);
    ExpectSameBytes(**src, DiskBytes(name));
  }
}

TEST(HttpSourceTest, ReadsEqualTheFilesOverHttpsWithTheTestCa) {
  REQUIRE_SERVER("nginx");
  RemoteOptions o = SmallPieces();
  o.http.ca_bundle = Info("ca");
  for (const char* name : {"seed/large.bin", "seed/small.bin", "seed/empty.bin"}) {
    auto src = OpenHttpSource(Info("https") + "/" + name, o);
    ASSERT_TRUE(src.ok()) << src.status().ToString();
    EXPECT_EQ((*src)->Describe().rfind("HTTPS range GETs, 8 in flight, 1 MiB each, ETag \"", 0), 0u)
        << (*src)->Describe();
    ExpectSameBytes(**src, DiskBytes(name));
  }
}

TEST(HttpSourceTest, HttpsVerifiesTheServer) {
  REQUIRE_SERVER("nginx");
  RemoteOptions o;
  o.http.ca_bundle = "/etc/ssl/certs/ca-certificates.crt";
  std::string url = Info("https") + "/seed/small.bin";
  auto src = OpenHttpSource(url, o);
  ASSERT_FALSE(src.ok());
  EXPECT_EQ(src.status().code(), StatusCode::kIoError);
  EXPECT_EQ(src.status().message().rfind(url + ": SSL certificate problem", 0), 0u)
      << src.status().message();
}

TEST(HttpSourceTest, OpenRemoteSourceTakesTheCaBundleFromTheEnvironment) {
  REQUIRE_SERVER("nginx");
  setenv("CURL_CA_BUNDLE", Info("ca").c_str(), 1);
  auto src = OpenRemoteSource(Info("https") + "/seed/small.bin", SourceOptions());
  unsetenv("CURL_CA_BUNDLE");
  ASSERT_TRUE(src.ok()) << src.status().ToString();
  ExpectSameBytes(**src, DiskBytes("seed/small.bin"));
}

TEST(HttpSourceTest, MissingObjectsAndReadsPastTheEnd) {
  REQUIRE_SERVER("nginx");
  std::string url = Info("http") + "/seed/nope.bin";
  EXPECT_EQ(OpenHttpSource(url, RemoteOptions()).status().ToString(),
            "NotFound: " + url + ": no such object (HTTP 404)");
  EXPECT_EQ(OpenHttpSource(url + "?X-Amz-Signature=s3cr3t", RemoteOptions()).status().ToString(),
            "NotFound: " + url + ": no such object (HTTP 404)");
  auto src = OpenHttpSource(Info("http") + "/seed/small.bin", RemoteOptions());
  ASSERT_TRUE(src.ok());
  uint8_t b[16];
  EXPECT_EQ((*src)->ReadAt(99990, 16, b).ToString(),
            "DataLoss: " + Info("http") +
                "/seed/small.bin at offset 99990 (16 bytes): past the end of the object (100000 "
                "bytes)");
  EXPECT_EQ(OpenHttpSource("http://user:pw@127.0.0.1:1/x", RemoteOptions()).status().ToString(),
            "InvalidArgument: http://127.0.0.1:1/x: user information in URLs is not supported "
            "(credentials would be logged)");
  EXPECT_EQ(OpenRemoteSource("ftp://h/x", SourceOptions()).status().ToString(),
            "InvalidArgument: ftp://h/x: not a usable URL (the scheme is not http:// or "
            "https://)");
  // Through OpenSource, as every reader opens a name; schemes in any case.
  auto upper = OpenSource("HTTP" + Info("http").substr(4) + "/seed/small.bin");
  ASSERT_TRUE(upper.ok()) << upper.status().ToString();
  EXPECT_EQ((*upper)->size(), 100000u);
}

TEST(HttpSourceTest, ConcurrentReadersShareOneSource) {
  REQUIRE_SERVER("nginx");
  auto src = OpenHttpSource(Info("http") + "/seed/large.bin", SmallPieces());
  ASSERT_TRUE(src.ok());
  std::vector<uint8_t> expect = DiskBytes("seed/large.bin");
  std::atomic<int> bad{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 5; ++i) {
        uint64_t off = (uint64_t(t) * 5 + i) * 300007 % (expect.size() - 2500000);
        std::vector<uint8_t> buf(2500000);
        if (!(*src)->ReadAt(off, buf.size(), buf.data()).ok() ||
            memcmp(buf.data(), expect.data() + off, buf.size()) != 0) {
          ++bad;
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(bad.load(), 0);
}

// ---- S3 through moto -----------------------------------------------------------------------

TEST(S3SourceTest, SignedPathStyleReadsEqualTheFiles) {
  REQUIRE_SERVER("moto");
  for (const auto& [name, size] : Servers().info["seed"].items()) {
    auto src = OpenS3Source(S3Url(name), MotoSettings(), SmallPieces());
    ASSERT_TRUE(src.ok()) << src.status().ToString();
    EXPECT_EQ((*src)->name(), S3Url(name));
    // moto's ETag of an object put whole: the MD5 of its bytes.
    std::vector<uint8_t> bytes = DiskBytes(name);
    EXPECT_EQ((*src)->Describe(),
              "S3 range GETs (SigV4, credentials from environment, path-style, " +
                  Servers().info["s3"]["endpoint"].get<std::string>() +
                  "), 8 in flight, 1 MiB each, ETag \"" + Md5Hex(bytes) + "\" pinned");
    ExpectSameBytes(**src, DiskBytes(name));
  }
}

TEST(S3SourceTest, OpenRemoteSourceUsesTheAwsEnvironment) {
  REQUIRE_SERVER("moto");
  AwsSettings aws = MotoSettings();
  ScopedEnv env;
  env.Set("HOME", "/nonexistent");
  env.Set("AWS_ACCESS_KEY_ID", aws.credentials.access_key_id);
  env.Set("AWS_SECRET_ACCESS_KEY", aws.credentials.secret_access_key);
  env.Set("AWS_REGION", aws.region);
  env.Set("AWS_ENDPOINT_URL_S3", aws.endpoint);
  auto src = OpenRemoteSource(S3Url("seed/large.bin"), SourceOptions());
  ASSERT_TRUE(src.ok()) << src.status().ToString();
  ExpectSameBytes(**src, DiskBytes("seed/large.bin"));
}

TEST(S3SourceTest, ErrorsNameTheObjectAndNeverTheSecret) {
  REQUIRE_SERVER("moto");
  EXPECT_EQ(OpenS3Source(S3Url("seed/nope.bin"), MotoSettings(), {}).status().ToString(),
            "NotFound: " + S3Url("seed/nope.bin") + ": no such object (HTTP 404 NoSuchKey)");
  AwsSettings wrong = MotoSettings();
  wrong.credentials.secret_access_key = "NotTheSecretButStillSecret/abc";
  wrong.credentials.session_token = "SessionTokenValue123";
  auto bad = OpenS3Source(S3Url("seed/small.bin"), wrong, {});
  EXPECT_EQ(bad.status().ToString(),
            "IoError: " + S3Url("seed/small.bin") + ": HTTP 400 InvalidToken");
  wrong.credentials.session_token.clear();
  bad = OpenS3Source(S3Url("seed/small.bin"), wrong, {});
  EXPECT_EQ(bad.status().ToString(), "IoError: " + S3Url("seed/small.bin") +
                                         ": access denied (HTTP 403 SignatureDoesNotMatch)");
  AwsSettings anonymous = MotoSettings();
  anonymous.credentials = {};
  EXPECT_EQ(OpenS3Source(S3Url("seed/small.bin"), anonymous, {}).status().code(),
            StatusCode::kIoError);
}

TEST(S3SourceTest, AnObjectReplacedWhileOpenIsDataLoss) {
  REQUIRE_SERVER("moto");
  std::string url = S3Url("replaced/" + TestName());
  std::vector<uint8_t> v1(300000, 1), v2(300000, 2);
  for (const auto* v : {&v1}) {
    auto sink = OpenS3Sink(url, MotoSettings(), {});
    ASSERT_TRUE(sink.ok());
    ASSERT_TRUE((*sink)->Append(v->data(), v->size()).ok());
    ASSERT_TRUE((*sink)->Commit().ok());
  }
  auto src = OpenS3Source(url, MotoSettings(), {});
  ASSERT_TRUE(src.ok()) << src.status().ToString();
  auto sink = OpenS3Sink(url, MotoSettings(), {});
  ASSERT_TRUE((*sink)->Append(v2.data(), v2.size()).ok());
  ASSERT_TRUE((*sink)->Commit().ok());
  std::vector<uint8_t> buf(1000);
  EXPECT_EQ((*src)->ReadAt(0, buf.size(), buf.data()).ToString(),
            "DataLoss: " + url +
                " at offset 0 (1000 bytes): the object changed since it was opened (HTTP 412 "
                "PreconditionFailed)");
}

// ---- faults --------------------------------------------------------------------------------

RemoteOptions FaultOptions() {
  RemoteOptions o;
  o.http.max_attempts = 4;
  o.http.backoff_initial_ms = 10;
  o.http.backoff_max_ms = 40;
  o.http.low_speed_seconds = 1;  // the slow server stalls for far longer
  o.http.low_speed_bytes = 1;
  o.tail_bytes = 4096;
  return o;
}

// The fault server's URL for seed/small.bin (100000 bytes) with `kind` on its first `count`
// requests.
std::string FaultUrl(const std::string& kind, const std::string& count,
                     const char* file = "seed/small.bin") {
  static std::atomic<int> nonce{0};
  return StrCat(Info("fault"), "/", getpid(), "-", nonce++, "/", kind, "/", count, "/", file);
}

// Reads the first 50000 bytes (not in the opening request's tail).
Status ReadHead(const std::string& url, std::vector<uint8_t>* out) {
  FERRY_ASSIGN_OR_RETURN(std::shared_ptr<ByteSource> src, OpenHttpSource(url, FaultOptions()));
  out->assign(50000, 0);
  return src->ReadAt(0, out->size(), out->data());
}

TEST(RemoteFaultTest, TransientFaultsAreRetriedTransparently) {
  std::vector<uint8_t> expect = DiskBytes("seed/small.bin");
  expect.resize(50000);
  for (const char* kind :
       {"drop", "short", "status500", "status503", "status429", "lying", "slow"}) {
    std::vector<uint8_t> got;
    Status st = ReadHead(FaultUrl(kind, "2"), &got);
    EXPECT_TRUE(st.ok()) << kind << ": " << st.ToString();
    EXPECT_TRUE(got == expect) << kind;
  }
  // Faults on the opening request too.
  for (const char* kind : {"drop", "status503"}) {
    std::vector<uint8_t> got;
    EXPECT_TRUE(ReadHead(FaultUrl(kind, "2p"), &got).ok()) << kind;
    EXPECT_TRUE(got == expect) << kind;
  }
}

TEST(RemoteFaultTest, PersistentFaultsFailNamingUrlAndOffset) {
  struct Case {
    const char* kind;
    StatusCode code;
    std::string tail;  // the message after "URL at offset 0 (50000 bytes): "
  };
  const Case cases[] = {
      {"status500", StatusCode::kIoError, "HTTP 500 Injected (gave up after 4 attempts)"},
      {"status503", StatusCode::kIoError, "HTTP 503 Injected (gave up after 4 attempts)"},
      // Refused before any body byte is taken: every attempt asks for the same bytes.
      {"lying", StatusCode::kIoError,
       "Content-Length \"25000\" does not match the 50000 bytes of bytes 0-49999 (gave up "
       "after 4 attempts)"},
      {"badrange", StatusCode::kDataLoss,
       "asked for bytes 0-49999, the server answered \"bytes 1-50000/100000\""},
  };
  for (const Case& c : cases) {
    std::string url = FaultUrl(c.kind, "1000");
    std::vector<uint8_t> got;
    Status st = ReadHead(url, &got);
    EXPECT_EQ(st.code(), c.code) << c.kind;
    EXPECT_EQ(st.message(), url + " at offset 0 (50000 bytes): " + c.tail) << c.kind;
  }
  // The connection closed mid-body: libcurl's words, then the attempts.
  for (const char* kind : {"drop", "short"}) {
    std::string url = FaultUrl(kind, "1000");
    std::vector<uint8_t> got;
    Status st = ReadHead(url, &got);
    EXPECT_EQ(st.code(), StatusCode::kIoError) << kind;
    EXPECT_EQ(st.message().rfind(url + " at offset 0 (50000 bytes): ", 0), 0u) << st.message();
    EXPECT_NE(st.message().find("(gave up after 4 attempts)"), std::string::npos) << st.message();
  }
}

TEST(RemoteFaultTest, AFailedPieceAbandonsTheRestOfItsBatch) {
  // Six pieces in flight at once; every one fails for good, the first error is returned and
  // the others are abandoned (then the source still serves other reads).
  RemoteOptions o = FaultOptions();
  o.piece_bytes = 16000;
  o.http.max_in_flight = 3;
  std::string url = FaultUrl("status500", "1000");
  auto src = OpenHttpSource(url, o);
  ASSERT_TRUE(src.ok()) << src.status().ToString();
  std::vector<uint8_t> buf(96000);
  Status st = (*src)->ReadAt(0, buf.size(), buf.data());
  EXPECT_EQ(st.code(), StatusCode::kIoError);
  EXPECT_EQ(st.message().rfind(url + " at offset ", 0), 0u) << st.message();
  EXPECT_NE(st.message().find(" (16000 bytes): HTTP 500 Injected (gave up after 4 attempts)"),
            std::string::npos)
      << st.message();
  // The tail needs no request.
  std::vector<uint8_t> expect = DiskBytes("seed/small.bin");
  ASSERT_TRUE((*src)->ReadAt(99000, 1000, buf.data()).ok());
  EXPECT_EQ(0, memcmp(buf.data(), expect.data() + 99000, 1000));
}

TEST(RemoteFaultTest, ShortBodiesAreResumedWhereTheyStopped) {
  // Each short answer's bytes are kept and the next request asks only for the rest: three
  // short answers and a whole one.
  std::vector<uint8_t> expect = DiskBytes("seed/small.bin");
  expect.resize(50000);
  std::vector<uint8_t> got;
  std::string url = FaultUrl("short", "3");
  EXPECT_TRUE(ReadHead(url, &got).ok());
  EXPECT_TRUE(got == expect);
  // The server's record of the Range headers it was sent.
  std::string path = url.substr(Info("fault").size());
  auto log = OpenHttpSource(Info("fault") + "/_ranges" + path, FaultOptions());
  ASSERT_TRUE(log.ok()) << log.status().ToString();
  std::string text((*log)->size(), '\0');
  ASSERT_TRUE((*log)->ReadAt(0, text.size(), reinterpret_cast<uint8_t*>(text.data())).ok());
  EXPECT_EQ(text,
            "[\"bytes=-4096\", \"bytes=0-49999\", \"bytes=25000-49999\", \"bytes=37500-49999\", "
            "\"bytes=43750-49999\"]");
}

TEST(RemoteFaultTest, AnObjectChangedBetweenRequestsIsDataLoss) {
  std::string url = FaultUrl("changed", "1");
  std::vector<uint8_t> got;
  EXPECT_EQ(ReadHead(url, &got).ToString(),
            "DataLoss: " + url +
                " at offset 0 (50000 bytes): the object changed since it was opened (HTTP 412 "
                "Injected)");
  // A server that ignores If-Match: the new ETag gives it away.
  url = FaultUrl("changed-ignore", "1");
  Status st = ReadHead(url, &got);
  EXPECT_EQ(st.code(), StatusCode::kDataLoss);
  EXPECT_EQ(st.message().rfind(url + " at offset 0 (50000 bytes): the object changed since it "
                                     "was opened (ETag \"",
                               0),
            0u)
      << st.message();
}

TEST(RemoteFaultTest, ServersWithoutRangesOrETags) {
  std::string url = FaultUrl("norange", "0");
  EXPECT_EQ(OpenHttpSource(url, FaultOptions()).status().ToString(),
            "Unimplemented: " + url + ": the server ignores Range requests");
  // A small object comes whole with the opening request.
  auto small = OpenHttpSource(FaultUrl("norange", "0", "seed/one.bin"), FaultOptions());
  ASSERT_TRUE(small.ok()) << small.status().ToString();
  ExpectSameBytes(**small, DiskBytes("seed/one.bin"));
  auto noetag = OpenHttpSource(FaultUrl("noetag", "0"), FaultOptions());
  ASSERT_TRUE(noetag.ok());
  ExpectSameBytes(**noetag, DiskBytes("seed/small.bin"));
}

// ---- the S3 sink ---------------------------------------------------------------------------

S3SinkOptions FiveMiBParts() {
  S3SinkOptions o;
  o.part_bytes = 5 << 20;
  o.parts_in_flight = 2;
  return o;
}

std::vector<uint8_t> Pattern(size_t n, uint8_t seed) {
  std::vector<uint8_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<uint8_t>(i * 131 + seed + (i >> 12));
  return v;
}

Status Upload(const std::string& url, const std::vector<uint8_t>& bytes) {
  FERRY_ASSIGN_OR_RETURN(std::unique_ptr<RemoteSink> sink,
                         OpenS3Sink(url, MotoSettings(), FiveMiBParts()));
  // Uneven appends, as a writer's blocks come.
  for (size_t off = 0; off < bytes.size();) {
    size_t n = std::min<size_t>(bytes.size() - off, 777777);
    FERRY_RETURN_IF_ERROR(sink->Append(bytes.data() + off, n));
    off += n;
  }
  return sink->Commit();
}

// An object at a fresh key of this test, holding `previous`; its URL.
std::string PutPrevious(const std::vector<uint8_t>& previous) {
  std::string url = S3Url("sink/" + TestName());
  Status st = Upload(url, previous);
  EXPECT_TRUE(st.ok()) << st.ToString();
  return url;
}

std::vector<uint8_t> Download(const std::string& url) {
  auto src = OpenS3Source(url, MotoSettings(), {});
  if (!src.ok()) {
    ADD_FAILURE() << src.status().ToString();
    return {};
  }
  std::vector<uint8_t> out((*src)->size());
  EXPECT_TRUE((*src)->ReadAt(0, out.size(), out.data()).ok());
  return out;
}

TEST(S3SinkTest, MultipartAndSinglePutRoundTrip) {
  REQUIRE_SERVER("moto");
  for (size_t size : {size_t{0}, size_t{1000}, size_t{5 << 20}, size_t{(11 << 20) + 5}}) {
    std::string url = S3Url(StrCat("sink/", TestName(), "-", size));
    std::vector<uint8_t> bytes = Pattern(size, 3);
    Status st = Upload(url, bytes);
    ASSERT_TRUE(st.ok()) << size << ": " << st.ToString();
    EXPECT_TRUE(Download(url) == bytes) << size;
    // One PutObject below a part (ETag: the MD5), a multipart upload from one part on
    // (ETag: "-" and the part count).
    auto src = OpenS3Source(url, MotoSettings(), {});
    ASSERT_TRUE(src.ok());
    std::string parts = size < (5 << 20) ? "" : size == (5 << 20) ? "-1" : "-3";
    if (parts.empty()) {
      EXPECT_NE((*src)->Describe().find("ETag \"" + Md5Hex(bytes) + "\" pinned"), std::string::npos)
          << (*src)->Describe();
    } else {
      EXPECT_NE((*src)->Describe().find(parts + "\" pinned"), std::string::npos)
          << (*src)->Describe();
    }
  }
}

TEST(S3SinkTest, AbortedOrAbandonedUploadsLeaveThePreviousObject) {
  REQUIRE_SERVER("moto");
  std::vector<uint8_t> v1 = Pattern(300000, 1);
  std::string url = PutPrevious(v1);
  std::vector<uint8_t> v2 = Pattern(12 << 20, 2);
  {
    auto sink = OpenS3Sink(url, MotoSettings(), FiveMiBParts());
    ASSERT_TRUE(sink.ok());
    ASSERT_TRUE((*sink)->Append(v2.data(), v2.size()).ok());
    (*sink)->Abort();
    EXPECT_EQ((*sink)->Commit().ToString(), "InvalidArgument: " + url + ": the upload was aborted");
  }
  EXPECT_TRUE(Download(url) == v1);
  {
    auto sink = OpenS3Sink(url, MotoSettings(), FiveMiBParts());
    ASSERT_TRUE((*sink)->Append(v2.data(), v2.size()).ok());
  }  // destroyed without Commit
  EXPECT_TRUE(Download(url) == v1);
}

TEST(S3SinkTest, AKilledSaveLeavesThePreviousObject) {
  REQUIRE_SERVER("moto");
  std::vector<uint8_t> v1 = Pattern(200000, 1);
  std::string url = PutPrevious(v1);
  pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    // Three parts with one in flight: the first two are uploaded when Append returns.
    S3SinkOptions o = FiveMiBParts();
    o.parts_in_flight = 1;
    auto sink = OpenS3Sink(url, MotoSettings(), o);
    std::vector<uint8_t> v2 = Pattern(15 << 20, 2);
    bool ok = sink.ok() && (*sink)->Append(v2.data(), v2.size()).ok();
    _exit(ok ? 0 : 1);  // killed: no Commit, no Abort, no destructors
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  EXPECT_TRUE(Download(url) == v1);
}

TEST(S3SinkTest, AFailedUploadReportsAndKeepsThePreviousObject) {
  REQUIRE_SERVER("moto");
  std::vector<uint8_t> v1 = Pattern(1000, 1);
  std::string url = PutPrevious(v1);
  AwsSettings wrong = MotoSettings();
  wrong.credentials.secret_access_key = "WrongSecretDoNotPrint";
  auto sink = OpenS3Sink(url, wrong, FiveMiBParts());
  ASSERT_TRUE(sink.ok());
  std::vector<uint8_t> v2 = Pattern(6 << 20, 2);
  Status st = (*sink)->Append(v2.data(), v2.size());
  EXPECT_EQ(st.ToString(), "IoError: " + url +
                               ": CreateMultipartUpload: access denied (HTTP 403 "
                               "SignatureDoesNotMatch)");
  EXPECT_EQ((*sink)->Commit().ToString(), st.ToString());
  EXPECT_TRUE(Download(url) == v1);
  EXPECT_EQ(OpenS3Sink(url, MotoSettings(), S3SinkOptions{1 << 20}).status().ToString(),
            "InvalidArgument: " + url +
                ": part_bytes must be at least 5242880 (S3's smallest part) and parts_in_flight "
                "at least 1");
  EXPECT_EQ(OpenRemoteSink("http://h/x").status().ToString(),
            "InvalidArgument: http://h/x: only s3:// destinations take uploads");
}

// ---- checkpoints through the public reader --------------------------------------------------

// A checkpoint of every encoding over many 64 KiB blocks, written locally, put where nginx
// serves it and into the bucket, then read back through Reader::Open of both URLs with
// checksums verified.
TEST(RemoteReaderTest, CheckpointsReadOverHttpAndS3AsFromAFile) {
  REQUIRE_SERVER("nginx");
  REQUIRE_SERVER("moto");
  std::string name = "ckpt/" + std::to_string(getpid()) + ".ferry";
  std::string path = Info("root") + "/" + name;
  fs::create_directories(fs::path(path).parent_path());
  std::map<std::string, std::vector<uint8_t>> expected;
  {
    WriterOptions wo;
    wo.block_size = 64 << 10;
    auto w = Writer::Create(path, wo);
    ASSERT_TRUE(w.ok()) << w.status().ToString();
    uint64_t seed = 1;
    for (Encoding enc :
         {Encoding::kRaw, Encoding::kZstd, Encoding::kShuffleZstd, Encoding::kPlanes}) {
      for (DType dtype : {DType::kBF16, DType::kF32}) {
        ASSERT_TRUE(testing::AddTestTensor(*w, StrCat(EncodingName(enc), "/", DTypeName(dtype)),
                                           dtype, {400, 257}, enc, seed++, &expected)
                        .ok());
      }
    }
    ASSERT_TRUE(w->Commit().ok());
  }
  std::vector<uint8_t> file = DiskBytes(name);
  ASSERT_TRUE(Upload(S3Url(name), file).ok());
  AwsSettings aws = MotoSettings();
  ScopedEnv env;
  env.Set("HOME", "/nonexistent");
  env.Set("AWS_ACCESS_KEY_ID", aws.credentials.access_key_id);
  env.Set("AWS_SECRET_ACCESS_KEY", aws.credentials.secret_access_key);
  env.Set("AWS_ENDPOINT_URL_S3", aws.endpoint);
  for (const std::string& url : {Info("http") + "/" + name, S3Url(name)}) {
    auto reader = Reader::Open(url);
    ASSERT_TRUE(reader.ok()) << url << ": " << reader.status().ToString();
    for (const auto& [tensor, bytes] : expected) {
      std::vector<uint8_t> got(bytes.size());
      Status st = (*reader)->ReadInto(tensor, got.data(), got.size(), {true});
      ASSERT_TRUE(st.ok()) << url << " " << tensor << ": " << st.ToString();
      EXPECT_TRUE(got == bytes) << url << " " << tensor;
    }
  }
}

// ---- redaction -----------------------------------------------------------------------------

TEST(RedactionTest, NoSecretInAnyMessage) {
  REQUIRE_SERVER("moto");
  const std::string secret = "TopSecretKeyValue/xyz+123";
  const std::string token = "SessionTokenNeverShown";
  std::vector<std::string> messages;
  AwsSettings aws = MotoSettings();
  aws.credentials.secret_access_key = secret;
  aws.credentials.session_token = token;
  messages.push_back(OpenS3Source(S3Url("seed/small.bin"), aws, {}).status().ToString());
  messages.push_back(OpenS3Source(S3Url("seed/nope.bin"), aws, {}).status().ToString());
  aws.endpoint = "http://127.0.0.1:1";  // nothing listens
  RemoteOptions quick = FaultOptions();
  quick.http.max_attempts = 2;
  messages.push_back(OpenS3Source(S3Url("seed/small.bin"), aws, quick).status().ToString());
  auto sink = OpenS3Sink(S3Url("sink/redaction"), aws, FiveMiBParts());
  std::vector<uint8_t> part = Pattern(5 << 20, 0);
  messages.push_back((*sink)->Append(part.data(), part.size()).ToString());
  messages.push_back(
      OpenHttpSource("http://user:" + secret + "@127.0.0.1:1/x?X-Amz-Security-Token=" + token,
                     quick)
          .status()
          .ToString());
  messages.push_back(
      OpenHttpSource("http://127.0.0.1:1/x?X-Amz-Signature=" + secret, quick).status().ToString());
  for (const std::string& m : messages) {
    EXPECT_EQ(m.find("TopSecret"), std::string::npos) << m;
    EXPECT_EQ(m.find(token), std::string::npos) << m;
    EXPECT_NE(m, "OK");
  }
}

}  // namespace
}  // namespace ferry
