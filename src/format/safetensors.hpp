// safetensors files (https://github.com/huggingface/safetensors): reading them through the
// ordinary Reader, writing them, and their sharded index.
//
// Layout: u64 little-endian header length N, N bytes of a JSON object (padded with spaces),
// then the data section. Each entry of the object but "__metadata__" describes one tensor:
// {"dtype": "BF16", "shape": [2, 3], "data_offsets": [begin, end]}, offsets relative to the
// data section. "__metadata__" is an object of strings.
#ifndef FERRY_SRC_FORMAT_SAFETENSORS_HPP_
#define FERRY_SRC_FORMAT_SAFETENSORS_HPP_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ferry/ferry.hpp"
#include "io/io.hpp"

namespace ferry {

// A header longer than this is refused before it is parsed (safetensors' own limit).
inline constexpr uint64_t kMaxSafetensorsHeaderBytes = uint64_t{100} << 20;

// True when `file` starts like a safetensors file: 8 bytes of header length, then '{'.
// Says nothing about validity; ParseSafetensors decides that.
bool LooksLikeSafetensors(const uint8_t* file, uint64_t file_size);

// Parses and validates the header of a whole safetensors file image, and builds the
// equivalent TensorFerry index (a FlatBuffers Checkpoint: raw tensors at their absolute file
// offsets, no checksums, metadata from "__metadata__", producer "safetensors") into `index`,
// whose storage keeps it 8-byte aligned. Returns the index's size in bytes. Every error is
// DataLoss (Unimplemented for a dtype TensorFerry cannot represent) and names the file, the
// tensor and the offset. Performs no I/O: the fuzzers' entry point.
Result<uint64_t> ParseSafetensors(const uint8_t* file, uint64_t file_size, const std::string& path,
                                  std::vector<uint64_t>* index);

// The safetensors name of `dtype` ("F8_E4M3" for kF8_E4M3FN, "F4" for kF4_E2M1FN, ...), or
// nullptr when safetensors has none (C128, the one-per-byte F6 types).
const char* SafetensorsDTypeName(DType dtype);
// Inverse of SafetensorsDTypeName.
std::optional<DType> ParseSafetensorsDType(std::string_view name);

// One tensor of a safetensors file being written, in data order.
struct SafetensorsEntry {
  std::string name;
  DType dtype = DType::kU8;
  std::vector<int64_t> shape;
};

// The order the safetensors library itself writes tensors in: by its dtype order, descending
// (widest elements first), then by name. Every tensor then starts at a multiple of its
// element size.
void SortSafetensorsEntries(std::vector<SafetensorsEntry>* entries);

// Writes a safetensors file in one pass: the header goes out at Create, then the tensors'
// bytes, in entry order, through Write. Like Writer, it writes "<path>.tmp.<random>" and
// renames it over `path` at Commit; anything else leaves `path` untouched.
// Move-only; one thread at a time.
class SafetensorsWriter {
 public:
  static Result<SafetensorsWriter> Create(
      const std::string& path, const std::vector<SafetensorsEntry>& entries,
      const std::vector<std::pair<std::string, std::string>>& metadata, bool durable = true);
  SafetensorsWriter(SafetensorsWriter&&) noexcept;
  SafetensorsWriter& operator=(SafetensorsWriter&&) noexcept;
  ~SafetensorsWriter();

  // Appends the next bytes of the data section (tensors back to back, in entry order).
  Status Write(const void* data, size_t size);
  // Fails unless exactly every tensor's bytes were written.
  Status Commit();
  void Abort();

  uint64_t data_bytes() const;
  uint64_t header_bytes() const;  // including the 8-byte length

 private:
  struct State;
  explicit SafetensorsWriter(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

// A sharded checkpoint's "model.safetensors.index.json": {"metadata": {...}, "weight_map":
// {"tensor name": "shard file name", ...}}.
struct SafetensorsIndex {
  std::string path;
  // Shard files, resolved against the index's directory, in name order.
  std::vector<std::string> shards;
  // (tensor name, position in `shards`), in tensor name order.
  std::vector<std::pair<std::string, size_t>> weight_map;
  // "metadata", values as JSON text unless they are strings.
  std::vector<std::pair<std::string, std::string>> metadata;
};

// Reads and validates an index file: a JSON object with an object "weight_map" of strings;
// shard names must stay inside the index's directory.
Result<SafetensorsIndex> ReadSafetensorsIndex(const std::string& path);

// The two formats a conversion writes.
enum class OutputFormat { kTensorFerry, kSafetensors };

// The format to write `path` in: `to` when given ("ferry", "tensorferry" or "safetensors"),
// else by the extension, ".ferry" or ".safetensors". Any other name is refused rather than
// given TensorFerry bytes by default: out.pt, pytorch_model.bin or a typo like
// model.safetensor would hold a file that torch or safetensors cannot read. InvalidArgument
// names the path and says how to choose; also for a `to` that contradicts the extension.
// Every conversion (`ferry convert`, ferry_convert, tensorferry.convert) asks this.
Result<OutputFormat> ChooseOutputFormat(const std::string& path, std::string_view to = {});

}  // namespace ferry

#endif  // FERRY_SRC_FORMAT_SAFETENSORS_HPP_
