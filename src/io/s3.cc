// S3 addressing and signing, and the multipart-upload sink.
#include "io/s3.hpp"

#include <strings.h>

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

#include "base/util.hpp"
#include "io/remote_sink.hpp"
#include "io/sigv4.hpp"

namespace ferry {

std::string S3Object::Name() const { return "s3://" + bucket + "/" + EscapeBytes(key); }

Result<S3Object> ResolveS3Object(const S3Url& url, const AwsSettings& settings) {
  S3Object out;
  out.bucket = url.bucket;
  out.key = url.key;
  std::string endpoint = settings.endpoint.empty()
                             ? "https://s3." + settings.region + ".amazonaws.com"
                             : settings.endpoint;
  Result<HttpUrl> base = ParseHttpUrl(endpoint);
  if (!base.ok()) {
    return Error(StatusCode::kInvalidArgument, "the S3 endpoint ", PrintableUrl(endpoint),
                 " is not an http(s) URL");
  }
  out.url = *base;
  out.url.query.clear();
  std::string prefix = out.url.path;
  while (!prefix.empty() && prefix.back() == '/') prefix.pop_back();
  // Dots in a virtual-hosted bucket name break TLS name matching (*.s3.amazonaws.com).
  bool dns_safe = url.bucket.find('.') == std::string::npos;
  if (settings.addressing_style == "path") {
    out.path_style = true;
  } else if (settings.addressing_style == "virtual") {
    if (!dns_safe && out.url.scheme == "https") {
      return Error(StatusCode::kInvalidArgument, "s3://", url.bucket,
                   ": a bucket name with dots cannot be addressed virtual-hosted over https; "
                   "use path-style addressing (AWS_S3_ADDRESSING_STYLE=path)");
    }
    out.path_style = false;
  } else {
    out.path_style = IsIpOrLocalhost(out.url.host) || !dns_safe;
  }
  std::string key = UriEncode(url.key, true);
  if (out.path_style) {
    out.url.path = prefix + "/" + url.bucket + "/" + key;
  } else {
    out.url.host = url.bucket + "." + out.url.host;
    out.url.path = prefix + "/" + key;
  }
  return out;
}

std::string S3RequestUrl(const S3Object& object, const QueryParams& query) {
  std::string url = object.url.ToString();
  if (!query.empty()) url.append("?").append(CanonicalQuery(query));
  return url;
}

void S3Authorize(const AwsSettings& settings, const S3Object& object, const std::string& method,
                 const QueryParams& query, const std::string& payload_sha256, std::time_t now,
                 std::vector<std::string>* headers) {
  std::string host = object.url.Authority();
  headers->push_back("Host: " + host);
  if (settings.credentials.empty()) return;
  SigV4Request req;
  req.method = method;
  req.canonical_uri = object.url.path;
  req.query = query;
  req.payload_sha256 = payload_sha256;
  std::string date = AmzDate(now);
  req.headers = {{"host", host}, {"x-amz-content-sha256", payload_sha256}, {"x-amz-date", date}};
  if (!settings.credentials.session_token.empty()) {
    req.headers.emplace_back("x-amz-security-token", settings.credentials.session_token);
  }
  for (size_t i = 1; i < req.headers.size(); ++i) {
    headers->push_back(req.headers[i].first + ": " + req.headers[i].second);
  }
  headers->push_back("Authorization: " +
                     SigV4Authorization(req, settings.credentials, settings.region, "s3", date));
}

namespace {

constexpr uint64_t kMinPartBytes = uint64_t{5} << 20;
constexpr size_t kMaxResponseText = 1 << 20;

std::string XmlEscape(std::string_view s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      case '\'':
        out += "&apos;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

std::string XmlUnescape(std::string_view s) {
  static const std::pair<std::string_view, char> kEntities[] = {
      {"&amp;", '&'}, {"&lt;", '<'}, {"&gt;", '>'}, {"&quot;", '"'}, {"&apos;", '\''}};
  std::string out;
  for (size_t i = 0; i < s.size();) {
    bool matched = false;
    for (const auto& [entity, c] : kEntities) {
      if (s.substr(i, entity.size()) == entity) {
        out += c;
        i += entity.size();
        matched = true;
        break;
      }
    }
    if (!matched) out += s[i++];
  }
  return out;
}

// The text of the first <tag>...</tag> of a small XML response, or "".
std::string XmlElement(const std::string& xml, const std::string& tag) {
  size_t open = xml.find("<" + tag + ">");
  if (open == std::string::npos) return "";
  open += tag.size() + 2;
  size_t close = xml.find("</" + tag + ">", open);
  if (close == std::string::npos) return "";
  return XmlUnescape(std::string_view(xml).substr(open, close - open));
}

// One S3 request whose response is small (XML or empty): multipart steps, PutObject.
class S3Call : public HttpCall {
 public:
  S3Call(const AwsSettings* settings, const S3Object* object, std::string method, QueryParams query,
         std::span<const uint8_t> body, std::string where)
      : settings_(settings),
        object_(object),
        method_(std::move(method)),
        query_(std::move(query)),
        body_(body),
        payload_sha256_(Sha256Hex(body.data(), body.size())),
        where_(std::move(where)) {}

  Status Prepare(int, HttpRequest* request) override {
    text_.clear();
    request->method = method_;
    request->url = S3RequestUrl(*object_, query_);
    request->body = body_;
    S3Authorize(*settings_, *object_, method_, query_, payload_sha256_, std::time(nullptr),
                &request->headers);
    return Status::Ok();
  }
  bool OnBody(const uint8_t* data, size_t size) override {
    size_t take = std::min(size, kMaxResponseText - std::min(kMaxResponseText, text_.size()));
    text_.append(reinterpret_cast<const char*>(data), take);
    return true;
  }
  HttpOutcome Finish(const HttpResponse& head, const HttpTransfer& transfer) override {
    if (transfer.curl_code != 0) return TransportOutcome(where_, transfer);
    head_ = head;
    if (head.status >= 200 && head.status < 300) {
      // CompleteMultipartUpload may answer 200 and report its failure in the body.
      if (text_.find("<Error>") != std::string::npos) {
        return StatusOutcome(where_, HttpResponse{500, {}}, text_);
      }
      return HttpOutcome::Done();
    }
    return StatusOutcome(where_, head, text_);
  }

  const std::string& text() const { return text_; }
  const HttpResponse& head() const { return head_; }

 private:
  const AwsSettings* settings_;
  const S3Object* object_;
  std::string method_;
  QueryParams query_;
  std::span<const uint8_t> body_;
  std::string payload_sha256_;
  std::string where_;
  std::string text_;
  HttpResponse head_;
};

class S3UploadSink : public RemoteSink {
 public:
  S3UploadSink(std::unique_ptr<HttpClient> client, AwsSettings settings, S3Object object,
               const S3SinkOptions& options)
      : client_(std::move(client)),
        settings_(std::move(settings)),
        object_(std::move(object)),
        name_(object_.Name()),
        options_(options) {}

  ~S3UploadSink() override { Abort(); }

  const std::string& name() const override { return name_; }

  Status Append(const uint8_t* data, size_t size) override {
    FERRY_RETURN_IF_ERROR(Usable());
    while (size > 0) {
      size_t take =
          static_cast<size_t>(std::min<uint64_t>(size, options_.part_bytes - buffer_.size()));
      buffer_.insert(buffer_.end(), data, data + take);
      data += take;
      size -= take;
      if (buffer_.size() == options_.part_bytes) {
        Status st = QueuePart();
        if (!st.ok()) return Failed(std::move(st));
      }
    }
    return Status::Ok();
  }

  Status Commit() override {
    FERRY_RETURN_IF_ERROR(Usable());
    Status st = Finish();
    if (!st.ok()) return Failed(std::move(st));
    committed_ = true;
    return Status::Ok();
  }

  void Abort() override {
    if (committed_ || aborted_) return;
    aborted_ = true;
    StopUploader(/*cancel=*/true);
    if (!upload_id_.empty()) {
      S3Call call(&settings_, &object_, "DELETE", {{"uploadId", upload_id_}}, {},
                  name_ + ": AbortMultipartUpload");
      HttpCall* calls[] = {&call};
      (void)client_->Run(calls);  // best effort: a lifecycle rule reclaims what is left
    }
  }

 private:
  struct Part {
    int number = 0;
    std::vector<uint8_t> bytes;
  };

  // The first error sticks, and the upload is abandoned.
  Status Failed(Status st) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (error_.ok()) error_ = st;
    }
    Abort();
    return st;
  }

  Status Usable() {
    if (committed_) return Error(StatusCode::kInvalidArgument, name_, ": already committed");
    std::lock_guard<std::mutex> lock(mu_);
    if (!error_.ok()) return error_;
    if (aborted_) return Error(StatusCode::kInvalidArgument, name_, ": the upload was aborted");
    return Status::Ok();
  }

  Status Start() {
    S3Call call(&settings_, &object_, "POST", {{"uploads", ""}}, {},
                name_ + ": CreateMultipartUpload");
    HttpCall* calls[] = {&call};
    FERRY_RETURN_IF_ERROR(client_->Run(calls));
    upload_id_ = XmlElement(call.text(), "UploadId");
    if (upload_id_.empty()) {
      return Error(StatusCode::kIoError, name_,
                   ": CreateMultipartUpload answered without an UploadId");
    }
    try {
      uploader_ = std::thread([this] { UploadLoop(); });
    } catch (const std::system_error& e) {
      return Error(StatusCode::kInternal, name_, ": cannot start the upload thread: ", e.what());
    }
    return Status::Ok();
  }

  // Hands the full buffer to the upload thread; waits while parts_in_flight are pending.
  Status QueuePart() {
    if (upload_id_.empty()) FERRY_RETURN_IF_ERROR(Start());
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] {
      return !error_.ok() ||
             static_cast<int>(queue_.size()) + uploading_ < options_.parts_in_flight;
    });
    if (!error_.ok()) return error_;
    queue_.push_back(Part{next_part_++, std::move(buffer_)});
    buffer_ = std::vector<uint8_t>();
    cv_.notify_all();
    return Status::Ok();
  }

  void UploadLoop() {
    for (;;) {
      std::vector<Part> batch;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return !queue_.empty() || closing_; });
        if (cancel_ || !error_.ok() || (queue_.empty() && closing_)) return;
        while (!queue_.empty()) {
          batch.push_back(std::move(queue_.front()));
          queue_.pop_front();
        }
        uploading_ += static_cast<int>(batch.size());
      }
      std::vector<std::unique_ptr<S3Call>> calls;
      std::vector<HttpCall*> ptrs;
      for (const Part& p : batch) {
        calls.push_back(std::make_unique<S3Call>(
            &settings_, &object_, "PUT",
            QueryParams{{"partNumber", std::to_string(p.number)}, {"uploadId", upload_id_}},
            std::span<const uint8_t>(p.bytes),
            StrCat(name_, ": part ", p.number, " (", p.bytes.size(), " bytes)")));
        ptrs.push_back(calls.back().get());
      }
      Status st = client_->Run(ptrs);
      std::lock_guard<std::mutex> lock(mu_);
      for (size_t i = 0; st.ok() && i < batch.size(); ++i) {
        const std::string* etag = calls[i]->head().Header("etag");
        if (etag == nullptr || etag->empty()) {
          st = Error(StatusCode::kIoError, name_, ": part ", batch[i].number,
                     " was stored without an ETag");
          break;
        }
        size_t index = static_cast<size_t>(batch[i].number - 1);
        if (etags_.size() <= index) etags_.resize(index + 1);
        etags_[index] = *etag;
      }
      if (!st.ok() && error_.ok()) error_ = st;
      uploading_ -= static_cast<int>(batch.size());
      cv_.notify_all();
    }
  }

  void StopUploader(bool cancel) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      closing_ = true;
      cancel_ = cancel_ || cancel;
      cv_.notify_all();
    }
    if (uploader_.joinable()) uploader_.join();
  }

  Status Finish() {
    if (upload_id_.empty()) {
      S3Call call(&settings_, &object_, "PUT", {}, buffer_, name_ + ": PutObject");
      HttpCall* calls[] = {&call};
      return client_->Run(calls);
    }
    if (!buffer_.empty()) FERRY_RETURN_IF_ERROR(QueuePart());
    StopUploader(/*cancel=*/false);
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!error_.ok()) return error_;
    }
    std::string xml = "<CompleteMultipartUpload>";
    for (size_t i = 0; i < etags_.size(); ++i) {
      xml += StrCat("<Part><PartNumber>", i + 1, "</PartNumber><ETag>", XmlEscape(etags_[i]),
                    "</ETag></Part>");
    }
    xml += "</CompleteMultipartUpload>";
    S3Call call(&settings_, &object_, "POST", {{"uploadId", upload_id_}},
                std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(xml.data()), xml.size()),
                name_ + ": CompleteMultipartUpload");
    HttpCall* calls[] = {&call};
    return client_->Run(calls);
  }

  std::unique_ptr<HttpClient> client_;
  AwsSettings settings_;
  S3Object object_;
  std::string name_;
  S3SinkOptions options_;
  std::vector<uint8_t> buffer_;
  std::string upload_id_;
  int next_part_ = 1;
  bool committed_ = false;
  bool aborted_ = false;
  std::thread uploader_;

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Part> queue_;          // under mu_
  int uploading_ = 0;               // under mu_
  bool closing_ = false;            // under mu_
  bool cancel_ = false;             // under mu_
  Status error_;                    // under mu_
  std::vector<std::string> etags_;  // under mu_ while the uploader runs
};

}  // namespace

Result<std::unique_ptr<RemoteSink>> OpenS3Sink(const std::string& url, const AwsSettings& settings,
                                               const S3SinkOptions& options) {
  FERRY_ASSIGN_OR_RETURN(S3Url parsed, ParseS3Url(url));
  FERRY_ASSIGN_OR_RETURN(S3Object object, ResolveS3Object(parsed, settings));
  if (options.part_bytes < kMinPartBytes || options.parts_in_flight < 1) {
    return Error(StatusCode::kInvalidArgument, object.Name(), ": part_bytes must be at least ",
                 kMinPartBytes, " (S3's smallest part) and parts_in_flight at least 1");
  }
  HttpOptions http = options.http;
  if (http.ca_bundle.empty()) http.ca_bundle = settings.ca_bundle;
  FERRY_ASSIGN_OR_RETURN(std::unique_ptr<HttpClient> client, HttpClient::Create(http));
  return std::unique_ptr<RemoteSink>(
      new S3UploadSink(std::move(client), settings, std::move(object), options));
}

Result<std::unique_ptr<RemoteSink>> OpenRemoteSink(const std::string& url) {
  if (url.size() < 5 || strncasecmp(url.c_str(), "s3://", 5) != 0) {
    return Error(StatusCode::kInvalidArgument, PrintableUrl(url),
                 ": only s3:// destinations take uploads");
  }
  FERRY_ASSIGN_OR_RETURN(AwsSettings settings, ResolveAwsSettings(ProcessEnvironment()));
  return OpenS3Sink(url, settings, S3SinkOptions());
}

}  // namespace ferry
