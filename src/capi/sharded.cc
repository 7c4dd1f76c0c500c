// Sharded checkpoints: ferry_sharded_t over an index, writing an index, and sharded saves
// (ferry_sharded_save_t) over the caller's collective.

#include "ferry/sharded.hpp"

#include "capi/internal.hpp"

using namespace ferry::capi;  // NOLINT(build/namespaces): the entry points are shells over these

namespace {

// ferry_sharded_save_options_t -> the group and options of a ShardedSave.
int ToSaveOptions(const char* index_path, const ferry_sharded_save_options_t* options,
                  const char* fn, ferry::SaveGroup* group, ferry::ShardedSaveOptions* o,
                  ferry_error_t* error) {
  if (int rc = CheckSized(options, fn, "options", error); rc != FERRY_OK) return rc;
  if (FERRY_C_HAS(options, rank)) group->rank = options->rank;
  if (FERRY_C_HAS(options, nranks)) group->nranks = options->nranks;
  if (!FERRY_C_HAS(options, all_reduce_max) || options->all_reduce_max == nullptr) {
    return NullArg(error, fn, "options->all_reduce_max");
  }
  void* user = FERRY_C_HAS(options, all_reduce_user) ? options->all_reduce_user : nullptr;
  group->all_reduce_max = ToAllReduce(options->all_reduce_max, user);
  if (FERRY_C_HAS(options, writer) && options->writer != nullptr) {
    int rc = ToWriterOptions(index_path, options->writer, fn, &o->writer, error);
    if (rc != FERRY_OK) return rc;
  }
  if (FERRY_C_HAS(options, num_metadata)) {
    int rc = ToPairs(options->metadata_keys, options->metadata_values, options->num_metadata, fn,
                     &o->metadata, error);
    if (rc != FERRY_OK) return rc;
  }
  if (FERRY_C_HAS(options, remove_replaced)) o->remove_replaced = options->remove_replaced != 0;
  return FERRY_OK;
}

// A step of a begun save: commit, commit_async or finish.
template <typename Step>
int SaveStep(ferry_sharded_save_t* save, const char* fn, ferry_error_t* error, Step step) {
  FERRY_C_REQUIRE(save);
  return Report(step(*save->save), error);
}

}  // namespace

extern "C" {

int ferry_write_shard_index(const char* index_path, const char* const* shard_files,
                            size_t num_files, const char* const* metadata_keys,
                            const char* const* metadata_values, size_t num_metadata,
                            ferry_error_t* error) {
  return Guard(error, [&, fn = __func__] {
    FERRY_C_REQUIRE(index_path);
    if (num_files > 0 && shard_files == nullptr) return NullArg(error, fn, "shard_files");
    std::vector<std::string> files;
    for (size_t i = 0; i < num_files; ++i) {
      if (shard_files[i] == nullptr) return NullArg(error, fn, "shard_files[i]");
      files.emplace_back(shard_files[i]);
    }
    std::vector<std::pair<std::string, std::string>> md;
    int rc = ToPairs(metadata_keys, metadata_values, num_metadata, fn, &md, error);
    if (rc != FERRY_OK) return rc;
    return Report(ferry::WriteShardIndex(index_path, files, md), error);
  });
}

int ferry_sharded_open(const char* path, const ferry_reader_options_t* options,
                       ferry_sharded_t** out, ferry_error_t* error) {
  return Guard(error, [&, fn = __func__] {
    FERRY_C_REQUIRE(path);
    FERRY_C_REQUIRE(out);
    return OpenWithOptions(path, options, fn, error, ferry::ShardedCheckpoint::Open,
                           [&](std::shared_ptr<ferry::ShardedCheckpoint> s) {
                             *out = new ferry_sharded_t{std::move(s)};
                           });
  });
}

void ferry_sharded_free(ferry_sharded_t* sharded) { delete sharded; }

size_t ferry_sharded_num_shards(const ferry_sharded_t* sharded) {
  return sharded == nullptr ? 0 : sharded->sharded->num_shards();
}

int ferry_sharded_shard(const ferry_sharded_t* sharded, size_t shard, ferry_reader_t** out,
                        ferry_error_t* error) {
  return Guard(error, [&, fn = __func__] {
    FERRY_C_REQUIRE(sharded);
    FERRY_C_REQUIRE(out);
    if (shard >= sharded->sharded->num_shards()) {
      return Fail(error, FERRY_INVALID_ARGUMENT,
                  ferry::StrCat(sharded->sharded->path(), ": no shard ", shard, " (of ",
                                sharded->sharded->num_shards(), ")"));
    }
    *out = WrapReader(sharded->sharded->shard(shard)).release();
    return FERRY_OK;
  });
}

int ferry_sharded_find(const ferry_sharded_t* sharded, const char* name, size_t* shard,
                       ferry_error_t* error) {
  return Guard(error, [&, fn = __func__] {
    FERRY_C_REQUIRE(sharded);
    FERRY_C_REQUIRE(name);
    FERRY_C_REQUIRE(shard);
    auto loc = sharded->sharded->Find(name);
    if (!loc.ok()) return Report(loc.status(), error);
    *shard = loc->shard;
    return FERRY_OK;
  });
}

int ferry_sharded_from_reader(const ferry_reader_t* reader, ferry_sharded_t** out,
                              ferry_error_t* error) {
  return Guard(error, [&, fn = __func__] {
    FERRY_C_REQUIRE(reader);
    FERRY_C_REQUIRE(out);
    *out = new ferry_sharded_t{ferry::ShardedCheckpoint::FromReader(reader->reader)};
    return FERRY_OK;
  });
}

void ferry_sharded_save_options_init(ferry_sharded_save_options_t* options) {
  if (options == nullptr) return;
  std::memset(static_cast<void*>(options), 0, sizeof(*options));
  options->struct_size = sizeof(*options);
  options->nranks = 1;
  options->remove_replaced = ferry::ShardedSaveOptions{}.remove_replaced ? 1 : 0;
}

int ferry_sharded_save_begin(const char* index_path, const ferry_sharded_save_options_t* options,
                             ferry_sharded_save_t** out, ferry_error_t* error) {
  return Guard(error, [&, fn = __func__] {
    FERRY_C_REQUIRE(index_path);
    FERRY_C_REQUIRE(options);
    FERRY_C_REQUIRE(out);
    ferry::SaveGroup group;
    ferry::ShardedSaveOptions o;
    int rc = ToSaveOptions(index_path, options, fn, &group, &o, error);
    if (rc != FERRY_OK) return rc;
    auto begun = ferry::ShardedSave::Begin(index_path, std::move(group), std::move(o));
    if (!begun.ok()) return Report(begun.status(), error);
    auto h = std::make_unique<ferry_sharded_save_t>();
    h->save = std::move(begun).value();
    h->writer = std::make_unique<ferry_writer_t>(&h->save->writer());
    *out = h.release();
    return FERRY_OK;
  });
}

ferry_writer_t* ferry_sharded_save_writer(ferry_sharded_save_t* save) {
  return save == nullptr ? nullptr : save->writer.get();
}

const char* ferry_sharded_save_shard_path(const ferry_sharded_save_t* save) {
  return save == nullptr ? "" : save->save->shard_path().c_str();
}

int ferry_sharded_save_commit(ferry_sharded_save_t* save, ferry_error_t* error) {
  return Guard(error, [&, fn = __func__] {
    return SaveStep(save, fn, error, [](ferry::ShardedSave& s) { return s.Commit(); });
  });
}

int ferry_sharded_save_commit_async(ferry_sharded_save_t* save, ferry_error_t* error) {
  return Guard(error, [&, fn = __func__] {
    return SaveStep(save, fn, error, [](ferry::ShardedSave& s) { return s.CommitAsync(); });
  });
}

int ferry_sharded_save_shard_done(const ferry_sharded_save_t* save) {
  try {
    return save == nullptr || save->save->shard_done() ? 1 : 0;
  } catch (...) {
    return 0;
  }
}

int ferry_sharded_save_finish(ferry_sharded_save_t* save, ferry_error_t* error) {
  return Guard(error, [&, fn = __func__] {
    return SaveStep(save, fn, error, [](ferry::ShardedSave& s) { return s.Finish(); });
  });
}

void ferry_sharded_save_free(ferry_sharded_save_t* save) {
  if (save == nullptr) return;
  try {
    delete save;  // ~Writer removes an uncommitted shard; ~SaveHandle waits for one in flight
  } catch (...) {
  }
}

}  // extern "C"
