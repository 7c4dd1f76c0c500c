// The footer of a file being written, and its trailer: the only place where a writer's records
// become FlatBuffers. Writers hand over plain structs; the builder orders them as the format
// requires (tensors by name, a file-order index), checks the footer's size limit and returns
// the bytes that follow the data section.
#ifndef FERRY_SRC_FORMAT_FOOTER_BUILDER_HPP_
#define FERRY_SRC_FORMAT_FOOTER_BUILDER_HPP_

#include <array>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "ferry/ferry.hpp"
#include "format/format.hpp"

namespace ferry::format {

// How one stored chunk turns into its block's raw bytes. Values equal the schema's ChunkCodec.
enum class ChunkCodec : uint8_t { kStored = 0, kZstd = 1, kPlanes = 2 };

// One stored chunk of an encoded tensor; `offset` is relative to the tensor's data_offset.
struct ChunkRecord {
  uint64_t offset = 0;
  uint64_t stored_size = 0;
  ChunkCodec codec = ChunkCodec::kStored;
};

// What the footer says of one tensor.
struct TensorRecord {
  std::string name;
  DType dtype = DType::kU8;
  std::vector<int64_t> shape;
  uint64_t data_offset = 0;
  uint64_t data_size = 0;
  uint64_t nbytes = 0;
  Encoding encoding = Encoding::kRaw;
  uint64_t block_size = 0;
  std::vector<uint64_t> checksums;    // one per block
  std::vector<ChunkRecord> chunks;    // encoded tensors only
  std::vector<int64_t> global_shape;  // both empty unless the tensor is a slice
  std::vector<int64_t> shard_offset;
};

// Everything a footer holds besides the tensors. Keys are unique (the maps' order is the
// order the format requires).
struct FooterExtras {
  std::map<std::string, QuantizedTensor, std::less<>> quantized;
  std::map<std::string, ScalingState, std::less<>> scaling;
  std::map<std::string, std::string, std::less<>> metadata;
  std::string producer;  // empty: "tensorferry <version>"
};

// The footer's bytes. `tensors` in any order, names unique. ResourceExhausted, naming `path`,
// when the footer outgrows kMaxFooterBytes.
Result<std::vector<uint8_t>> BuildFooter(std::vector<const TensorRecord*> tensors,
                                         const FooterExtras& extras, const std::string& path);

// The trailer that follows `footer`: its length, its XXH3-64 and the magic.
std::array<uint8_t, kTrailerSize> MakeTrailer(const std::vector<uint8_t>& footer);

}  // namespace ferry::format

#endif  // FERRY_SRC_FORMAT_FOOTER_BUILDER_HPP_
