// Sharded checkpoints: the JSON index (include/ferry/sharded.hpp) and its shard Readers.
#include "ferry/sharded.hpp"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <set>

#include "base/util.hpp"
#include "base/worker_pool.hpp"
#include "format/block_source.hpp"
#include "format/checkpoint_index.hpp"
#include "io/io.hpp"
#include "io/source.hpp"
#include "io/temp_file.hpp"

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
  FERRY_ASSIGN_OR_RETURN(CheckpointIndex index,
                         ReadCheckpointIndex(index_path, ToSourceOptions(options.storage)));
  impl->path = index.path;
  impl->metadata = std::move(index.metadata);
  const size_t n = index.shard_files.size();
  impl->shards.resize(n);
  impl->shard_names = index.shard_files;
  // Each remote open costs round trips (the opening request, then the footer): shards on an
  // object store open a few at a time. Local files open in order, as fast as that.
  const int threads = IsRemoteName(index_path) ? static_cast<int>(std::min<size_t>(n, 8)) : 1;
  std::vector<Status> failed(n);
  std::atomic<size_t> next{0};
  auto open_shards = [&](int) {
    for (size_t s; (s = next.fetch_add(1)) < n;) {
      auto reader = Reader::Open(index.ShardPath(s), options);
      if (reader.ok()) {
        impl->shards[s] = std::move(reader).value();
      } else {
        failed[s] = reader.status();
      }
    }
  };
  if (threads > 1) {
    FERRY_ASSIGN_OR_RETURN(std::unique_ptr<WorkerPool> pool, WorkerPool::Create(threads));
    pool->Run(open_shards);
  } else {
    open_shards(0);
  }
  for (const Status& st : failed) FERRY_RETURN_IF_ERROR(st);
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

  // The same destination rules as every checkpoint writer (ReplaceTarget): through a link,
  // never over a directory, FIFO or device. The temporary file is theirs too (locked, swept
  // when its writer is gone), and so are the messages: they name the index, not the
  // temporary file.
  FERRY_ASSIGN_OR_RETURN(TempFile temp, BeginReplace(index_path));
  const std::string& dest = temp.dest;
  File& file = temp.file;
  Status st = file.WriteAll(text.data(), text.size());
  if (st.ok()) st = file.Sync();
  if (st.ok()) st = KeepPermissions(file, dest);
  if (st.ok()) st = file.Close();
  if (st.ok()) st = RenameFile(temp.path, dest);
  if (!st.ok()) ::unlink(temp.path.c_str());
  (void)temp.lock.Close();
  FERRY_RETURN_IF_ERROR(st);
  return SyncParentDir(dest);
}

// ---- ShardedSave --------------------------------------------------------------------------

namespace {

std::string IndexStem(const std::string& index_path) {
  std::string base = BaseName(index_path);
  for (const char* suffix : {".ferry.index.json", ".index.json", ".json"}) {
    std::string_view sv(suffix);
    if (base.size() > sv.size() && base.compare(base.size() - sv.size(), sv.size(), sv) == 0) {
      return base.substr(0, base.size() - sv.size());
    }
  }
  return base;
}

std::string ShardName(const std::string& stem, uint64_t id, int rank, int nranks) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "-%016llx-%05d-of-%05d.ferry",
                static_cast<unsigned long long>(id), rank + 1, nranks);
  return stem + buf;
}

// "<stem>-<16 hex>-<5 digits>-of-<5 digits>.ferry": a file ShardedSave made for this stem.
bool IsSaveShard(const std::string& stem, const std::string& name) {
  // '#' stands for a lowercase hex digit, '9' for a decimal digit.
  const std::string_view form = "-################-99999-of-99999.ferry";
  if (name.size() != stem.size() + form.size() || name.compare(0, stem.size(), stem) != 0) {
    return false;
  }
  for (size_t i = 0; i < form.size(); ++i) {
    const char c = name[stem.size() + i];
    const bool ok = form[i] == '#'   ? (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f')
                    : form[i] == '9' ? c >= '0' && c <= '9'
                                     : c == form[i];
    if (!ok) return false;
  }
  return true;
}

// File names of the index at `path` (empty when there is none or it does not parse).
std::set<std::string> IndexedFiles(const std::string& path) {
  std::set<std::string> out;
  auto index = ReadCheckpointIndex(path);
  if (index.ok()) out.insert(index->shard_files.begin(), index->shard_files.end());
  return out;
}

}  // namespace

class ShardedSave::Impl {
 public:
  std::string index_path, dir, stem, shard_path;
  SaveGroup group;
  ShardedSaveOptions options;
  uint64_t id = 0;
  std::optional<Writer> writer;
  std::optional<SaveHandle> pending;  // CommitAsync's shard commit
  Status async_error;                 // CommitAsync failed before handing anything off
  bool done = false;

  Status Where(const Status& st) const {
    return st.ok() ? st : Error(st.code(), index_path, ": rank ", group.rank, ": ", st.message());
  }

  // Max over ranks of one word; the call itself failing counts as a failure of this rank.
  Result<uint64_t> Agree(uint64_t mine) {
    uint64_t w = mine;
    FERRY_RETURN_IF_ERROR(group.all_reduce_max(&w, 1));
    return w;
  }

  std::vector<std::string> ShardNames() const {
    std::vector<std::string> names;
    for (int r = 0; r < group.nranks; ++r) names.push_back(ShardName(stem, id, r, group.nranks));
    return names;
  }

  // After this rank's shard commit: agree, write the index, agree again.
  Status Conclude(Status mine) {
    done = true;
    auto any_failed = Agree(mine.ok() ? 0 : 1);
    Status st = mine;
    if (st.ok() && !any_failed.ok()) st = any_failed.status();
    if (st.ok() && *any_failed != 0) {
      st = Error(StatusCode::kInternal, index_path, ": rank ", group.rank,
                 ": another rank failed to write its shard (its error says why)");
    }
    Status index_st;
    std::set<std::string> replaced;
    if (group.rank == 0 && any_failed.ok() && *any_failed == 0) {
      if (options.remove_replaced) replaced = IndexedFiles(index_path);
      index_st = WriteShardIndex(index_path, ShardNames(), options.metadata);
      // The replaced checkpoint's shards go now, before the last agreement, not after it:
      // every rank then returns from the save only once they are gone, so a rank that looks
      // at the folder (or starts the next save) right away never finds them, whatever the
      // timing. The index already names the new shards, so a crash here loses nothing.
      if (index_st.ok()) {
        const std::vector<std::string> names = ShardNames();
        const std::set<std::string> keep(names.begin(), names.end());
        for (const std::string& f : replaced) {
          if (!keep.count(f) && IsSaveShard(stem, f)) ::unlink((dir + "/" + f).c_str());
        }
      }
    }
    auto index_failed = Agree(index_st.ok() ? 0 : 1);
    if (st.ok()) {
      if (!index_st.ok()) {
        st = index_st;
      } else if (!index_failed.ok()) {
        st = index_failed.status();
      } else if (*index_failed != 0) {
        st = Error(StatusCode::kInternal, index_path, ": rank ", group.rank,
                   ": rank 0 failed to write the index (its error says why)");
      }
    }
    if (!st.ok()) {
      // The index names the previous checkpoint (or nothing): this shard is garbage.
      ::unlink(shard_path.c_str());
      return st;
    }
    return Status::Ok();
  }
};

ShardedSave::ShardedSave(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
ShardedSave::~ShardedSave() = default;

Result<std::unique_ptr<ShardedSave>> ShardedSave::Begin(const std::string& index_path,
                                                        SaveGroup group,
                                                        ShardedSaveOptions options) {
  if (!group.all_reduce_max || group.nranks < 1 || group.rank < 0 || group.rank >= group.nranks ||
      group.nranks > 99999) {
    return Error(StatusCode::kInvalidArgument, index_path, ": bad SaveGroup (rank ", group.rank,
                 " of ", group.nranks, ", all_reduce_max ", group.all_reduce_max ? "set" : "unset",
                 ")");
  }
  auto impl = std::make_unique<Impl>();
  impl->index_path = index_path;
  impl->dir = DirOf(index_path);
  impl->stem = IndexStem(index_path);
  impl->group = std::move(group);
  impl->options = std::move(options);
  // A fresh id for this save's file names, drawn by rank 0 and shared through the maximum.
  uint64_t id = 0;
  if (impl->group.rank == 0) {
    std::random_device rd;
    while (id == 0) id = (uint64_t{rd()} << 32) ^ rd();
  }
  Status st = impl->group.all_reduce_max(&id, 1);
  if (!st.ok()) return impl->Where(st);
  impl->id = id;
  impl->shard_path =
      impl->dir + "/" + ShardName(impl->stem, id, impl->group.rank, impl->group.nranks);
  // Every rank must know whether every rank could start, or one would wait for the others
  // in Commit forever.
  auto w = Writer::Create(impl->shard_path, impl->options.writer);
  auto failed = impl->Agree(w.ok() ? 0 : 1);
  if (!w.ok()) return w.status();
  if (!failed.ok()) return impl->Where(failed.status());
  if (*failed != 0) {
    return Error(StatusCode::kInternal, index_path, ": rank ", impl->group.rank,
                 ": another rank could not start its shard (its error says why)");
  }
  impl->writer.emplace(std::move(w).value());
  return std::unique_ptr<ShardedSave>(new ShardedSave(std::move(impl)));
}

Writer& ShardedSave::writer() { return *impl_->writer; }
const std::string& ShardedSave::shard_path() const { return impl_->shard_path; }
const std::string& ShardedSave::index_path() const { return impl_->index_path; }

Status ShardedSave::Commit() {
  if (impl_->done || impl_->pending) {
    return Error(StatusCode::kInvalidArgument, impl_->index_path, ": save already committed");
  }
  return impl_->Conclude(impl_->writer->Commit());
}

Status ShardedSave::CommitAsync() {
  if (impl_->done || impl_->pending) {
    return Error(StatusCode::kInvalidArgument, impl_->index_path, ": save already committed");
  }
  auto h = impl_->writer->CommitAsync();
  if (!h.ok()) {
    // Finish still has to run on this rank, to tell the others.
    impl_->pending.emplace();
    impl_->async_error = h.status();
    return h.status();
  }
  impl_->pending.emplace(std::move(h).value());
  return Status::Ok();
}

bool ShardedSave::shard_done() const {
  if (impl_->done) return true;
  if (!impl_->pending) return false;
  return !impl_->async_error.ok() || impl_->pending->done();
}

Status ShardedSave::Finish() {
  if (impl_->done || !impl_->pending) {
    return Error(StatusCode::kInvalidArgument, impl_->index_path,
                 ": Finish needs a CommitAsync first");
  }
  Status mine = impl_->async_error.ok() ? impl_->pending->Wait() : impl_->async_error;
  return impl_->Conclude(mine);
}

}  // namespace ferry
