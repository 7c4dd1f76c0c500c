// Sharded checkpoints: the JSON index (include/ferry/sharded.hpp) and its shard Readers.
#include "ferry/sharded.hpp"

#include <unistd.h>

#include <algorithm>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "block_source.hpp"
#include "io.hpp"
#include "strict_json.hpp"
#include "util.hpp"

namespace ferry {

namespace {

using Json = nlohmann::json;

// An index lists names and file names only; even 1M tensors stay far below this.
constexpr uint64_t kMaxIndexBytes = uint64_t{256} << 20;

// A shard's name must stay inside the index's directory: a hostile index must not make the
// process open /etc/shadow or ../../other_job/ckpt.
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

std::string BaseName(const std::string& path) {
  size_t slash = path.rfind('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

Result<std::string> ReadSmallFile(const std::string& path) {
  FERRY_ASSIGN_OR_RETURN(File file, File::OpenRead(path));
  FERRY_ASSIGN_OR_RETURN(uint64_t size, file.Size());
  if (size > kMaxIndexBytes) {
    return Error(StatusCode::kDataLoss, path, ": checkpoint index of ", size,
                 " bytes exceeds the limit of ", kMaxIndexBytes);
  }
  std::string text(size, '\0');
  FERRY_RETURN_IF_ERROR(file.PReadAll(text.data(), size, 0));
  return text;
}

}  // namespace

class ShardedCheckpoint::Impl {
 public:
  struct Entry {
    std::string name;
    uint32_t shard;
    size_t index;  // in the shard's Reader
  };
  std::string path;
  std::vector<std::shared_ptr<Reader>> shards;
  std::vector<std::string> shard_names;
  std::vector<Entry> entries;  // sorted by name
  std::vector<std::pair<std::string, std::string>> metadata;

  Status Fail(const std::string& what) const {
    return Error(StatusCode::kDataLoss, path, ": bad checkpoint index: ", what);
  }
};

ShardedCheckpoint::ShardedCheckpoint(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
ShardedCheckpoint::~ShardedCheckpoint() = default;

Result<std::shared_ptr<ShardedCheckpoint>> ShardedCheckpoint::Open(const std::string& index_path,
                                                                   ReaderOptions options) {
  auto impl = std::make_unique<Impl>();
  impl->path = index_path;
  FERRY_ASSIGN_OR_RETURN(std::string text, ReadSmallFile(index_path));
  Json index;
  StrictJsonOptions json;
  // root > metadata > a structured metadata value may nest a little; nothing needs more.
  json.max_depth = 8;
  json.too_deep = "nests deeper than a checkpoint index can";
  if (auto error = ParseStrictJson(text.data(), text.data() + text.size(), json, &index)) {
    return impl->Fail(*error);
  }
  if (!index.is_object()) return impl->Fail("not a JSON object");
  auto wm = index.find("weight_map");
  if (wm == index.end() || !wm->is_object()) {
    return impl->Fail("no \"weight_map\" object (tensor name -> file name)");
  }
  if (auto md = index.find("metadata"); md != index.end()) {
    if (!md->is_object()) return impl->Fail("\"metadata\" is not an object");
    for (const auto& [key, value] : md->items()) {
      impl->metadata.emplace_back(key, value.is_string() ? value.get<std::string>() : value.dump());
    }
  }

  // Shard numbers follow the byte order of the file names, so every process agrees on them.
  std::map<std::string, uint32_t> files;
  for (const auto& [name, file] : wm->items()) {
    if (!file.is_string())
      return impl->Fail(StrCat("tensor ", Quote(name), ": file is not a string"));
    const std::string& f = file.get_ref<const std::string&>();
    if (!PlainRelativePath(f)) {
      return impl->Fail(StrCat("tensor ", Quote(name), ": file ", Quote(f),
                               " is not a relative path inside the index's directory"));
    }
    files.emplace(f, 0);
  }
  const std::string dir = DirOf(index_path);
  for (auto& [f, number] : files) {
    number = static_cast<uint32_t>(impl->shards.size());
    FERRY_ASSIGN_OR_RETURN(auto reader, Reader::Open(dir + "/" + f, options));
    impl->shards.push_back(std::move(reader));
    impl->shard_names.push_back(f);
  }

  size_t in_shards = 0;
  for (const auto& r : impl->shards) in_shards += r->num_tensors();
  impl->entries.reserve(wm->size());
  // Json objects iterate in key (byte) order: entries come out sorted.
  for (const auto& [name, file] : wm->items()) {
    uint32_t s = files.at(file.get_ref<const std::string&>());
    int64_t i = BlocksOf(*impl->shards[s]).IndexOf(name);
    if (i < 0) {
      return impl->Fail(StrCat("maps tensor ", Quote(name), " to ", Quote(impl->shard_names[s]),
                               ", which has no such tensor"));
    }
    impl->entries.push_back(Impl::Entry{name, s, static_cast<size_t>(i)});
  }
  if (in_shards != impl->entries.size()) {
    // Some tensor of some shard is unlisted, or listed under another file: name it.
    for (uint32_t s = 0; s < impl->shards.size(); ++s) {
      const Reader& r = *impl->shards[s];
      for (size_t i = 0; i < r.num_tensors(); ++i) {
        std::string name = r.tensor(i).name;
        auto it = wm->find(name);
        if (it == wm->end()) {
          return impl->Fail(StrCat("tensor ", Quote(name), " of ", Quote(impl->shard_names[s]),
                                   " is not in the weight_map"));
        }
        if (files.at(it->get_ref<const std::string&>()) != s) {
          return impl->Fail(StrCat("tensor ", Quote(name), " is in both ",
                                   Quote(impl->shard_names[s]), " and ",
                                   Quote(it->get_ref<const std::string&>())));
        }
      }
    }
  }
  return std::shared_ptr<ShardedCheckpoint>(new ShardedCheckpoint(std::move(impl)));
}

std::shared_ptr<ShardedCheckpoint> ShardedCheckpoint::FromReader(std::shared_ptr<Reader> reader) {
  auto impl = std::make_unique<Impl>();
  impl->path = reader->path();
  impl->shard_names.push_back(BaseName(reader->path()));
  impl->entries.reserve(reader->num_tensors());
  for (size_t i = 0; i < reader->num_tensors(); ++i) {
    impl->entries.push_back(Impl::Entry{reader->tensor(i).name, 0, i});  // already name-sorted
  }
  impl->shards.push_back(std::move(reader));
  return std::shared_ptr<ShardedCheckpoint>(new ShardedCheckpoint(std::move(impl)));
}

const std::string& ShardedCheckpoint::path() const { return impl_->path; }
size_t ShardedCheckpoint::num_shards() const { return impl_->shards.size(); }
const std::shared_ptr<Reader>& ShardedCheckpoint::shard(size_t i) const {
  return impl_->shards.at(i);
}
const std::string& ShardedCheckpoint::shard_name(size_t i) const {
  return impl_->shard_names.at(i);
}
size_t ShardedCheckpoint::num_tensors() const { return impl_->entries.size(); }

std::vector<std::string> ShardedCheckpoint::names() const {
  std::vector<std::string> out;
  out.reserve(impl_->entries.size());
  for (const auto& e : impl_->entries) out.push_back(e.name);
  return out;
}

Result<ShardedCheckpoint::Location> ShardedCheckpoint::Find(std::string_view name) const {
  const auto& entries = impl_->entries;
  auto it = std::lower_bound(entries.begin(), entries.end(), name,
                             [](const Impl::Entry& e, std::string_view n) { return e.name < n; });
  if (it == entries.end() || it->name != name) {
    return Error(StatusCode::kNotFound, impl_->path, ": no tensor named ", Quote(name));
  }
  Location loc;
  loc.shard = it->shard;
  loc.info = impl_->shards[it->shard]->tensor(it->index);
  return loc;
}

const std::vector<std::pair<std::string, std::string>>& ShardedCheckpoint::metadata() const {
  return impl_->metadata;
}

Status WriteShardIndex(const std::string& index_path, const std::vector<std::string>& shard_files,
                       const std::vector<std::pair<std::string, std::string>>& metadata) {
  const std::string dir = DirOf(index_path);
  nlohmann::ordered_json weight_map = nlohmann::ordered_json::object();
  std::map<std::string, std::string> owner;  // tensor -> file, sorted for a stable index
  uint64_t total = 0;
  for (const std::string& f : shard_files) {
    if (!PlainRelativePath(f)) {
      return Error(StatusCode::kInvalidArgument, index_path, ": shard ", Quote(f),
                   " is not a relative path inside the index's directory");
    }
    FERRY_ASSIGN_OR_RETURN(auto reader, Reader::Open(dir + "/" + f));
    for (size_t i = 0; i < reader->num_tensors(); ++i) {
      TensorInfo info = reader->tensor(i);
      total += info.nbytes;
      auto [it, fresh] = owner.emplace(info.name, f);
      if (!fresh) {
        return Error(StatusCode::kInvalidArgument, index_path, ": tensor ", Quote(info.name),
                     " is in both ", Quote(it->second), " and ", Quote(f));
      }
    }
  }
  for (const auto& [name, f] : owner) weight_map[name] = f;
  nlohmann::ordered_json md = nlohmann::ordered_json::object();
  bool has_total = false;
  for (const auto& [k, v] : metadata) {
    md[k] = v;
    has_total = has_total || k == "total_size";
  }
  if (!has_total) md["total_size"] = total;
  nlohmann::ordered_json index = nlohmann::ordered_json::object();
  index["metadata"] = std::move(md);
  index["weight_map"] = std::move(weight_map);
  std::string text = index.dump(2) + "\n";

  std::string tmp = StrCat(index_path, ".tmp.", ::getpid());
  FERRY_ASSIGN_OR_RETURN(File file, File::CreateExclusive(tmp));
  Status st = file.WriteAll(text.data(), text.size());
  if (st.ok()) st = file.Sync();
  if (st.ok()) st = file.Close();
  if (st.ok()) st = RenameFile(tmp, index_path);
  if (!st.ok()) {
    ::unlink(tmp.c_str());
    return st;
  }
  return SyncParentDir(index_path);
}

}  // namespace ferry
