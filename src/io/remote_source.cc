// HTTP and S3 byte sources: parallel, checked, resumable range GETs.
#include "io/remote_source.hpp"

#include <algorithm>
#include <cctype>
#include <cstring>
#include <ctime>
#include <functional>
#include <vector>

#include "base/util.hpp"
#include "io/remote.hpp"
#include "io/s3.hpp"
#include "io/url.hpp"

namespace ferry {
namespace {

constexpr size_t kMaxErrorBody = 4096;
// Ranges of one ReadRanges call this close (and within one piece) go out as one request.
constexpr uint64_t kJoinGap = uint64_t{128} << 10;

bool ParseNumber(std::string_view s, uint64_t* out) {
  if (s.empty() || s.size() > 19) return false;
  uint64_t v = 0;
  for (char c : s) {
    if (c < '0' || c > '9') return false;
    v = v * 10 + static_cast<uint64_t>(c - '0');
  }
  *out = v;
  return true;
}

// "bytes FIRST-LAST/TOTAL", or "bytes */TOTAL" (first = last = UINT64_MAX then).
bool ParseContentRange(const std::string* header, uint64_t* first, uint64_t* last,
                       uint64_t* total) {
  if (header == nullptr) return false;
  std::string_view v = *header;
  if (v.rfind("bytes ", 0) != 0) return false;
  v.remove_prefix(6);
  size_t slash = v.find('/');
  if (slash == std::string_view::npos || !ParseNumber(v.substr(slash + 1), total)) return false;
  std::string_view range = v.substr(0, slash);
  if (range == "*") {
    *first = *last = UINT64_MAX;
    return true;
  }
  size_t dash = range.find('-');
  return dash != std::string_view::npos && ParseNumber(range.substr(0, dash), first) &&
         ParseNumber(range.substr(dash + 1), last) && *first <= *last && *last < *total;
}

std::string Shown(const std::string* header) {
  return header == nullptr ? "none" : "\"" + EscapeBytes(header->substr(0, 200)) + "\"";
}

// Signs or otherwise completes a request (S3: Host, x-amz-*, Authorization).
using Authorizer = std::function<void(const std::string& method, std::vector<std::string>*)>;

class RemoteObjectSource : public ByteSource {
 public:
  RemoteObjectSource(std::string name, std::string url, Authorizer authorize,
                     std::unique_ptr<HttpClient> client, const RemoteOptions& options,
                     std::string describe)
      : name_(std::move(name)),
        url_(std::move(url)),
        authorize_(std::move(authorize)),
        client_(std::move(client)),
        options_(options),
        describe_(std::move(describe)) {}

  const std::string& name() const override { return name_; }
  uint64_t size() const override { return size_; }
  const std::shared_ptr<const Mapping>& mapping() const override {
    static const std::shared_ptr<const Mapping> kNone;
    return kNone;
  }
  uint64_t preferred_read_bytes() const override { return options_.piece_bytes; }
  int preferred_parallel_reads() const override { return options_.http.max_in_flight; }
  std::string Describe() const override {
    std::string pinned = !etag_.empty()            ? "ETag " + EscapeBytes(etag_) + " pinned"
                         : !last_modified_.empty() ? "Last-Modified pinned"
                                                   : "nothing to pin";
    return describe_ + ", " + pinned;
  }

  Status ReadAt(uint64_t offset, uint64_t len, uint8_t* dst) const override {
    ReadRange range{offset, len, dst};
    return ReadRanges(std::span<const ReadRange>(&range, 1));
  }

  Status ReadRanges(std::span<const ReadRange> ranges) const override;

  // The opening request: size, ETag and the tail.
  Status Probe();

 private:
  class RangeCall;
  class ProbeCall;

  // Validators every later request carries, so a replaced object is noticed.
  void AddConditions(std::vector<std::string>* headers) const {
    if (!etag_.empty() && etag_.rfind("W/", 0) != 0) {
      headers->push_back("If-Match: " + etag_);
    } else if (etag_.empty() && !last_modified_.empty()) {
      headers->push_back("If-Unmodified-Since: " + last_modified_);
    }
  }

  // DataLoss when the answer comes from another version of the object than the one opened.
  Status CheckSameObject(const HttpResponse& head, const std::string& where) const {
    const std::string* etag = head.Header("etag");
    if (!etag_.empty() && etag != nullptr && *etag != etag_) {
      return Error(StatusCode::kDataLoss, where, ": the object changed since it was opened (ETag ",
                   Shown(&etag_), ", now ", Shown(etag), ")");
    }
    const std::string* modified = head.Header("last-modified");
    if (etag_.empty() && !last_modified_.empty() && modified != nullptr &&
        *modified != last_modified_) {
      return Error(StatusCode::kDataLoss, where,
                   ": the object changed since it was opened (Last-Modified ",
                   Shown(&last_modified_), ", now ", Shown(modified), ")");
    }
    return Status::Ok();
  }

  std::string name_;
  std::string url_;
  Authorizer authorize_;
  std::unique_ptr<HttpClient> client_;
  RemoteOptions options_;
  std::string describe_;
  uint64_t size_ = 0;
  std::string etag_;
  std::string last_modified_;
  uint64_t tail_offset_ = 0;
  std::vector<uint8_t> tail_;
};

// What the range and opening calls share: a verdict reached while the response arrives, and
// the (bounded) body of an error response, kept for its <Code>.
class CheckedCall : public HttpCall {
 public:
  bool OnBody(const uint8_t* data, size_t size) final {
    if (!accept_) {
      KeepErrorBody(data, size);
      return true;
    }
    if (size > Room()) {
      return Stop(HttpOutcome::Fail(
          Error(StatusCode::kDataLoss, Where(), ": the server sent more than the bytes asked")));
    }
    Take(data, size);
    return true;
  }

 protected:
  // Where messages say the call was; how many body bytes it still expects; taking them.
  virtual std::string Where() const = 0;
  virtual uint64_t Room() const = 0;
  virtual void Take(const uint8_t* data, size_t size) = 0;

  void Reset() {
    verdict_.reset();
    accept_ = false;
    error_body_.clear();
  }
  bool Stop(HttpOutcome outcome) {
    verdict_ = std::move(outcome);
    return false;
  }
  void KeepErrorBody(const uint8_t* data, size_t size) {
    size_t room = kMaxErrorBody - std::min(kMaxErrorBody, error_body_.size());
    error_body_.append(reinterpret_cast<const char*>(data), std::min(size, room));
  }
  // The outcome of an attempt, given the bytes the accepted body brought.
  HttpOutcome Settle(const HttpResponse& head, const HttpTransfer& transfer, uint64_t got,
                     uint64_t want) {
    std::string where = Where();
    if (verdict_) return *verdict_;
    if (transfer.curl_code != 0) return TransportOutcome(where, transfer);
    if (!accept_) return StatusOutcome(where, head, error_body_);
    if (got < want) {
      return HttpOutcome::Retry(Error(StatusCode::kIoError, where, ": the response ended after ",
                                      got, " of ", want, " bytes"));
    }
    return HttpOutcome::Done();
  }

  bool accept_ = false;  // the body is the data asked for (else an error response's)
  std::optional<HttpOutcome> verdict_;
  std::string error_body_;
};

// One range GET of [offset, offset + len), its bytes delivered to the segments (in order,
// inside the range; bytes between them are dropped), resumed after a failed attempt from the
// first byte not yet received.
class RemoteObjectSource::RangeCall : public CheckedCall {
 public:
  RangeCall(const RemoteObjectSource* src, std::vector<ReadRange> segments)
      : src_(src),
        offset_(segments.front().offset),
        len_(segments.back().offset + segments.back().len - segments.front().offset),
        segments_(std::move(segments)) {}

  Status Prepare(int, HttpRequest* request) override {
    Reset();
    request->url = src_->url_;
    request->headers.push_back(StrCat("Range: bytes=", offset_ + done_, "-", offset_ + len_ - 1));
    src_->AddConditions(&request->headers);
    if (src_->authorize_) src_->authorize_("GET", &request->headers);
    return Status::Ok();
  }

  bool OnHead(const HttpResponse& head) override {
    if (head.status != 206 && head.status != 200) return true;  // an error; Finish maps it
    uint64_t first = offset_ + done_;
    uint64_t last = offset_ + len_ - 1;
    if (Status st = src_->CheckSameObject(head, Where()); !st.ok()) {
      return Stop(HttpOutcome::Fail(std::move(st)));
    }
    uint64_t expect = last - first + 1;
    if (head.status == 200) {
      // The whole object: acceptable only when the whole object is what was asked for.
      if (first != 0 || expect != src_->size_) {
        return Stop(
            HttpOutcome::Fail(Error(StatusCode::kUnimplemented, Where(),
                                    ": the server ignores Range requests (HTTP 200 for a range)")));
      }
    } else {
      const std::string* cr = head.Header("content-range");
      uint64_t a = 0, b = 0, total = 0;
      if (!ParseContentRange(cr, &a, &b, &total)) {
        return Stop(HttpOutcome::Retry(
            Error(StatusCode::kIoError, Where(), ": HTTP 206 with Content-Range ", Shown(cr))));
      }
      if (total != src_->size_) {
        return Stop(HttpOutcome::Fail(Error(StatusCode::kDataLoss, Where(),
                                            ": the object changed since it was opened (",
                                            src_->size_, " bytes, now ", total, ")")));
      }
      if (a != first || b != last) {
        return Stop(
            HttpOutcome::Fail(Error(StatusCode::kDataLoss, Where(), ": asked for bytes ", first,
                                    "-", last, ", the server answered ", Shown(cr))));
      }
    }
    uint64_t length = 0;
    const std::string* cl = head.Header("content-length");
    if (cl != nullptr && (!ParseNumber(*cl, &length) || length != expect)) {
      return Stop(HttpOutcome::Retry(Error(StatusCode::kIoError, Where(), ": Content-Length ",
                                           Shown(cl), " does not match the ", expect,
                                           " bytes of bytes ", first, "-", last)));
    }
    accept_ = true;
    return true;
  }

  HttpOutcome Finish(const HttpResponse& head, const HttpTransfer& transfer) override {
    return Settle(head, transfer, done_, len_);
  }

 private:
  std::string Where() const override {
    return StrCat(src_->name_, " at offset ", offset_, " (", len_, " bytes)");
  }
  uint64_t Room() const override { return len_ - done_; }
  void Take(const uint8_t* data, size_t size) override {
    uint64_t pos = offset_ + done_;
    const uint64_t end = pos + size;
    done_ += size;
    while (pos < end && next_ < segments_.size()) {
      const ReadRange& s = segments_[next_];
      const uint64_t upto =
          pos < s.offset ? std::min(end, s.offset) : std::min(end, s.offset + s.len);
      if (pos >= s.offset) std::memcpy(s.dst + (pos - s.offset), data, upto - pos);
      data += upto - pos;
      pos = upto;
      if (pos == s.offset + s.len) ++next_;
    }
  }

  const RemoteObjectSource* src_;
  uint64_t offset_;
  uint64_t len_;
  std::vector<ReadRange> segments_;  // by offset, disjoint
  size_t next_ = 0;                  // the first segment not yet complete
  uint64_t done_ = 0;
};

// The opening suffix-range GET: the last tail_bytes, the size and the validators.
class RemoteObjectSource::ProbeCall : public CheckedCall {
 public:
  explicit ProbeCall(RemoteObjectSource* src) : src_(src) {}

  Status Prepare(int, HttpRequest* request) override {
    Reset();
    src_->tail_.clear();
    request->url = src_->url_;
    request->headers.push_back(StrCat("Range: bytes=-", src_->options_.tail_bytes));
    if (src_->authorize_) src_->authorize_("GET", &request->headers);
    return Status::Ok();
  }

  bool OnHead(const HttpResponse& head) override {
    const std::string* cl = head.Header("content-length");
    uint64_t length = 0;
    bool has_length = cl != nullptr && ParseNumber(*cl, &length);
    if (head.status == 206 || head.status == 416) {
      const std::string* cr = head.Header("content-range");
      uint64_t a = 0, b = 0, total = 0;
      if (!ParseContentRange(cr, &a, &b, &total) || (head.status == 416) != (a == UINT64_MAX)) {
        return Stop(HttpOutcome::Retry(Error(StatusCode::kIoError, src_->name_, ": HTTP ",
                                             head.status, " with Content-Range ", Shown(cr))));
      }
      if (head.status == 416) {
        // Only an empty object has no suffix to give.
        if (total != 0) return true;
        src_->size_ = 0;
        src_->tail_offset_ = 0;
      } else {
        if (has_length && length != b - a + 1) {
          return Stop(
              HttpOutcome::Retry(Error(StatusCode::kIoError, src_->name_, ": Content-Length ",
                                       Shown(cl), " does not match Content-Range ", Shown(cr))));
        }
        src_->size_ = total;
        src_->tail_offset_ = a;
        expect_ = b - a + 1;
      }
    } else if (head.status == 200) {
      // A server without ranges: take a small object whole, refuse a large one.
      if (!has_length || length > src_->options_.tail_bytes) {
        return Stop(HttpOutcome::Fail(
            Error(StatusCode::kUnimplemented, src_->name_, ": the server ignores Range requests")));
      }
      src_->size_ = length;
      src_->tail_offset_ = 0;
      expect_ = length;
    } else {
      return true;  // an error; Finish maps it
    }
    const std::string* etag = head.Header("etag");
    const std::string* modified = head.Header("last-modified");
    src_->etag_ = etag != nullptr ? *etag : "";
    src_->last_modified_ = modified != nullptr ? *modified : "";
    src_->tail_.reserve(expect_);
    accept_ = true;
    return true;
  }

  HttpOutcome Finish(const HttpResponse& head, const HttpTransfer& transfer) override {
    return Settle(head, transfer, src_->tail_.size(), expect_);
  }

 private:
  std::string Where() const override { return src_->name_; }
  uint64_t Room() const override { return expect_ - src_->tail_.size(); }
  void Take(const uint8_t* data, size_t size) override {
    src_->tail_.insert(src_->tail_.end(), data, data + size);
  }

  RemoteObjectSource* src_;
  uint64_t expect_ = 0;
};

Status RemoteObjectSource::Probe() {
  ProbeCall call(this);
  HttpCall* calls[] = {&call};
  return client_->Run(calls);
}

Status RemoteObjectSource::ReadRanges(std::span<const ReadRange> ranges) const {
  std::vector<ReadRange> wanted;
  for (const ReadRange& r : ranges) {
    if (r.len == 0) continue;
    uint64_t end = 0;
    if (AddOverflows(r.offset, r.len, &end) || end > size_) {
      return Error(StatusCode::kDataLoss, name_, " at offset ", r.offset, " (", r.len,
                   " bytes): past the end of the object (", size_, " bytes)");
    }
    if (r.offset >= tail_offset_ && end <= tail_offset_ + tail_.size()) {
      std::memcpy(r.dst, tail_.data() + (r.offset - tail_offset_), r.len);
      continue;
    }
    for (uint64_t done = 0; done < r.len; done += options_.piece_bytes) {
      wanted.push_back(
          ReadRange{r.offset + done, std::min(options_.piece_bytes, r.len - done), r.dst + done});
    }
  }
  // Neighbours share a request: a round trip costs more than the few bytes between them.
  std::stable_sort(wanted.begin(), wanted.end(),
                   [](const ReadRange& a, const ReadRange& b) { return a.offset < b.offset; });
  std::vector<std::unique_ptr<RangeCall>> calls;
  std::vector<HttpCall*> ptrs;
  for (size_t i = 0; i < wanted.size();) {
    std::vector<ReadRange> segments{wanted[i]};
    uint64_t end = wanted[i].offset + wanted[i].len;
    for (++i; i < wanted.size(); ++i) {
      const ReadRange& r = wanted[i];
      if (r.offset < end || r.offset - end > kJoinGap ||
          r.offset + r.len - segments.front().offset > options_.piece_bytes) {
        break;
      }
      segments.push_back(r);
      end = r.offset + r.len;
    }
    calls.push_back(std::make_unique<RangeCall>(this, std::move(segments)));
    ptrs.push_back(calls.back().get());
  }
  return client_->Run(ptrs);
}

std::string Describe(const char* what, const RemoteOptions& options) {
  const uint64_t piece = options.piece_bytes;
  return StrCat(what, ", ", options.http.max_in_flight, " in flight, ",
                piece % (1 << 20) == 0   ? StrCat(piece >> 20, " MiB")
                : piece % (1 << 10) == 0 ? StrCat(piece >> 10, " KiB")
                                         : StrCat(piece, " bytes"),
                " each");
}

Result<std::shared_ptr<ByteSource>> Finish(std::shared_ptr<RemoteObjectSource> source) {
  FERRY_RETURN_IF_ERROR(source->Probe());
  return std::shared_ptr<ByteSource>(std::move(source));
}

Status CheckOptions(const RemoteOptions& options) {
  if (options.piece_bytes == 0) {
    return Error(StatusCode::kInvalidArgument, "remote options: piece_bytes must not be 0");
  }
  return Status::Ok();
}

}  // namespace

RemoteOptions DefaultRemoteOptions(const EnvLookup& env) {
  RemoteOptions out;
  for (const char* name : {"CURL_CA_BUNDLE", "SSL_CERT_FILE"}) {
    std::optional<std::string> v = env(name);
    if (v && !v->empty()) {
      out.http.ca_bundle = *v;
      break;
    }
  }
  return out;
}

Result<std::shared_ptr<ByteSource>> OpenHttpSource(const std::string& url,
                                                   const RemoteOptions& options) {
  FERRY_RETURN_IF_ERROR(CheckOptions(options));
  FERRY_ASSIGN_OR_RETURN(HttpUrl parsed, ParseHttpUrl(url));
  if (parsed.has_userinfo) {
    return Error(StatusCode::kInvalidArgument, PrintableUrl(url),
                 ": user information in URLs is not supported (credentials would be logged)");
  }
  FERRY_ASSIGN_OR_RETURN(std::unique_ptr<HttpClient> client, HttpClient::Create(options.http));
  return Finish(std::make_shared<RemoteObjectSource>(
      PrintableUrl(url), parsed.ToString(), Authorizer(), std::move(client), options,
      Describe(parsed.scheme == "https" ? "HTTPS range GETs" : "HTTP range GETs", options)));
}

Result<std::shared_ptr<ByteSource>> OpenS3Source(const std::string& url,
                                                 const AwsSettings& settings,
                                                 const RemoteOptions& options) {
  FERRY_RETURN_IF_ERROR(CheckOptions(options));
  FERRY_ASSIGN_OR_RETURN(S3Url parsed, ParseS3Url(url));
  FERRY_ASSIGN_OR_RETURN(S3Object object, ResolveS3Object(parsed, settings));
  RemoteOptions opts = options;
  if (opts.http.ca_bundle.empty()) opts.http.ca_bundle = settings.ca_bundle;
  FERRY_ASSIGN_OR_RETURN(std::unique_ptr<HttpClient> client, HttpClient::Create(opts.http));
  std::string how = StrCat(
      "S3 range GETs (",
      settings.credentials.empty() ? std::string("unsigned")
                                   : "SigV4, credentials from " + settings.credentials_source,
      ", ", object.path_style ? "path-style" : "virtual-hosted", ", ", object.url.Origin(), ")");
  std::string object_url = S3RequestUrl(object, {});
  std::string name = object.Name();
  auto authorize = [settings, object](const std::string& method,
                                      std::vector<std::string>* headers) {
    S3Authorize(settings, object, method, {}, kEmptySha256, std::time(nullptr), headers);
  };
  return Finish(std::make_shared<RemoteObjectSource>(std::move(name), std::move(object_url),
                                                     std::move(authorize), std::move(client), opts,
                                                     Describe(how.c_str(), opts)));
}

Result<RemoteOptions> WithSourceOptions(RemoteOptions base, const SourceOptions& options) {
  if (options.max_attempts < 0 || options.max_attempts > kMaxAttempts ||
      options.max_in_flight < 0 || options.max_in_flight > kMaxInFlight) {
    return Error(StatusCode::kInvalidArgument, "storage options: max_attempts ",
                 options.max_attempts, " and max_in_flight ", options.max_in_flight,
                 " must lie in [0, ", kMaxAttempts, "] and [0, ", kMaxInFlight,
                 "] (0: the default)");
  }
  if (!options.ca_bundle.empty()) base.http.ca_bundle = options.ca_bundle;
  if (options.max_attempts > 0) base.http.max_attempts = options.max_attempts;
  if (options.max_in_flight > 0) base.http.max_in_flight = options.max_in_flight;
  if (options.piece_bytes > 0) base.piece_bytes = options.piece_bytes;
  return base;
}

Result<std::shared_ptr<ByteSource>> OpenRemoteSource(const std::string& url,
                                                     const SourceOptions& options) {
  EnvLookup env = ProcessEnvironment();
  std::string scheme = url.substr(0, 5);
  for (char& c : scheme) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  RemoteOptions opts = DefaultRemoteOptions(env);
  if (scheme == "s3://") {
    FERRY_ASSIGN_OR_RETURN(AwsSettings settings, ResolveAwsSettings(env));
    // AWS_CA_BUNDLE (in the settings) first, then the variables curl users set; a bundle
    // given in code beats both.
    if (!settings.ca_bundle.empty()) opts.http.ca_bundle = settings.ca_bundle;
    FERRY_ASSIGN_OR_RETURN(opts, WithSourceOptions(std::move(opts), options));
    return OpenS3Source(url, settings, opts);
  }
  FERRY_ASSIGN_OR_RETURN(opts, WithSourceOptions(std::move(opts), options));
  return OpenHttpSource(url, opts);
}

}  // namespace ferry
