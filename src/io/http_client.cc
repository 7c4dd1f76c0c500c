// The libcurl multi loop behind every remote source and sink.
#include "io/http_client.hpp"

#include <curl/curl.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <random>
#include <thread>

#include "base/util.hpp"

namespace ferry {
namespace {

using Clock = std::chrono::steady_clock;

bool RetryableCurlCode(CURLcode rc) {
  switch (rc) {
    case CURLE_COULDNT_CONNECT:
    case CURLE_PARTIAL_FILE:
    case CURLE_OPERATION_TIMEDOUT:
    case CURLE_GOT_NOTHING:
    case CURLE_SEND_ERROR:
    case CURLE_RECV_ERROR:
    case CURLE_SSL_CONNECT_ERROR:
    case CURLE_HTTP2:
    case CURLE_HTTP2_STREAM:
      return true;
    default:
      return false;
  }
}

std::once_flag g_curl_init;

}  // namespace

const std::string* HttpResponse::Header(const std::string& name) const {
  for (const auto& [n, v] : headers) {
    if (n == name) return &v;
  }
  return nullptr;
}

struct HttpClient::Impl {
  struct Batch;
  struct Slot {
    Impl* impl = nullptr;
    HttpCall* call = nullptr;
    Batch* batch = nullptr;
    int attempt = 0;
    Clock::time_point not_before{};
    CURL* easy = nullptr;
    curl_slist* header_list = nullptr;
    HttpRequest request;
    HttpResponse head;
    bool head_delivered = false;
    bool stopped = false;
    size_t upload_pos = 0;
    char errbuf[CURL_ERROR_SIZE] = {};
  };
  struct Batch {
    std::vector<Slot> slots;
    size_t remaining = 0;  // driven by the worker only
    bool failed = false;   // worker only
    Status error;          // written by the worker before `done`
    bool done = false;     // under mu
  };

  HttpOptions options;
  CURLM* multi = nullptr;
  std::thread thread;
  std::mutex mu;
  std::condition_variable cv;
  std::vector<Batch*> incoming;  // under mu
  bool stop = false;             // under mu

  // The worker's own state.
  std::deque<Slot*> waiting;
  std::vector<Slot*> active;
  std::vector<CURL*> idle_easy;
  uint64_t rng = std::random_device{}() | (uint64_t{std::random_device{}()} << 32);

  ~Impl() {
    for (CURL* e : idle_easy) curl_easy_cleanup(e);
    if (multi != nullptr) curl_multi_cleanup(multi);
  }

  static size_t OnHeaderLine(char* data, size_t size, size_t n, void* user) {
    Slot* s = static_cast<Slot*>(user);
    size_t total = size * n;
    std::string_view line(data, total);
    while (!line.empty() && (line.back() == '\n' || line.back() == '\r')) line.remove_suffix(1);
    if (line.rfind("HTTP/", 0) == 0) {
      // A new response (the final one after a 1xx, or after a redirect we do not follow).
      s->head = HttpResponse();
      size_t sp = line.find(' ');
      long status = 0;
      for (size_t i = sp == std::string_view::npos ? line.size() : sp + 1;
           i < line.size() && line[i] >= '0' && line[i] <= '9'; ++i) {
        status = status * 10 + (line[i] - '0');
      }
      s->head.status = status;
      return total;
    }
    size_t colon = line.find(':');
    if (colon == std::string_view::npos || s->head_delivered) return total;
    std::string name(line.substr(0, colon));
    for (char& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    std::string_view value = line.substr(colon + 1);
    while (!value.empty() && (value.front() == ' ' || value.front() == '\t'))
      value.remove_prefix(1);
    while (!value.empty() && (value.back() == ' ' || value.back() == '\t')) value.remove_suffix(1);
    s->head.headers.emplace_back(std::move(name), std::string(value));
    return total;
  }

  static size_t OnBodyBytes(char* data, size_t size, size_t n, void* user) {
    Slot* s = static_cast<Slot*>(user);
    size_t total = size * n;
    if (!s->head_delivered) {
      s->head_delivered = true;
      if (!s->call->OnHead(s->head)) {
        s->stopped = true;
        return 0;
      }
    }
    if (total > 0 && !s->call->OnBody(reinterpret_cast<const uint8_t*>(data), total)) {
      s->stopped = true;
      return 0;
    }
    return total;
  }

  static size_t OnUploadRead(char* dst, size_t size, size_t n, void* user) {
    Slot* s = static_cast<Slot*>(user);
    size_t want = std::min(size * n, s->request.body.size() - s->upload_pos);
    std::memcpy(dst, s->request.body.data() + s->upload_pos, want);
    s->upload_pos += want;
    return want;
  }

  static int OnUploadSeek(void* user, curl_off_t offset, int origin) {
    Slot* s = static_cast<Slot*>(user);
    if (origin != SEEK_SET || offset < 0 ||
        static_cast<uint64_t>(offset) > s->request.body.size()) {
      return CURL_SEEKFUNC_CANTSEEK;
    }
    s->upload_pos = static_cast<size_t>(offset);
    return CURL_SEEKFUNC_OK;
  }

  Status StartAttempt(Slot* s) {
    s->request = HttpRequest();
    FERRY_RETURN_IF_ERROR(s->call->Prepare(s->attempt, &s->request));
    if (idle_easy.empty()) {
      s->easy = curl_easy_init();
      if (s->easy == nullptr) return Error(StatusCode::kInternal, "curl_easy_init failed");
    } else {
      s->easy = idle_easy.back();
      idle_easy.pop_back();
      curl_easy_reset(s->easy);
    }
    s->head = HttpResponse();
    s->head_delivered = false;
    s->stopped = false;
    s->upload_pos = 0;
    s->errbuf[0] = '\0';
    CURL* e = s->easy;
    curl_easy_setopt(e, CURLOPT_URL, s->request.url.c_str());
    curl_easy_setopt(e, CURLOPT_PRIVATE, s);
    curl_easy_setopt(e, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(e, CURLOPT_ERRORBUFFER, s->errbuf);
    curl_easy_setopt(e, CURLOPT_WRITEFUNCTION, &OnBodyBytes);
    curl_easy_setopt(e, CURLOPT_WRITEDATA, s);
    curl_easy_setopt(e, CURLOPT_HEADERFUNCTION, &OnHeaderLine);
    curl_easy_setopt(e, CURLOPT_HEADERDATA, s);
    curl_easy_setopt(e, CURLOPT_CONNECTTIMEOUT_MS, options.connect_timeout_ms);
    curl_easy_setopt(e, CURLOPT_LOW_SPEED_LIMIT, options.low_speed_bytes);
    curl_easy_setopt(e, CURLOPT_LOW_SPEED_TIME, options.low_speed_seconds);
    // Parallel HTTP/1.1 connections, as object stores expect for throughput.
    curl_easy_setopt(e, CURLOPT_HTTP_VERSION, static_cast<long>(CURL_HTTP_VERSION_1_1));
    curl_easy_setopt(e, CURLOPT_FOLLOWLOCATION, 0L);
    curl_easy_setopt(e, CURLOPT_TCP_KEEPALIVE, 1L);
    // Fewer, larger body callbacks for multi-MiB ranges (the default is 16 KiB).
    curl_easy_setopt(e, CURLOPT_BUFFERSIZE, 256L << 10);
    curl_easy_setopt(e, CURLOPT_SSL_VERIFYPEER, 1L);
    curl_easy_setopt(e, CURLOPT_SSL_VERIFYHOST, 2L);
#if LIBCURL_VERSION_NUM >= 0x075500
    curl_easy_setopt(e, CURLOPT_PROTOCOLS_STR, "http,https");
#else
    curl_easy_setopt(e, CURLOPT_PROTOCOLS, static_cast<long>(CURLPROTO_HTTP | CURLPROTO_HTTPS));
#endif
    if (!options.ca_bundle.empty()) curl_easy_setopt(e, CURLOPT_CAINFO, options.ca_bundle.c_str());
    const std::string& m = s->request.method;
    bool has_body = m == "PUT" || m == "POST";
    if (m == "HEAD") {
      curl_easy_setopt(e, CURLOPT_NOBODY, 1L);
    } else if (has_body) {
      curl_easy_setopt(e, CURLOPT_READFUNCTION, &OnUploadRead);
      curl_easy_setopt(e, CURLOPT_READDATA, s);
      curl_easy_setopt(e, CURLOPT_SEEKFUNCTION, &OnUploadSeek);
      curl_easy_setopt(e, CURLOPT_SEEKDATA, s);
      auto size = static_cast<curl_off_t>(s->request.body.size());
      if (m == "PUT") {
        curl_easy_setopt(e, CURLOPT_UPLOAD, 1L);
        curl_easy_setopt(e, CURLOPT_INFILESIZE_LARGE, size);
      } else {
        curl_easy_setopt(e, CURLOPT_POST, 1L);
        curl_easy_setopt(e, CURLOPT_POSTFIELDSIZE_LARGE, size);
      }
    } else if (m != "GET") {
      curl_easy_setopt(e, CURLOPT_CUSTOMREQUEST, m.c_str());
    }
    curl_slist* list = nullptr;
    auto add = [&](const char* h) {
      curl_slist* next = curl_slist_append(list, h);
      if (next == nullptr) return false;
      list = next;
      return true;
    };
    bool ok = true;
    for (const std::string& h : s->request.headers) ok = ok && add(h.c_str());
    // No "Expect: 100-continue" round trip, and no Content-Type for raw bodies.
    if (has_body) ok = ok && add("Expect:") && add("Content-Type:");
    s->header_list = list;
    if (!ok) return Error(StatusCode::kInternal, "out of memory building request headers");
    curl_easy_setopt(e, CURLOPT_HTTPHEADER, list);
    if (curl_multi_add_handle(multi, e) != CURLM_OK) {
      return Error(StatusCode::kInternal, "curl_multi_add_handle failed");
    }
    active.push_back(s);
    return Status::Ok();
  }

  // Detaches the slot's transfer and keeps its handle for the next request.
  void Release(Slot* s) {
    if (s->easy == nullptr) return;
    auto it = std::find(active.begin(), active.end(), s);
    if (it != active.end()) {
      curl_multi_remove_handle(multi, s->easy);
      active.erase(it);
    }
    idle_easy.push_back(s->easy);
    s->easy = nullptr;
    curl_slist_free_all(s->header_list);
    s->header_list = nullptr;
  }

  // The slot is finished for good; the batch's last one wakes its caller, after which the
  // batch must not be touched.
  void Complete(Slot* s) {
    Batch* b = s->batch;
    if (--b->remaining > 0) return;
    std::lock_guard<std::mutex> lock(mu);
    b->done = true;
    cv.notify_all();
  }

  void Fail(Slot* s, Status error) {
    Batch* b = s->batch;
    b->failed = true;
    b->error = std::move(error);
    std::vector<Slot*> victims;
    for (Slot* other : active) {
      if (other->batch == b && other != s) victims.push_back(other);
    }
    for (Slot* v : victims) Release(v);
    for (Slot* v : victims) Complete(v);
    Complete(s);  // last: the batch may be gone after it
  }

  std::chrono::milliseconds Backoff(int attempt, const HttpResponse& head) {
    // Doubling by shifts: no libm for programs that link the static library from C.
    double d = std::min<double>(options.backoff_max_ms,
                                static_cast<double>(options.backoff_initial_ms) *
                                    static_cast<double>(uint64_t{1} << std::min(attempt, 30)));
    // splitmix64: jitter needs no quality, and std's engines would be exported from the
    // library (libstdc++ gives their instantiations default visibility).
    uint64_t z = (rng += 0x9e3779b97f4a7c15);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9;
    z = (z ^ (z >> 27)) * 0x94d049bb133111eb;
    z ^= z >> 31;
    double ms = d / 2 + (d / 2) * (static_cast<double>(z >> 11) / 9007199254740992.0);
    if (const std::string* ra = head.Header("retry-after")) {
      char* end = nullptr;
      double secs = std::strtod(ra->c_str(), &end);
      if (end != ra->c_str() && secs > 0) {
        ms = std::max(ms, std::min<double>(options.backoff_max_ms, secs * 1000));
      }
    }
    return std::chrono::milliseconds(static_cast<int64_t>(ms));
  }

  void EndAttempt(Slot* s, CURLcode rc) {
    Release(s);
    if (rc == CURLE_OK && !s->head_delivered) {
      s->head_delivered = true;
      if (!s->call->OnHead(s->head)) s->stopped = true;
    }
    HttpTransfer t;
    t.curl_code = rc;
    t.stopped = s->stopped;
    if (rc != CURLE_OK && !s->stopped) {
      t.error = s->errbuf[0] != '\0' ? s->errbuf : curl_easy_strerror(rc);
      t.retryable = RetryableCurlCode(rc);
    }
    HttpOutcome o = s->call->Finish(s->head, t);
    if (o.status.ok() || s->batch->failed) {
      Complete(s);
      return;
    }
    if (o.retry && s->attempt + 1 < options.max_attempts) {
      s->not_before = Clock::now() + Backoff(s->attempt, s->head);
      ++s->attempt;
      waiting.push_back(s);
      return;
    }
    Status error = o.status;
    if (o.retry) {
      error = Status(error.code(), StrCat(error.message(), " (gave up after ", s->attempt + 1,
                                          s->attempt == 0 ? " attempt)" : " attempts)"));
    }
    Fail(s, std::move(error));
  }

  void Loop() {
    for (;;) {
      {
        std::lock_guard<std::mutex> lock(mu);
        for (Batch* b : incoming) {
          for (Slot& s : b->slots) waiting.push_back(&s);
        }
        incoming.clear();
        if (stop && waiting.empty() && active.empty()) return;
      }
      Clock::time_point now = Clock::now();
      Clock::time_point next_start = Clock::time_point::max();
      std::deque<Slot*> later;
      while (!waiting.empty()) {
        Slot* s = waiting.front();
        waiting.pop_front();
        if (s->batch->failed) {
          Complete(s);
        } else if (s->not_before > now ||
                   static_cast<int>(active.size()) >= options.max_in_flight) {
          next_start = std::min(next_start, s->not_before);
          later.push_back(s);
        } else if (Status st = StartAttempt(s); !st.ok()) {
          Release(s);
          Fail(s, std::move(st));
        }
      }
      waiting.swap(later);
      int running = 0;
      curl_multi_perform(multi, &running);
      int left = 0;
      while (CURLMsg* msg = curl_multi_info_read(multi, &left)) {
        if (msg->msg != CURLMSG_DONE) continue;
        // Only a handle still attached counts: one released by its batch's failure earlier in
        // this pass belonged to a slot that may be gone.
        auto it = std::find_if(active.begin(), active.end(),
                               [&](const Slot* a) { return a->easy == msg->easy_handle; });
        if (it != active.end()) EndAttempt(*it, msg->data.result);
      }
      long timeout_ms = -1;
      curl_multi_timeout(multi, &timeout_ms);
      if (timeout_ms < 0 || timeout_ms > 200) timeout_ms = 200;
      if (next_start != Clock::time_point::max() &&
          static_cast<int>(active.size()) < options.max_in_flight) {
        auto until = std::chrono::duration_cast<std::chrono::milliseconds>(next_start - now);
        timeout_ms = std::clamp<long>(static_cast<long>(until.count()), 0, timeout_ms);
      }
      bool abandoned = std::any_of(waiting.begin(), waiting.end(),
                                   [](const Slot* s) { return s->batch->failed; });
      if (abandoned ||
          (!waiting.empty() && static_cast<int>(active.size()) < options.max_in_flight &&
           next_start <= now)) {
        timeout_ms = 0;
      }
      if (timeout_ms > 0) curl_multi_poll(multi, nullptr, 0, static_cast<int>(timeout_ms), nullptr);
    }
  }
};

HttpClient::HttpClient(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

HttpClient::~HttpClient() {
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->stop = true;
  }
  curl_multi_wakeup(impl_->multi);
  if (impl_->thread.joinable()) impl_->thread.join();
}

Result<std::unique_ptr<HttpClient>> HttpClient::Create(const HttpOptions& options) {
  if (options.max_in_flight < 1 || options.max_attempts < 1 || options.backoff_initial_ms < 0 ||
      options.backoff_max_ms < options.backoff_initial_ms) {
    return Error(StatusCode::kInvalidArgument,
                 "HTTP options: max_in_flight and max_attempts must be at least 1, and "
                 "backoff_max_ms at least backoff_initial_ms");
  }
  std::call_once(g_curl_init, [] { curl_global_init(CURL_GLOBAL_DEFAULT); });
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  impl->multi = curl_multi_init();
  if (impl->multi == nullptr) return Error(StatusCode::kInternal, "curl_multi_init failed");
  curl_multi_setopt(impl->multi, CURLMOPT_MAX_HOST_CONNECTIONS,
                    static_cast<long>(options.max_in_flight));
  Impl* raw = impl.get();
  try {
    raw->thread = std::thread([raw] { raw->Loop(); });
  } catch (const std::system_error& e) {
    return Error(StatusCode::kInternal, "cannot start the HTTP thread: ", e.what());
  }
  return std::unique_ptr<HttpClient>(new HttpClient(std::move(impl)));
}

Status HttpClient::Run(std::span<HttpCall* const> calls) {
  if (calls.empty()) return Status::Ok();
  Impl::Batch batch;
  batch.slots.resize(calls.size());
  for (size_t i = 0; i < calls.size(); ++i) {
    batch.slots[i].impl = impl_.get();
    batch.slots[i].call = calls[i];
    batch.slots[i].batch = &batch;
  }
  batch.remaining = calls.size();
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->incoming.push_back(&batch);
  }
  curl_multi_wakeup(impl_->multi);
  std::unique_lock<std::mutex> lock(impl_->mu);
  impl_->cv.wait(lock, [&] { return batch.done; });
  return batch.error;
}

const HttpOptions& HttpClient::options() const { return impl_->options; }

HttpOutcome TransportOutcome(const std::string& where, const HttpTransfer& transfer) {
  Status error(StatusCode::kIoError, StrCat(where, ": ", transfer.error));
  return transfer.retryable ? HttpOutcome::Retry(std::move(error))
                            : HttpOutcome::Fail(std::move(error));
}

std::string ErrorCodeOf(std::string_view body) {
  size_t open = body.find("<Code>");
  if (open == std::string_view::npos) return "";
  body.remove_prefix(open + 6);
  size_t close = body.find('<');
  std::string code;
  for (char c : body.substr(0, std::min<size_t>(close, 64))) {
    if (std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_') code += c;
  }
  return code;
}

HttpOutcome StatusOutcome(const std::string& where, const HttpResponse& head,
                          std::string_view body) {
  std::string code = ErrorCodeOf(body);
  std::string http = StrCat("HTTP ", head.status, code.empty() ? "" : " ", code);
  switch (head.status) {
    case 404:
      return HttpOutcome::Fail(
          Error(StatusCode::kNotFound, where, ": no such object (", http, ")"));
    case 412:
      return HttpOutcome::Fail(Error(StatusCode::kDataLoss, where,
                                     ": the object changed since it was opened (", http, ")"));
    case 401:
    case 403:
      return HttpOutcome::Fail(Error(StatusCode::kIoError, where, ": access denied (", http, ")"));
    case 408:
    case 429:
    case 500:
    case 502:
    case 503:
    case 504:
      return HttpOutcome::Retry(Error(StatusCode::kIoError, where, ": ", http));
    default:
      return HttpOutcome::Fail(Error(StatusCode::kIoError, where, ": ", http));
  }
}

std::string HttpBackendVersion() {
  std::call_once(g_curl_init, [] { curl_global_init(CURL_GLOBAL_DEFAULT); });
  return curl_version();
}

}  // namespace ferry
