// What a file that is not a TensorFerry checkpoint appears to be, from its first bytes: the
// reader's error then says "looks like a PyTorch checkpoint ... convert it with ..." instead
// of a bad magic number, which reads like corruption.
#ifndef FERRY_SRC_FORMAT_SNIFF_HPP_
#define FERRY_SRC_FORMAT_SNIFF_HPP_

#include <cstdint>
#include <optional>
#include <string>

#include "ferry/status.hpp"

namespace ferry {

enum class FileKind {
  kUnknown,
  kTensorFerry,
  kTorchZip,      // a zip archive holding a data.pkl: torch.save's format since PyTorch 1.6
  kZip,           // another zip archive (an .npz, a jar, ...)
  kTorchLegacy,   // torch.save's legacy format: a pickle after its magic number
  kPickle,        // another Python pickle (protocol 2 to 5)
  kSafetensors,   // a header length, then a JSON object (perhaps after whitespace)
  kShardedIndex,  // JSON with a "weight_map": model.safetensors.index.json and the like
  kJson,          // another JSON object or array
  kText,          // printable text
};

// The kind of a file whose first `n` bytes are `head` (as many as there are, 64 KiB is
// plenty; fewer only make text and JSON less certain). Pure: no I/O.
FileKind SniffFile(const uint8_t* head, uint64_t n);

// For a kind other than kTensorFerry and kUnknown: what the file looks like and, where
// TensorFerry can convert or open it, how. `path` is put in the command shown. Empty for
// kTensorFerry and kUnknown.
std::string ForeignFileHint(FileKind kind, const std::string& path);

// The reader's error for a file that is not a checkpoint but recognisably something else
// (InvalidArgument; DataLoss for a damaged safetensors file): "<path>: not a TensorFerry
// checkpoint: it looks like ...". Nothing when the bytes are unrecognised.
std::optional<Status> ForeignFileError(const uint8_t* head, uint64_t head_size,
                                       const std::string& path);

}  // namespace ferry

#endif  // FERRY_SRC_FORMAT_SNIFF_HPP_
