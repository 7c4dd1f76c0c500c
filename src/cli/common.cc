// Formatting, size parsing and the progress display shared by the subcommands.
#include <sys/ioctl.h>
#include <unistd.h>

#include <cctype>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <nlohmann/json.hpp>

#include "cli.hpp"

namespace ferry::cli {

bool g_quiet = false;

namespace {

volatile std::sig_atomic_t g_interrupt = 0;

void OnInterrupt(int sig) {
  if (g_interrupt != 0) {
    // Asked twice: stop now, as the default action would.
    ::signal(sig, SIG_DFL);
    ::raise(sig);
    return;
  }
  g_interrupt = sig;
}

}  // namespace

void CatchInterrupts() {
  for (int sig : {SIGINT, SIGTERM}) {
    struct sigaction old = {};
    if (::sigaction(sig, nullptr, &old) == 0 && old.sa_handler == SIG_IGN) continue;
    struct sigaction sa = {};
    sa.sa_handler = OnInterrupt;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;  // reads and writes in flight finish; the job checks between them
    ::sigaction(sig, &sa, nullptr);
  }
}

int InterruptSignal() { return static_cast<int>(g_interrupt); }

std::optional<Encoding> ParseEncoding(std::string_view name) {
  for (Encoding e : {Encoding::kRaw, Encoding::kZstd, Encoding::kShuffleZstd, Encoding::kPlanes}) {
    if (name == EncodingName(e)) return e;
  }
  if (name == "shuffle_zstd") return Encoding::kShuffleZstd;
  return std::nullopt;
}

void PrintJson(const nlohmann::ordered_json& document) {
  std::string text = document.dump(2, ' ', /*ensure_ascii=*/true,
                                   nlohmann::ordered_json::error_handler_t::replace);
  std::fwrite(text.data(), 1, text.size(), stdout);
  std::fputc('\n', stdout);
}

int Fail(const Status& status) {
  // Messages quote names already; this catches anything else from a file (parser excerpts).
  std::fprintf(stderr, "ferry: %s\n", Printable(status.ToString()).c_str());
  return kExitFailure;
}

std::string Printable(std::string_view text) {
  static const char kHex[] = "0123456789abcdef";
  std::string out;
  out.reserve(text.size());
  auto escape = [&](unsigned char c) {
    out += "\\x";
    out += kHex[c >> 4];
    out += kHex[c & 15];
  };
  const auto* s = reinterpret_cast<const unsigned char*>(text.data());
  const size_t n = text.size();
  for (size_t i = 0; i < n;) {
    unsigned char c = s[i];
    if (c < 0x80) {
      if (c < 0x20 || c == 0x7f) {
        escape(c);
      } else {
        out += static_cast<char>(c);
      }
      ++i;
      continue;
    }
    // The length of a well-formed UTF-8 sequence starting here (RFC 3629), else 0.
    size_t len = 0;
    uint32_t cp = 0;
    if (c >= 0xc2 && c <= 0xdf) {
      len = 2, cp = c & 0x1f;
    } else if (c >= 0xe0 && c <= 0xef) {
      len = 3, cp = c & 0x0f;
    } else if (c >= 0xf0 && c <= 0xf4) {
      len = 4, cp = c & 0x07;
    }
    bool ok = len > 0 && i + len <= n;
    for (size_t k = 1; ok && k < len; ++k) {
      ok = (s[i + k] & 0xc0) == 0x80;
      cp = (cp << 6) | (s[i + k] & 0x3f);
    }
    ok = ok && !(len == 3 && (cp < 0x800 || (cp >= 0xd800 && cp <= 0xdfff))) &&
         !(len == 4 && (cp < 0x10000 || cp > 0x10ffff)) && !(cp >= 0x80 && cp <= 0x9f);
    if (!ok) {
      escape(c);
      ++i;
      continue;
    }
    out.append(text.data() + i, len);
    i += len;
  }
  return out;
}

std::string HumanBytes(uint64_t bytes) {
  static const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  if (bytes < 1024) return std::to_string(bytes) + " B";
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024 && u < 5) {
    v /= 1024;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.2f %s", v, kUnits[u]);
  return buf;
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i > 0) out += ", ";
    out += std::to_string(shape[i]);
  }
  return out + "]";
}

std::string Rate(double bytes, double seconds) {
  char buf[32];
  if (seconds <= 0) return "-";
  std::snprintf(buf, sizeof(buf), "%.2f GB/s", bytes / seconds / 1e9);
  return buf;
}

std::optional<uint64_t> ParseSize(const std::string& text) {
  size_t i = 0;
  while (i < text.size() && (std::isdigit(static_cast<unsigned char>(text[i])) || text[i] == '.'))
    ++i;
  if (i == 0) return std::nullopt;
  double value;
  try {
    value = std::stod(text.substr(0, i));
  } catch (...) {
    return std::nullopt;
  }
  std::string unit = text.substr(i);
  while (!unit.empty() && unit.front() == ' ') unit.erase(0, 1);
  for (char& c : unit) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  double scale = 1;
  if (!unit.empty() && unit != "B") {
    static const std::string kPrefixes = "KMGTP";
    size_t p = kPrefixes.find(unit[0]);
    if (p == std::string::npos) return std::nullopt;
    std::string rest = unit.substr(1);
    // "GB" is decimal; "G", "GI", "GIB" binary (what people mean by 1G of tensors).
    double base = rest == "B" ? 1000.0 : 1024.0;
    if (!rest.empty() && rest != "B" && rest != "I" && rest != "IB") return std::nullopt;
    scale = std::pow(base, static_cast<double>(p + 1));
  }
  double bytes = value * scale;
  if (!(bytes >= 0) || bytes >= 1.8e19) return std::nullopt;
  return static_cast<uint64_t>(std::llround(bytes));
}

// ---- Progress -----------------------------------------------------------------------------

namespace {

// Asked at every redraw: the terminal may have been resized.
size_t TerminalColumns() {
  struct winsize ws = {};
  if (::ioctl(STDERR_FILENO, TIOCGWINSZ, &ws) == 0 && ws.ws_col > 0) return ws.ws_col;
  const char* columns = std::getenv("COLUMNS");
  int n = columns ? std::atoi(columns) : 0;
  return n > 0 ? static_cast<size_t>(n) : 80;
}

}  // namespace

Progress::Progress(std::string label, uint64_t total)
    : label_(std::move(label)),
      total_(total),
      tty_(::isatty(STDERR_FILENO) == 1),
      quiet_(g_quiet),
      start_(std::chrono::steady_clock::now()),
      last_(start_) {}

Progress::~Progress() { Finish(); }

double Progress::seconds() const {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
}

void Progress::Add(uint64_t bytes) {
  uint64_t done = done_.fetch_add(bytes, std::memory_order_relaxed) + bytes;
  auto now = std::chrono::steady_clock::now();
  if (now - start_ < std::chrono::seconds(1)) return;
  // Whoever holds the lock draws; the others move on rather than queue behind the terminal.
  if (quiet_) return;
  std::unique_lock<std::mutex> lock(mu_, std::try_to_lock);
  if (!lock.owns_lock() || finished_) return;
  auto gap = tty_ ? std::chrono::milliseconds(100) : std::chrono::milliseconds(10000);
  if (shown_ && now - last_ < gap) return;
  last_ = now;
  Render(done, now);
}

void Progress::Render(uint64_t done, std::chrono::steady_clock::time_point now) {
  double secs = std::chrono::duration<double>(now - start_).count();
  double frac = total_ == 0 ? 1.0 : std::min(1.0, static_cast<double>(done) / total_);
  if (tty_) {
    double rate = secs > 0 ? done / secs : 0;
    double eta = rate > 0 ? (static_cast<double>(total_) - done) / rate : 0;
    char percent[16], eta_text[48];
    std::snprintf(percent, sizeof(percent), " %3d%%", static_cast<int>(frac * 100));
    std::snprintf(eta_text, sizeof(eta_text), "  ETA %.0f s", eta);
    // One column short of the width: writing the last column makes some terminals wrap.
    const size_t room = TerminalColumns() - 1;
    // Whole fields only, the most telling first; one that does not fit is left out with all
    // after it, so a narrow terminal shows fewer numbers, never a number cut short.
    std::string tail;
    for (const std::string& field :
         {std::string(percent), " " + HumanBytes(done) + " / " + HumanBytes(total_),
          "  " + Rate(done, secs), std::string(eta_text)}) {
      if (label_.size() + tail.size() + field.size() > room) break;
      tail += field;
    }
    std::string line = label_;
    const size_t fixed = line.size() + 3 + tail.size();  // " [" and "]"
    if (fixed + 10 <= room) {
      size_t width = std::min<size_t>(30, room - fixed);
      size_t filled = static_cast<size_t>(frac * width);
      line += " [" + std::string(filled, '#') + std::string(width - filled, '.') + "]";
    }
    line += tail;
    if (line.size() > room) line.resize(room);  // only the label, on a very narrow terminal
    std::fprintf(stderr, "\r\033[K%s", line.c_str());
  } else {
    std::fprintf(stderr, "%s: %d%% (%s of %s, %.0f s)\n", label_.c_str(),
                 static_cast<int>(frac * 100), HumanBytes(done).c_str(), HumanBytes(total_).c_str(),
                 secs);
  }
  std::fflush(stderr);
  shown_ = true;
}

void Progress::Finish() {
  std::lock_guard<std::mutex> lock(mu_);
  if (finished_) return;
  finished_ = true;
  if (tty_ && shown_) {
    std::fprintf(stderr, "\r\033[K");
    std::fflush(stderr);
  }
}

}  // namespace ferry::cli
