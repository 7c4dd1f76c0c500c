// ferry_writer_t, asynchronous saves (ferry_save_t) and staging pools.

#include <optional>

#include "capi/internal.hpp"

using namespace ferry::capi;  // NOLINT(build/namespaces): the entry points are shells over these

namespace {

int CheckEncoding(int32_t encoding, const char* function, ferry_error_t* error) {
  if (encoding < FERRY_ENCODING_DEFAULT || encoding > FERRY_ENCODING_PLANES) {
    return Fail(error, FERRY_INVALID_ARGUMENT,
                ferry::StrCat(function, ": unknown encoding ", encoding));
  }
  return FERRY_OK;
}

// Argument checks shared by the functions that add one tensor to a writer.
int CheckAddArgs(const ferry_writer_t* writer, const char* name, int32_t dtype,
                 const int64_t* shape, int32_t ndim, int32_t encoding, const char* function,
                 ferry_error_t* error) {
  if (writer->spent) {
    return Fail(error, FERRY_INVALID_ARGUMENT,
                ferry::StrCat(writer->writer->path(), ": writer already committed"));
  }
  if (ndim < 0 || (ndim > 0 && shape == nullptr)) {
    return Fail(error, FERRY_INVALID_ARGUMENT,
                ferry::StrCat(writer->writer->path(), ": tensor ", ferry::Quote(name),
                              ": bad shape (ndim ", ndim, ")"));
  }
  if (!ValidDType(dtype)) {
    return Fail(error, FERRY_INVALID_ARGUMENT,
                ferry::StrCat(writer->writer->path(), ": tensor ", ferry::Quote(name),
                              ": unknown dtype ", dtype));
  }
  return CheckEncoding(encoding, function, error);
}

// A commit uses the writer up; a sharded save's writer is committed by the save.
int Spend(ferry_writer_t* writer, ferry_error_t* error) {
  if (writer->lent) {
    return Fail(error, FERRY_INVALID_ARGUMENT,
                ferry::StrCat(writer->writer->path(),
                              ": this writer belongs to a sharded save; commit the save "
                              "(ferry_sharded_save_commit)"));
  }
  if (writer->spent) {
    return Fail(error, FERRY_INVALID_ARGUMENT,
                ferry::StrCat(writer->writer->path(), ": writer already committed"));
  }
  writer->spent = true;
  return FERRY_OK;
}

// Checks one tensor's arguments, then adds it with add(writer, dtype, dims, encoding), the
// encoding empty for the writer's default.
template <typename Add>
int AddOne(ferry_writer_t* writer, const char* name, int32_t dtype, const int64_t* shape,
           int32_t ndim, int32_t encoding, const char* fn, ferry_error_t* error, Add add) {
  FERRY_C_REQUIRE(writer);
  FERRY_C_REQUIRE(name);
  int rc = CheckAddArgs(writer, name, dtype, shape, ndim, encoding, fn, error);
  if (rc != FERRY_OK) return rc;
  std::vector<int64_t> dims(shape, shape + ndim);
  std::optional<ferry::Encoding> enc;
  if (encoding != FERRY_ENCODING_DEFAULT) enc = static_cast<ferry::Encoding>(encoding);
  return Report(add(*writer->writer, static_cast<ferry::DType>(dtype), dims, enc), error);
}

}  // namespace

namespace ferry::capi {

// ferry_writer_options_t -> WriterOptions (ferry_writer_create, ferry_convert).
int ToWriterOptions(const char* path, const ferry_writer_options_t* options, const char* fn,
                    ferry::WriterOptions* o, ferry_error_t* error) {
  if (options == nullptr) return FERRY_OK;
  int rc = CheckSized(options, fn, "options", error);
  if (rc != FERRY_OK) return rc;
  if (FERRY_C_HAS(options, block_size)) o->block_size = options->block_size;
  if (FERRY_C_HAS(options, encoding)) {
    if (options->encoding < FERRY_ENCODING_RAW || options->encoding > FERRY_ENCODING_PLANES) {
      return Fail(error, FERRY_INVALID_ARGUMENT,
                  ferry::StrCat(path, ": unknown default encoding ", options->encoding));
    }
    o->encoding = static_cast<ferry::Encoding>(options->encoding);
  }
  if (FERRY_C_HAS(options, zstd_level)) o->zstd_level = options->zstd_level;
  if (FERRY_C_HAS(options, min_savings)) o->min_savings = options->min_savings;
  if (FERRY_C_HAS(options, threads)) o->threads = options->threads;
  if (FERRY_C_HAS(options, durable)) o->durable = options->durable != 0;
  if (FERRY_C_HAS(options, producer) && options->producer != nullptr) {
    o->producer = options->producer;
  }
  if (FERRY_C_HAS(options, staging) && options->staging != nullptr) {
    o->staging = options->staging->pool;
  }
  if (FERRY_C_HAS(options, direct_io)) o->direct_io = options->direct_io != 0;
  if (FERRY_C_HAS(options, progress) && options->progress != nullptr) {
    auto* fn = options->progress;
    void* user = FERRY_C_HAS(options, progress_user) ? options->progress_user : nullptr;
    o->progress = [fn, user](uint64_t done) -> Status {
      const int32_t rc = fn(user, done);
      if (rc == 0) return Status::Ok();
      return Error(StatusCode::kIoError, "the progress callback stopped the save (it returned ", rc,
                   ")");
    };
  }
  return FERRY_OK;
}

}  // namespace ferry::capi

extern "C" {

void ferry_writer_options_init(ferry_writer_options_t* options) {
  if (options == nullptr) return;
  ferry::WriterOptions d;
  std::memset(static_cast<void*>(options), 0, sizeof(*options));
  options->struct_size = sizeof(*options);
  options->block_size = d.block_size;
  options->encoding = static_cast<int32_t>(d.encoding);
  options->zstd_level = d.zstd_level;
  options->min_savings = d.min_savings;
  options->threads = d.threads;
  options->durable = d.durable ? 1 : 0;
  options->producer = nullptr;
  options->staging = nullptr;
  options->direct_io = d.direct_io ? 1 : 0;
}

int ferry_writer_create(const char* path, const ferry_writer_options_t* options,
                        ferry_writer_t** out, ferry_error_t* error) {
  return Guard(error, [&, fn = __func__] {
    FERRY_C_REQUIRE(path);
    FERRY_C_REQUIRE(out);
    ferry::WriterOptions o;
    int rc = ToWriterOptions(path, options, fn, &o, error);
    if (rc != FERRY_OK) return rc;
    auto w = ferry::Writer::Create(path, std::move(o));
    if (!w.ok()) return Report(w.status(), error);
    *out = new ferry_writer_t(std::move(w).value());
    return FERRY_OK;
  });
}

int ferry_writer_add_tensor(ferry_writer_t* writer, const char* name, int32_t dtype,
                            const int64_t* shape, int32_t ndim, const void* data, uint64_t nbytes,
                            int32_t encoding, ferry_error_t* error) {
  return Guard(error, [&, fn = __func__] {
    return AddOne(writer, name, dtype, shape, ndim, encoding, fn, error,
                  [&](ferry::Writer& w, ferry::DType dt, const std::vector<int64_t>& dims,
                      std::optional<ferry::Encoding> enc) {
                    return enc ? w.AddTensor(name, dt, dims, data, nbytes, *enc)
                               : w.AddTensor(name, dt, dims, data, nbytes);
                  });
  });
}

int ferry_writer_add_device_tensor_async(ferry_writer_t* writer, const char* name, int32_t dtype,
                                         const int64_t* shape, int32_t ndim, const void* data,
                                         uint64_t nbytes, int32_t encoding, void* stream,
                                         ferry_error_t* error) {
  return Guard(error, [&, fn = __func__] {
    auto s = static_cast<ferry::Stream>(stream);
    return AddOne(writer, name, dtype, shape, ndim, encoding, fn, error,
                  [&](ferry::Writer& w, ferry::DType dt, const std::vector<int64_t>& dims,
                      std::optional<ferry::Encoding> enc) {
                    return enc ? w.AddDeviceTensor(name, dt, dims, data, nbytes, s, *enc)
                               : w.AddDeviceTensor(name, dt, dims, data, nbytes, s);
                  });
  });
}

int ferry_writer_wait_snapshot(ferry_writer_t* writer, ferry_error_t* error) {
  return Guard(error, [&, fn = __func__] {
    FERRY_C_REQUIRE(writer);
    return Report(writer->writer->WaitSnapshot(), error);
  });
}

int ferry_writer_add_dltensor(ferry_writer_t* writer, const char* name, const DLTensor* tensor,
                              int32_t encoding, ferry_error_t* error) {
  return Guard(error, [&, fn = __func__] {
    FERRY_C_REQUIRE(writer);
    FERRY_C_REQUIRE(name);
    FERRY_C_REQUIRE(tensor);
    auto where = [&] {
      return ferry::StrCat(writer->writer->path(), ": tensor ", ferry::Quote(name));
    };
    DLDeviceType dev = tensor->device.device_type;
    if (dev != kDLCPU && dev != kDLCUDAHost && dev != kDLCUDAManaged) {
      return Fail(error, FERRY_INVALID_ARGUMENT,
                  ferry::StrCat(where(), ": DLTensor is not in host memory (device type ",
                                static_cast<int>(dev), "); copy it to the host first"));
    }
    ferry::DType dt;
    if (!FromDl(tensor->dtype, &dt)) {
      return Fail(
          error, FERRY_INVALID_ARGUMENT,
          ferry::StrCat(where(), ": unsupported DLPack dtype code ", int{tensor->dtype.code},
                        " bits ", int{tensor->dtype.bits}, " lanes ", tensor->dtype.lanes));
    }
    if (tensor->ndim < 0 || (tensor->ndim > 0 && tensor->shape == nullptr)) {
      return Fail(error, FERRY_INVALID_ARGUMENT, ferry::StrCat(where(), ": bad DLTensor shape"));
    }
    std::vector<int64_t> dims(tensor->shape, tensor->shape + tensor->ndim);
    if (tensor->strides != nullptr) {
      int64_t expect = 1;
      for (int32_t d = tensor->ndim - 1; d >= 0; --d) {
        if (dims[d] != 1 && tensor->strides[d] != expect) {
          return Fail(error, FERRY_INVALID_ARGUMENT,
                      ferry::StrCat(where(), ": DLTensor is not dense row-major (dim ", d,
                                    " stride ", tensor->strides[d], ", expected ", expect, ")"));
        }
        expect *= dims[d];
      }
    }
    auto numel = ferry::NumElements(dims);
    if (!numel) {
      return Fail(error, FERRY_INVALID_ARGUMENT, ferry::StrCat(where(), ": bad DLTensor shape"));
    }
    auto nbytes = ferry::StorageBytes(dt, *numel);
    if (!nbytes) {
      return Fail(error, FERRY_INVALID_ARGUMENT, ferry::StrCat(where(), ": size overflows"));
    }
    const void* data = static_cast<const char*>(tensor->data) + tensor->byte_offset;
    return ferry_writer_add_tensor(writer, name, static_cast<int32_t>(dt), dims.data(),
                                   tensor->ndim, data, *nbytes, encoding, error);
  });
}

int ferry_writer_set_metadata(ferry_writer_t* writer, const char* key, const char* value,
                              ferry_error_t* error) {
  return Guard(error, [&, fn = __func__] {
    FERRY_C_REQUIRE(writer);
    FERRY_C_REQUIRE(key);
    FERRY_C_REQUIRE(value);
    return Report(writer->writer->SetMetadata(key, value), error);
  });
}

int ferry_writer_add_scaling_state(ferry_writer_t* writer, const char* module,
                                   const ferry_recipe_t* recipe,
                                   const ferry_direction_state_t* states, size_t num_states,
                                   ferry_error_t* error) {
  return Guard(error, [&, fn = __func__] {
    FERRY_C_REQUIRE(writer);
    FERRY_C_REQUIRE(module);
    FERRY_C_REQUIRE(recipe);
    if (num_states > 0 && states == nullptr) return NullArg(error, fn, "states");
    int rc = CheckSized(recipe, fn, "recipe", error);
    if (rc != FERRY_OK) return rc;
    ferry::ScalingState s;
    rc = ToScalingState(module, *recipe, states, num_states, writer->writer->path(), &s, error);
    if (rc != FERRY_OK) return rc;
    return Report(writer->writer->AddScalingState(s), error);
  });
}

int ferry_writer_commit(ferry_writer_t* writer, ferry_error_t* error) {
  return Guard(error, [&, fn = __func__] {
    FERRY_C_REQUIRE(writer);
    if (int rc = Spend(writer, error); rc != FERRY_OK) return rc;
    return Report(writer->writer->Commit(), error);
  });
}

int ferry_writer_commit_async(ferry_writer_t* writer, ferry_save_t** out, ferry_error_t* error) {
  return Guard(error, [&, fn = __func__] {
    FERRY_C_REQUIRE(writer);
    FERRY_C_REQUIRE(out);
    if (int rc = Spend(writer, error); rc != FERRY_OK) return rc;
    auto h = writer->writer->CommitAsync();
    if (!h.ok()) return Report(h.status(), error);
    *out = new ferry_save_t{std::move(h).value()};
    return FERRY_OK;
  });
}

int ferry_save_wait(ferry_save_t* save, ferry_error_t* error) {
  return Guard(error, [&, fn = __func__] {
    FERRY_C_REQUIRE(save);
    return Report(save->handle.Wait(), error);
  });
}

int ferry_save_done(const ferry_save_t* save) {
  try {
    return save == nullptr || save->handle.done() ? 1 : 0;
  } catch (...) {
    return 0;
  }
}

void ferry_save_free(ferry_save_t* save) {
  if (save == nullptr) return;
  try {
    delete save;  // ~SaveHandle waits for the save
  } catch (...) {
  }
}

int ferry_staging_pool_create(uint64_t bytes, int32_t pin, ferry_staging_pool_t** out,
                              ferry_error_t* error) {
  return Guard(error, [&, fn = __func__] {
    FERRY_C_REQUIRE(out);
    auto pool = ferry::StagingPool::Create(bytes, pin != 0);
    if (!pool.ok()) return Report(pool.status(), error);
    *out = new ferry_staging_pool_t{std::move(pool).value()};
    return FERRY_OK;
  });
}

uint64_t ferry_staging_pool_bytes(const ferry_staging_pool_t* pool) {
  return pool != nullptr ? pool->pool->bytes() : 0;
}

void ferry_staging_pool_free(ferry_staging_pool_t* pool) {
  if (pool == nullptr) return;
  try {
    delete pool;
  } catch (...) {
  }
}

void ferry_writer_abort(ferry_writer_t* writer) {
  if (writer == nullptr) return;
  try {
    writer->writer->Abort();
  } catch (...) {
  }
}

void ferry_writer_free(ferry_writer_t* writer) {
  if (writer == nullptr || writer->lent) return;  // a sharded save's goes with the save
  try {
    delete writer;  // ~Writer aborts an uncommitted file
  } catch (...) {
  }
}

}  // extern "C"
