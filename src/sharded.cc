// Sharded checkpoints: the JSON index (include/ferry/sharded.hpp) and its shard Readers.
#include "ferry/sharded.hpp"

#include <unistd.h>

#include <algorithm>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "block_source.hpp"
#include "checkpoint_index.hpp"
#include "io.hpp"
#include "util.hpp"

namespace ferry {

namespace {

std::string BaseName(const std::string& path) {
  size_t slash = path.rfind('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
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

  // Some tensor of some shard is unlisted, or listed under another file: names it.
  Status NameUnlisted() const {
    for (uint32_t s = 0; s < shards.size(); ++s) {
      const Reader& r = *shards[s];
      for (size_t i = 0; i < r.num_tensors(); ++i) {
        std::string name = r.tensor(i).name;
        auto it = std::lower_bound(entries.begin(), entries.end(), name,
                                   [](const Entry& e, const std::string& n) { return e.name < n; });
        if (it == entries.end() || it->name != name) {
          return Fail(StrCat("tensor ", Quote(name), " of ", Quote(shard_names[s]),
                             " is not in the weight_map"));
        }
        if (it->shard != s) {
          return Fail(StrCat("tensor ", Quote(name), " is in both ", Quote(shard_names[s]), " and ",
                             Quote(shard_names[it->shard])));
        }
      }
    }
    return Status::Ok();
  }
};

ShardedCheckpoint::ShardedCheckpoint(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
ShardedCheckpoint::~ShardedCheckpoint() = default;

Result<std::shared_ptr<ShardedCheckpoint>> ShardedCheckpoint::Open(const std::string& index_path,
                                                                   ReaderOptions options) {
  auto impl = std::make_unique<Impl>();
  impl->path = index_path;
  FERRY_ASSIGN_OR_RETURN(CheckpointIndex index, ReadCheckpointIndex(index_path));
  impl->metadata = std::move(index.metadata);
  for (size_t s = 0; s < index.shard_files.size(); ++s) {
    FERRY_ASSIGN_OR_RETURN(auto reader, Reader::Open(index.ShardPath(s), options));
    impl->shards.push_back(std::move(reader));
    impl->shard_names.push_back(index.shard_files[s]);
  }
  size_t in_shards = 0;
  for (const auto& r : impl->shards) in_shards += r->num_tensors();
  impl->entries.reserve(index.weight_map.size());
  for (auto& [name, s] : index.weight_map) {
    int64_t i = BlocksOf(*impl->shards[s]).IndexOf(name);
    if (i < 0) {
      return impl->Fail(StrCat("maps tensor ", Quote(name), " to ", Quote(impl->shard_names[s]),
                               ", which has no such tensor"));
    }
    impl->entries.push_back(Impl::Entry{std::move(name), s, static_cast<size_t>(i)});
  }
  if (in_shards != impl->entries.size()) FERRY_RETURN_IF_ERROR(impl->NameUnlisted());
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
