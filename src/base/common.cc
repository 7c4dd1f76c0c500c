// Status, dtype and version helpers shared by every layer.
#include <cstring>

#include "base/util.hpp"
#include "ferry/ferry.hpp"

namespace ferry {

const char* StatusCodeName(StatusCode code) {
  switch (code) {
    case StatusCode::kOk:
      return "OK";
    case StatusCode::kInvalidArgument:
      return "InvalidArgument";
    case StatusCode::kNotFound:
      return "NotFound";
    case StatusCode::kDataLoss:
      return "DataLoss";
    case StatusCode::kResourceExhausted:
      return "ResourceExhausted";
    case StatusCode::kUnimplemented:
      return "Unimplemented";
    case StatusCode::kInternal:
      return "Internal";
    case StatusCode::kCudaError:
      return "CudaError";
    case StatusCode::kIoError:
      return "IoError";
  }
  return "Unknown";
}

std::string Status::ToString() const {
  if (ok()) return "OK";
  return StrCat(StatusCodeName(code_), ": ", message_);
}

std::string EscapeBytes(std::string_view text, std::string_view also) {
  std::string out;
  out.reserve(text.size());
  for (unsigned char c : text) {
    if (c < 0x20 || c == 0x7f || also.find(static_cast<char>(c)) != std::string_view::npos) {
      static const char kHex[] = "0123456789abcdef";
      out += "\\x";
      out += kHex[c >> 4];
      out += kHex[c & 15];
    } else {
      out += static_cast<char>(c);
    }
  }
  return out;
}

std::string Quote(std::string_view name) { return "'" + EscapeBytes(name, "'\\") + "'"; }

std::string ErrnoText(int err) {
  char buf[256];
  // GNU strerror_r may return a static string instead of filling buf.
  const char* text = strerror_r(err, buf, sizeof(buf));
  return StrCat("(", text, ", errno ", err, ")");
}

int ErrnoIn(std::string_view message) {
  constexpr std::string_view kMark = ", errno ";
  for (size_t at = message.rfind(kMark); at != std::string_view::npos;
       at = at == 0 ? std::string_view::npos : message.rfind(kMark, at - 1)) {
    int err = 0;
    size_t i = at + kMark.size();
    const size_t first = i;
    while (i < message.size() && i - first < 6 && message[i] >= '0' && message[i] <= '9') {
      err = err * 10 + (message[i++] - '0');
    }
    if (i > first && i < message.size() && message[i] == ')') return err;
  }
  return 0;
}

const char* VersionString() { return FERRY_VERSION_STRING; }

namespace {
struct DTypeRow {
  const char* name;
  int bits;
};
constexpr DTypeRow kDTypes[kNumDTypes] = {
    {"BOOL", 8},      {"U8", 8},        {"U16", 16},       {"U32", 32},        {"U64", 64},
    {"I8", 8},        {"I16", 16},      {"I32", 32},       {"I64", 64},        {"F16", 16},
    {"BF16", 16},     {"F32", 32},      {"F64", 64},       {"C64", 64},        {"C128", 128},
    {"F8_E4M3FN", 8}, {"F8_E5M2", 8},   {"F8_E8M0FNU", 8}, {"F8_E4M3FNUZ", 8}, {"F8_E5M2FNUZ", 8},
    {"F6_E2M3FN", 8}, {"F6_E3M2FN", 8}, {"F4_E2M1FN", 4},
};
}  // namespace

bool IsValidDType(uint8_t value) { return value < kNumDTypes; }

const char* DTypeName(DType dtype) {
  auto v = static_cast<uint8_t>(dtype);
  return IsValidDType(v) ? kDTypes[v].name : "?";
}

std::optional<DType> ParseDType(std::string_view name) {
  for (int i = 0; i < kNumDTypes; ++i) {
    if (name == kDTypes[i].name) return static_cast<DType>(i);
  }
  return std::nullopt;
}

int DTypeStorageBits(DType dtype) {
  auto v = static_cast<uint8_t>(dtype);
  return IsValidDType(v) ? kDTypes[v].bits : 0;
}

std::optional<uint64_t> StorageBytes(DType dtype, uint64_t numel) {
  int bits = DTypeStorageBits(dtype);
  if (bits == 0) return std::nullopt;
  if (bits == 4) return numel / 2 + (numel & 1);
  uint64_t out;
  if (MulOverflows(numel, static_cast<uint64_t>(bits / 8), &out)) return std::nullopt;
  return out;
}

std::optional<uint64_t> NumElements(const std::vector<int64_t>& shape) {
  uint64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0) return std::nullopt;
    if (MulOverflows(n, static_cast<uint64_t>(d), &n)) return std::nullopt;
  }
  return n;
}

const char* EncodingName(Encoding encoding) {
  switch (encoding) {
    case Encoding::kRaw:
      return "raw";
    case Encoding::kZstd:
      return "zstd";
    case Encoding::kShuffleZstd:
      return "shuffle+zstd";
    case Encoding::kPlanes:
      return "planes";
  }
  return "?";
}

}  // namespace ferry
