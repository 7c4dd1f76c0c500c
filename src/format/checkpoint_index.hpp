// A sharded checkpoint's index, "model.ferry.index.json" or "model.safetensors.index.json":
// {"metadata": {...}, "weight_map": {"tensor name": "shard file name", ...}}. One strict parser
// for both (bounded size and depth, duplicate keys refused) and one check that every shard
// stays inside the index's directory.
#ifndef FERRY_SRC_FORMAT_CHECKPOINT_INDEX_HPP_
#define FERRY_SRC_FORMAT_CHECKPOINT_INDEX_HPP_

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ferry/status.hpp"
#include "io/url.hpp"

namespace ferry {

struct CheckpointIndex {
  std::string path;      // as messages print it (a URL without its query string)
  std::string location;  // as given: shards lie beside it (SiblingName)
  // Shard file names as the index writes them, unique, in byte order: every process numbers
  // the shards alike.
  std::vector<std::string> shard_files;
  // (tensor name, shard number), in tensor name (byte) order.
  std::vector<std::pair<std::string, uint32_t>> weight_map;
  // "metadata", values as JSON text unless they are strings.
  std::vector<std::pair<std::string, std::string>> metadata;

  std::string ShardPath(size_t shard) const { return SiblingName(location, shard_files[shard]); }
};

// Reads and validates an index file, a local path or a URL (through OpenSource with
// `options`). Every error is DataLoss (NotFound / IoError for the file itself) and reads
// "<path>: bad checkpoint index: <what>".
Result<CheckpointIndex> ReadCheckpointIndex(const std::string& path,
                                            const SourceOptions& options = {});

// True when `name` stays inside a directory: relative, and no component empty, "." or "..".
// A hostile index must not make the process open /etc/shadow or ../../other_job/ckpt.
bool PlainRelativePath(std::string_view name);

// The directory part of `path` ("." when it has none).
std::string DirOf(const std::string& path);

}  // namespace ferry

#endif  // FERRY_SRC_FORMAT_CHECKPOINT_INDEX_HPP_
