// Checkpoint indexes (src/format/checkpoint_index.hpp).
#include "format/checkpoint_index.hpp"

#include <map>
#include <nlohmann/json.hpp>

#include "base/strict_json.hpp"
#include "base/util.hpp"
#include "io/source.hpp"

namespace ferry {

namespace {

// An index lists names and file names only; even 1M tensors stay far below this.
constexpr uint64_t kMaxIndexBytes = uint64_t{256} << 20;

// Through the byte-source seam, like the shards it names: an index on a network file system
// or behind a URL is read as they are. Read once, so never mapped.
Result<std::string> ReadIndexText(const std::string& path, SourceOptions options) {
  options.allow_mmap = false;
  FERRY_ASSIGN_OR_RETURN(std::shared_ptr<ByteSource> bytes, OpenSource(path, options));
  const uint64_t size = bytes->size();
  if (size > kMaxIndexBytes) {
    return Error(StatusCode::kDataLoss, bytes->name(), ": checkpoint index of ", size,
                 " bytes exceeds the limit of ", kMaxIndexBytes);
  }
  std::string text(size, '\0');
  FERRY_RETURN_IF_ERROR(bytes->ReadAt(0, size, reinterpret_cast<uint8_t*>(text.data())));
  return text;
}

}  // namespace

bool PlainRelativePath(std::string_view name) {
  if (name.empty() || name.front() == '/' || name.find('\0') != std::string_view::npos) {
    return false;
  }
  size_t start = 0;
  while (start <= name.size()) {
    size_t end = name.find('/', start);
    if (end == std::string_view::npos) end = name.size();
    std::string_view part = name.substr(start, end - start);
    if (part.empty() || part == "." || part == "..") return false;
    start = end + 1;
  }
  return true;
}

std::string DirOf(const std::string& path) {
  size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

Result<CheckpointIndex> ReadCheckpointIndex(const std::string& location,
                                            const SourceOptions& options) {
  const std::string path = IsRemoteName(location) ? PrintableUrl(location) : location;
  auto fail = [&](const std::string& what) {
    return Error(StatusCode::kDataLoss, path, ": bad checkpoint index: ", what);
  };
  FERRY_ASSIGN_OR_RETURN(std::string text, ReadIndexText(location, options));
  nlohmann::json doc;
  StrictJsonOptions json;
  // root > metadata > a structured metadata value may nest a little; nothing needs more.
  json.max_depth = 8;
  json.too_deep = "nests deeper than a checkpoint index can";
  if (auto error = ParseStrictJson(text.data(), text.data() + text.size(), json, &doc)) {
    return fail(*error);
  }
  if (!doc.is_object()) return fail("not a JSON object");
  auto wm = doc.find("weight_map");
  if (wm == doc.end() || !wm->is_object()) {
    return fail("no \"weight_map\" object (tensor name -> file name)");
  }
  CheckpointIndex index;
  index.path = path;
  index.location = location;
  if (auto md = doc.find("metadata"); md != doc.end()) {
    if (!md->is_object()) return fail("\"metadata\" is not an object");
    for (const auto& [key, value] : md->items()) {
      index.metadata.emplace_back(key, value.is_string() ? value.get<std::string>() : value.dump());
    }
  }
  std::map<std::string, uint32_t> files;
  for (const auto& [name, file] : wm->items()) {
    if (!file.is_string()) return fail(StrCat("tensor ", Quote(name), ": file is not a string"));
    const std::string& f = file.get_ref<const std::string&>();
    if (!PlainRelativePath(f)) {
      return fail(StrCat("tensor ", Quote(name), ": file ", Quote(f),
                         " is not a relative path inside the index's directory"));
    }
    files.emplace(f, 0);
  }
  for (auto& [f, number] : files) {
    number = static_cast<uint32_t>(index.shard_files.size());
    index.shard_files.push_back(f);
  }
  index.weight_map.reserve(wm->size());
  // JSON objects iterate in key (byte) order: the map comes out sorted.
  for (const auto& [name, file] : wm->items()) {
    index.weight_map.emplace_back(name, files.at(file.get_ref<const std::string&>()));
  }
  return index;
}

}  // namespace ferry
