// HTTP exchanges over libcurl's multi interface: one thread per client drives every transfer,
// so connections are kept alive and reused across calls, and a batch of requests runs with up
// to max_in_flight at once. Each request is an HttpCall: it builds its request before every
// attempt, checks the response head before any body byte is accepted, takes the body, and
// says at the end whether the attempt succeeded, failed, or should be retried (after an
// exponential backoff with jitter, a bounded number of times).
//
// Thread safety: Run may be called from any number of threads at once; the calls of one
// batch are driven on the client's thread and must not be touched by the caller until Run
// returns. Lifetime: the client outlives every Run; its destructor joins its thread.
#ifndef FERRY_SRC_IO_HTTP_CLIENT_HPP_
#define FERRY_SRC_IO_HTTP_CLIENT_HPP_

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ferry/status.hpp"

namespace ferry {

struct HttpOptions {
  // Transfers running at once (and so connections kept open to one server).
  int max_in_flight = 8;
  // Attempts of one request before its last error is returned (1: no retries).
  int max_attempts = 5;
  // Backoff before attempt n+1: a random time in [d/2, d], d = min(backoff_max_ms,
  // backoff_initial_ms * 2^n); a Retry-After the server sends lengthens it, up to the cap.
  int backoff_initial_ms = 100;
  int backoff_max_ms = 5000;
  long connect_timeout_ms = 10000;
  // A transfer slower than low_speed_bytes per second for low_speed_seconds is abandoned
  // (and retried): how a stalled connection is noticed.
  long low_speed_bytes = 1024;
  long low_speed_seconds = 30;
  // PEM file of the certificate authorities to trust; empty: the system's. TLS peers are
  // always verified.
  std::string ca_bundle;
};

struct HttpRequest {
  std::string method = "GET";  // GET, HEAD, PUT, POST, DELETE
  std::string url;
  std::vector<std::string> headers;  // "Name: value"
  std::span<const uint8_t> body;     // PUT and POST: must stay valid until Run returns
};

struct HttpResponse {
  long status = 0;
  std::vector<std::pair<std::string, std::string>> headers;  // names in lower case
  // The value of a header (name in lower case), or null.
  const std::string* Header(const std::string& name) const;
};

// How one attempt ended.
struct HttpOutcome {
  Status status;       // Ok: done
  bool retry = false;  // with an error: worth another attempt
  static HttpOutcome Done() { return {}; }
  static HttpOutcome Fail(Status s) { return {std::move(s), false}; }
  static HttpOutcome Retry(Status s) { return {std::move(s), true}; }
};

// What the transport saw of an attempt.
struct HttpTransfer {
  int curl_code = 0;       // CURLE_OK (0) when the exchange completed
  std::string error;       // libcurl's text for curl_code; empty when it is 0
  bool retryable = false;  // a reset, timeout or refused connection: worth another attempt
  bool stopped = false;    // the call stopped it (OnHead or OnBody returned false)
};

class HttpCall {
 public:
  virtual ~HttpCall() = default;
  // Fills the request of attempt `attempt` (0 first). An error fails the call at once.
  virtual Status Prepare(int attempt, HttpRequest* request) = 0;
  // The final response head, before its first body byte (or at the end, for no body).
  // false stops the transfer; Finish then sees transfer.stopped.
  virtual bool OnHead(const HttpResponse& /*head*/) { return true; }
  // Body bytes in order; false stops the transfer.
  virtual bool OnBody(const uint8_t* data, size_t size) = 0;
  // The attempt is over. A Retry outcome after the last attempt is returned as the call's
  // error, with " (gave up after N attempts)" appended.
  virtual HttpOutcome Finish(const HttpResponse& head, const HttpTransfer& transfer) = 0;
};

class HttpClient {
 public:
  // Internal for allocation or thread-creation failures; InvalidArgument for options out of
  // range.
  static Result<std::unique_ptr<HttpClient>> Create(const HttpOptions& options);
  ~HttpClient();
  HttpClient(const HttpClient&) = delete;
  HttpClient& operator=(const HttpClient&) = delete;

  // Runs every call to completion and returns the first error (the others are then
  // abandoned: their buffers hold unspecified bytes). When Run returns, no call of the batch
  // is touched again.
  Status Run(std::span<HttpCall* const> calls);
  const HttpOptions& options() const;

  struct Impl;

 private:
  explicit HttpClient(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// The outcome of an attempt the transport ended (transfer.curl_code != 0): IoError naming
// `where` and libcurl's text, retried when the failure was a reset, timeout or refusal.
HttpOutcome TransportOutcome(const std::string& where, const HttpTransfer& transfer);
// The outcome of an HTTP error status: NotFound (404), DataLoss (412: changed since opened),
// IoError otherwise; 408, 429 and 5xx but 501 retried. The <Code> element of an XML error body
// (S3 and compatible stores) is named; the body itself is never printed.
HttpOutcome StatusOutcome(const std::string& where, const HttpResponse& head,
                          std::string_view body);

// The libcurl version this process runs with, e.g. "libcurl/7.88.1 OpenSSL/3.0.19".
std::string HttpBackendVersion();

}  // namespace ferry

#endif  // FERRY_SRC_IO_HTTP_CLIENT_HPP_
