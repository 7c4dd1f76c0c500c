// Sharded checkpoints: ferry_sharded_t over an index, and writing an index.

#include "capi/internal.hpp"

using namespace ferry::capi;  // NOLINT(build/namespaces): the entry points are shells over these

extern "C" {

int ferry_write_shard_index(const char* index_path, const char* const* shard_files,
                            size_t num_files, const char* const* metadata_keys,
                            const char* const* metadata_values, size_t num_metadata,
                            ferry_error_t* error) {
  return Guard(error, [&, fn = __func__] {
    FERRY_C_REQUIRE(index_path);
    if (num_files > 0 && shard_files == nullptr) return NullArg(error, fn, "shard_files");
    if (num_metadata > 0 && (metadata_keys == nullptr || metadata_values == nullptr)) {
      return NullArg(error, fn, "metadata_keys");
    }
    std::vector<std::string> files;
    for (size_t i = 0; i < num_files; ++i) {
      if (shard_files[i] == nullptr) return NullArg(error, fn, "shard_files[i]");
      files.emplace_back(shard_files[i]);
    }
    std::vector<std::pair<std::string, std::string>> md;
    for (size_t i = 0; i < num_metadata; ++i) {
      if (metadata_keys[i] == nullptr || metadata_values[i] == nullptr) {
        return NullArg(error, fn, "metadata_keys[i]");
      }
      md.emplace_back(metadata_keys[i], metadata_values[i]);
    }
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

}  // extern "C"
