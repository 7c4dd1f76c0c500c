// What a file appears to be from its first bytes (src/format/sniff.hpp).
#include "format/sniff.hpp"

#include <algorithm>
#include <cstring>
#include <string_view>

#include "base/util.hpp"
#include "format/format.hpp"

namespace ferry {

namespace {

constexpr uint8_t kZipLocal[4] = {'P', 'K', 3, 4};
constexpr uint8_t kZipEnd[4] = {'P', 'K', 5, 6};  // an empty archive: its end record alone
// The number torch.save's legacy format opens with (a pickled LONG1 after PROTO).
constexpr uint8_t kLegacyTorchMagic[10] = {0x6c, 0xfc, 0x9c, 0x46, 0xf9,
                                           0x20, 0x6a, 0xa8, 0x50, 0x19};
// Text is judged on this many leading bytes; a sharded index's "weight_map" is looked for in
// all that were read.
constexpr uint64_t kTextWindow = 4096;
// A safetensors header length above this is no header length (the format caps it at 100 MB).
constexpr uint64_t kMaxPlausibleHeader = uint64_t{1} << 32;

bool IsSpace(uint8_t c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

bool Contains(const uint8_t* p, uint64_t n, std::string_view what) {
  std::string_view all(reinterpret_cast<const char*>(p), n);
  return all.find(what) != std::string_view::npos;
}

// Control bytes other than whitespace and form feed do not occur in text; bytes from 0x80 up
// may be UTF-8 (or another encoding) and are let through.
bool LooksLikeText(const uint8_t* p, uint64_t n) {
  if (n == 0) return false;
  for (uint64_t i = 0; i < std::min(n, kTextWindow); ++i) {
    const uint8_t c = p[i];
    if ((c < 0x20 && !IsSpace(c) && c != '\f') || c == 0x7f) return false;
  }
  return true;
}

}  // namespace

FileKind SniffFile(const uint8_t* head, uint64_t n) {
  if (n >= format::kMagicSize && std::memcmp(head, format::kMagic, format::kMagicSize) == 0) {
    return FileKind::kTensorFerry;
  }
  if (n >= 4 && (std::memcmp(head, kZipLocal, 4) == 0 || std::memcmp(head, kZipEnd, 4) == 0)) {
    // torch.save names every entry "<archive>/..." and writes data.pkl first.
    return Contains(head, n, "data.pkl") ? FileKind::kTorchZip : FileKind::kZip;
  }
  if (n >= 4 + sizeof(kLegacyTorchMagic) && head[0] == 0x80 && head[2] == 0x8a &&
      head[3] == sizeof(kLegacyTorchMagic) &&
      std::memcmp(head + 4, kLegacyTorchMagic, sizeof(kLegacyTorchMagic)) == 0) {
    return FileKind::kTorchLegacy;
  }
  if (n >= 3 && head[0] == 0x80 && head[1] >= 2 && head[1] <= 5) return FileKind::kPickle;
  uint64_t length = 0;  // a safetensors header length, little-endian, on little-endian hosts
  if (n >= 8) std::memcpy(&length, head, 8);
  if (n >= 9 && length < kMaxPlausibleHeader) {
    uint64_t i = 8;
    while (i < n && IsSpace(head[i])) ++i;
    if (i < n && head[i] == '{') return FileKind::kSafetensors;
  }
  uint64_t start = n >= 3 && std::memcmp(head, "\xef\xbb\xbf", 3) == 0 ? 3 : 0;  // a BOM
  if (!LooksLikeText(head + start, n - start)) return FileKind::kUnknown;
  while (start < n && IsSpace(head[start])) ++start;
  if (start < n && (head[start] == '{' || head[start] == '[')) {
    return Contains(head, n, "\"weight_map\"") ? FileKind::kShardedIndex : FileKind::kJson;
  }
  return FileKind::kText;
}

std::string ForeignFileHint(FileKind kind, const std::string& path) {
  // The path as one shell word, so the command shown can be pasted.
  std::string word = path;
  if (path.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
                             "_-./+,:@%=") != std::string::npos) {
    word = "'";
    for (char c : path) word += c == '\'' ? std::string("'\\''") : std::string(1, c);
    word += "'";
  }
  const std::string convert =
      StrCat("convert it with `ferry convert ", word, " out.ferry` (Python: tensorferry.convert)");
  switch (kind) {
    case FileKind::kTorchZip:
      return StrCat("looks like a PyTorch checkpoint (a zip archive, as torch.save writes): ",
                    convert);
    case FileKind::kTorchLegacy:
      // The importer reads zip archives only.
      return "looks like a PyTorch checkpoint in torch.save's legacy format, which TensorFerry "
             "does not read: load it with torch.load and save it with "
             "tensorferry.torch.save_state_dict (or again with a current torch.save)";
    case FileKind::kZip:
      return "looks like a zip archive (an .npz or another archive), not a checkpoint";
    case FileKind::kPickle:
      return "looks like a Python pickle, which TensorFerry never runs: load it with the "
             "program that wrote it and save its tensors with tensorferry";
    case FileKind::kSafetensors:
      return "looks like a safetensors file whose header length does not fit the file "
             "(truncated or damaged)";
    case FileKind::kShardedIndex:
      return StrCat(
          "looks like the index of a sharded checkpoint (JSON with a weight_map): open it as "
          "one (ShardedCheckpoint::Open, ferry_sharded_open, "
          "tensorferry.distributed.open_checkpoint) or merge its shards into one file with "
          "`ferry convert ",
          word, " out.ferry`");
    case FileKind::kJson:
      return "looks like a JSON file, not a checkpoint";
    case FileKind::kText:
      return "looks like a text file, not a checkpoint";
    case FileKind::kTensorFerry:
    case FileKind::kUnknown:
      break;
  }
  return "";
}

std::optional<Status> ForeignFileError(const uint8_t* head, uint64_t head_size,
                                       const std::string& path) {
  const FileKind kind = SniffFile(head, head_size);
  std::string hint = ForeignFileHint(kind, path);
  if (hint.empty()) return std::nullopt;
  // A damaged safetensors file is damaged; the others are whole files of another kind.
  const StatusCode code =
      kind == FileKind::kSafetensors ? StatusCode::kDataLoss : StatusCode::kInvalidArgument;
  return Error(code, path, ": not a TensorFerry checkpoint: it ", hint);
}

}  // namespace ferry
