// ferry_loader_t: loads into device or host memory, packed and streaming.

#include "capi/internal.hpp"

using namespace ferry::capi;  // NOLINT(build/namespaces): the entry points are shells over these

namespace {

int ToRequests(const ferry_load_request_t* requests, size_t n, bool out_given,
               std::vector<ferry::LoadRequest>* out, const char* function, ferry_error_t* error) {
  if (n > 0 && requests == nullptr) return NullArg(error, function, "requests");
  if (!out_given) {
    bool all_dst = n > 0;
    for (size_t i = 0; i < n; ++i) all_dst = all_dst && requests[i].dst != nullptr;
    if (!all_dst) {
      return Fail(error, FERRY_INVALID_ARGUMENT,
                  ferry::StrCat(function,
                                ": out may be NULL only when every request has a dst (the "
                                "loader's allocations would leak)"));
    }
  }
  out->reserve(n);
  for (size_t i = 0; i < n; ++i) {
    if (requests[i].name == nullptr) {
      return Fail(error, FERRY_INVALID_ARGUMENT,
                  ferry::StrCat(function, ": requests[", i, "].name is NULL"));
    }
    ferry::LoadRequest r;
    r.name = requests[i].name;
    r.row_begin = requests[i].row_begin;
    r.row_end = requests[i].row_end;
    r.dst = requests[i].dst;
    r.dst_bytes = requests[i].dst_bytes;
    out->push_back(std::move(r));
  }
  return FERRY_OK;
}

void ExportLoaded(std::vector<ferry::LoadedTensor>& loaded, DLManagedTensorVersioned** out) {
  // Build every descriptor before handing any out, so a failure (bad_alloc) leaks nothing.
  std::vector<std::unique_ptr<DLManagedTensorVersioned, void (*)(DLManagedTensorVersioned*)>> made;
  made.reserve(loaded.size());
  for (ferry::LoadedTensor& t : loaded) {
    DLDevice dev;
    if (t.device >= 0) {
      dev.device_type = kDLCUDA;
      dev.device_id = t.device;
    } else {
      dev.device_type = kDLCPU;
      dev.device_id = 0;
    }
    uint64_t flags = t.owner ? DLPACK_FLAG_BITMASK_IS_COPIED : 0;
    made.emplace_back(MakeManaged(t.info, t.data, dev, flags, std::move(t.owner)),
                      &ferry_dlpack_free);
  }
  for (size_t i = 0; i < made.size(); ++i) out[i] = made[i].release();
}

// A streaming load's C callback, given a borrowed descriptor of each tensor.
struct CReady {
  ferry_ready_fn fn = nullptr;
  void* user = nullptr;
  int32_t hand_over = FERRY_HAND_OVER_COMPLETE;
};

ferry::ReadyCallback ToCallback(const CReady& c) {
  return [c](const ferry::ReadyTensor& t) {
    DLDevice dev;
    dev.device_type = t.tensor->device >= 0 ? kDLCUDA : kDLCPU;
    dev.device_id = t.tensor->device >= 0 ? t.tensor->device : 0;
    std::unique_ptr<DLManagedTensorVersioned, void (*)(DLManagedTensorVersioned*)> m(
        MakeManaged(t.tensor->info, t.tensor->data, dev, 0, nullptr), &ferry_dlpack_free);
    c.fn(c.user, t.index, &m->dl_tensor, static_cast<void*>(t.ready));
  };
}

int CheckReady(const CReady* ready, const char* function, ferry_error_t* error) {
  if (ready == nullptr) return FERRY_OK;
  if (ready->fn == nullptr) return NullArg(error, function, "on_ready");
  if (ready->hand_over != FERRY_HAND_OVER_COMPLETE &&
      ready->hand_over != FERRY_HAND_OVER_ENQUEUED) {
    return Fail(error, FERRY_INVALID_ARGUMENT,
                ferry::StrCat(function, ": hand_over ", ready->hand_over,
                              " is neither FERRY_HAND_OVER_COMPLETE nor FERRY_HAND_OVER_ENQUEUED"));
  }
  return FERRY_OK;
}

ferry::HandOver ToHandOver(const CReady& c) {
  return c.hand_over == FERRY_HAND_OVER_ENQUEUED ? ferry::HandOver::kEnqueued
                                                 : ferry::HandOver::kComplete;
}

int RunLoad(ferry_loader_t* loader, const ferry_reader_t* reader,
            const ferry_load_request_t* requests, size_t num_requests,
            const ferry_allocator_t* allocator, DLManagedTensorVersioned** out, void* stream,
            int mode, const char* function, ferry_error_t* error, const CReady* ready = nullptr) {
  if (loader == nullptr) return NullArg(error, function, "loader");
  if (reader == nullptr) return NullArg(error, function, "reader");
  if (out == nullptr && num_requests == 0) return NullArg(error, function, "out");
  if (int rc = CheckReady(ready, function, error); rc != FERRY_OK) return rc;
  std::vector<ferry::LoadRequest> reqs;
  int rc = ToRequests(requests, num_requests, out != nullptr, &reqs, function, error);
  if (rc != FERRY_OK) return rc;
  ferry::DeviceAllocator dalloc;
  const ferry::DeviceAllocator* dalloc_ptr = nullptr;
  if (allocator != nullptr) {
    if (allocator->struct_size < sizeof(ferry_allocator_t) || allocator->allocate == nullptr) {
      return Fail(error, FERRY_INVALID_ARGUMENT,
                  ferry::StrCat(function, ": allocator needs struct_size and allocate"));
    }
    ferry_allocator_t a = *allocator;
    dalloc.allocate = [a](uint64_t bytes, ferry::Stream s) {
      return a.allocate(a.ctx, bytes, static_cast<void*>(s));
    };
    dalloc.deallocate = [a](void* p, uint64_t bytes, ferry::Stream s) {
      if (a.deallocate != nullptr) a.deallocate(a.ctx, p, bytes, static_cast<void*>(s));
    };
    dalloc_ptr = &dalloc;
  }
  auto s = static_cast<ferry::Stream>(stream);
  ferry::Result<std::vector<ferry::LoadedTensor>> result =
      ready != nullptr && mode == 2
          ? loader->loader->LoadToHostStreaming(*reader->reader, reqs, ToCallback(*ready))
      : ready != nullptr ? loader->loader->LoadStreaming(*reader->reader, reqs, ToCallback(*ready),
                                                         ToHandOver(*ready), s, dalloc_ptr)
      : mode == 0        ? loader->loader->LoadAsync(*reader->reader, reqs, s, dalloc_ptr)
      : mode == 1        ? loader->loader->Load(*reader->reader, reqs, s, dalloc_ptr)
                         : loader->loader->LoadToHost(*reader->reader, reqs);
  if (!result.ok()) return Report(result.status(), error);
  if (out != nullptr) ExportLoaded(*result, out);
  return FERRY_OK;
}

// Packed loads: one request per non-empty tensor, into dst at its packed offset.
int RunPacked(ferry_loader_t* loader, const ferry_reader_t* reader, void* dst, uint64_t dst_size,
              void* stream, int mode, const char* function, ferry_error_t* error,
              const CReady* ready = nullptr) {
  if (loader == nullptr) return NullArg(error, function, "loader");
  if (reader == nullptr) return NullArg(error, function, "reader");
  if (int rc = CheckReady(ready, function, error); rc != FERRY_OK) return rc;
  const TensorTable& table = Table(reader);
  if (table.packed_bytes == 0 && ready == nullptr) return FERRY_OK;
  if (dst == nullptr && table.packed_bytes > 0) return NullArg(error, function, "dst");
  if (dst_size < table.packed_bytes) {
    return Fail(error, FERRY_INVALID_ARGUMENT,
                ferry::StrCat(function, ": ", reader->reader->path(), ": dst holds ", dst_size,
                              " bytes, a packed load needs ", table.packed_bytes));
  }
  std::vector<ferry::LoadRequest> reqs;
  reqs.reserve(table.records.size());
  // Streaming: every tensor is requested (empty ones too, so each is handed over), and the
  // request's position is the tensor's index.
  for (const ferry_tensor_record_t& rec : table.records) {
    if (rec.nbytes == 0 && ready == nullptr) continue;
    ferry::LoadRequest q;
    q.name.assign(table.names.data() + rec.name_offset, rec.name_size);
    q.dst = static_cast<uint8_t*>(dst) + rec.packed_offset;
    q.dst_bytes = rec.nbytes;
    reqs.push_back(std::move(q));
  }
  auto s = static_cast<ferry::Stream>(stream);
  ferry::Result<std::vector<ferry::LoadedTensor>> result =
      ready != nullptr ? loader->loader->LoadStreaming(*reader->reader, reqs, ToCallback(*ready),
                                                       ToHandOver(*ready), s)
      : mode == 0      ? loader->loader->LoadAsync(*reader->reader, reqs, s)
      : mode == 1      ? loader->loader->Load(*reader->reader, reqs, s)
                       : loader->loader->LoadToHost(*reader->reader, reqs);
  return result.ok() ? FERRY_OK : Report(result.status(), error);
}

}  // namespace

extern "C" {

void ferry_loader_options_init(ferry_loader_options_t* options) {
  if (options == nullptr) return;
  ferry::LoaderOptions d;
  std::memset(static_cast<void*>(options), 0, sizeof(*options));
  options->struct_size = sizeof(*options);
  options->staging_bytes = d.staging_bytes;
  options->slot_bytes = d.slot_bytes;
  options->threads = d.threads;
  options->host_path = static_cast<int32_t>(d.host_path);
  options->pinned_alloc = static_cast<int32_t>(d.pinned_alloc);
  options->verify = d.verify ? 1 : 0;
  options->io = static_cast<int32_t>(d.io);
  options->register_window_bytes = d.register_window_bytes;
  options->streaming_stores = d.streaming_stores ? 1 : 0;
}

int ferry_cuda_available(void) {
  try {
    return ferry::CudaAvailable() ? 1 : 0;
  } catch (...) {
    return 0;
  }
}

int ferry_loader_create(const ferry_loader_options_t* options, ferry_loader_t** out,
                        ferry_error_t* error) {
  return Guard(error, [&, fn = __func__] {
    FERRY_C_REQUIRE(out);
    ferry::LoaderOptions o;
    if (options != nullptr) {
      int rc = CheckSized(options, fn, "options", error);
      if (rc != FERRY_OK) return rc;
      if (FERRY_C_HAS(options, staging_bytes)) o.staging_bytes = options->staging_bytes;
      if (FERRY_C_HAS(options, slot_bytes)) o.slot_bytes = options->slot_bytes;
      if (FERRY_C_HAS(options, threads)) o.threads = options->threads;
      if (FERRY_C_HAS(options, host_path)) {
        if (options->host_path < FERRY_HOST_PATH_AUTO ||
            options->host_path > FERRY_HOST_PATH_REGISTER_WINDOWS) {
          return Fail(error, FERRY_INVALID_ARGUMENT,
                      ferry::StrCat("ferry_loader_create: unknown host_path ", options->host_path));
        }
        o.host_path = static_cast<ferry::HostPath>(options->host_path);
      }
      if (FERRY_C_HAS(options, pinned_alloc)) {
        if (options->pinned_alloc < FERRY_PINNED_HOST_REGISTER ||
            options->pinned_alloc > FERRY_PINNED_HOST_ALLOC) {
          return Fail(
              error, FERRY_INVALID_ARGUMENT,
              ferry::StrCat("ferry_loader_create: unknown pinned_alloc ", options->pinned_alloc));
        }
        o.pinned_alloc = static_cast<ferry::PinnedAlloc>(options->pinned_alloc);
      }
      if (FERRY_C_HAS(options, verify)) o.verify = options->verify != 0;
      if (FERRY_C_HAS(options, io)) {
        if (options->io < FERRY_IO_AUTO || options->io > FERRY_IO_DIRECT) {
          return Fail(error, FERRY_INVALID_ARGUMENT,
                      ferry::StrCat("ferry_loader_create: unknown io ", options->io));
        }
        o.io = static_cast<ferry::IoMode>(options->io);
      }
      if (FERRY_C_HAS(options, register_window_bytes)) {
        o.register_window_bytes = options->register_window_bytes;
      }
      if (FERRY_C_HAS(options, streaming_stores)) {
        o.streaming_stores = options->streaming_stores != 0;
      }
    }
    auto l = ferry::Loader::Create(o);
    if (!l.ok()) return Report(l.status(), error);
    auto h = std::make_unique<ferry_loader_t>();
    h->loader = std::move(l).value();
    *out = h.release();
    return FERRY_OK;
  });
}

void ferry_loader_free(ferry_loader_t* loader) {
  try {
    delete loader;
  } catch (...) {
  }
}

void ferry_load_request_init(ferry_load_request_t* request, const char* name) {
  if (request == nullptr) return;
  request->name = name;
  request->row_begin = 0;
  request->row_end = -1;
  request->dst = nullptr;
  request->dst_bytes = 0;
}

int ferry_loader_load_async(ferry_loader_t* loader, const ferry_reader_t* reader,
                            const ferry_load_request_t* requests, size_t num_requests,
                            const ferry_allocator_t* allocator, DLManagedTensorVersioned** out,
                            void* stream, ferry_error_t* error) {
  return Guard(error, [&, fn = __func__] {
    return RunLoad(loader, reader, requests, num_requests, allocator, out, stream, 0,
                   "ferry_loader_load_async", error);
  });
}

int ferry_loader_load(ferry_loader_t* loader, const ferry_reader_t* reader,
                      const ferry_load_request_t* requests, size_t num_requests,
                      const ferry_allocator_t* allocator, DLManagedTensorVersioned** out,
                      void* stream, ferry_error_t* error) {
  return Guard(error, [&, fn = __func__] {
    return RunLoad(loader, reader, requests, num_requests, allocator, out, stream, 1,
                   "ferry_loader_load", error);
  });
}

int ferry_loader_load_to_host(ferry_loader_t* loader, const ferry_reader_t* reader,
                              const ferry_load_request_t* requests, size_t num_requests,
                              DLManagedTensorVersioned** out, ferry_error_t* error) {
  return Guard(error, [&, fn = __func__] {
    return RunLoad(loader, reader, requests, num_requests, nullptr, out, nullptr, 2,
                   "ferry_loader_load_to_host", error);
  });
}

int ferry_loader_load_packed_async(ferry_loader_t* loader, const ferry_reader_t* reader, void* dst,
                                   uint64_t dst_size, void* stream, ferry_error_t* error) {
  return Guard(error, [&, fn = __func__] {
    return RunPacked(loader, reader, dst, dst_size, stream, 0, fn, error);
  });
}

int ferry_loader_load_packed(ferry_loader_t* loader, const ferry_reader_t* reader, void* dst,
                             uint64_t dst_size, void* stream, ferry_error_t* error) {
  return Guard(error, [&, fn = __func__] {
    return RunPacked(loader, reader, dst, dst_size, stream, 1, fn, error);
  });
}

int ferry_loader_load_to_host_packed(ferry_loader_t* loader, const ferry_reader_t* reader,
                                     void* dst, uint64_t dst_size, ferry_error_t* error) {
  return Guard(error, [&, fn = __func__] {
    return RunPacked(loader, reader, dst, dst_size, nullptr, 2, fn, error);
  });
}

int ferry_loader_load_streaming(ferry_loader_t* loader, const ferry_reader_t* reader,
                                const ferry_load_request_t* requests, size_t num_requests,
                                const ferry_allocator_t* allocator, int32_t hand_over,
                                ferry_ready_fn on_ready, void* user, DLManagedTensorVersioned** out,
                                void* stream, ferry_error_t* error) {
  return Guard(error, [&, fn = __func__] {
    CReady ready{on_ready, user, hand_over};
    return RunLoad(loader, reader, requests, num_requests, allocator, out, stream, 0, fn, error,
                   &ready);
  });
}

int ferry_loader_load_to_host_streaming(ferry_loader_t* loader, const ferry_reader_t* reader,
                                        const ferry_load_request_t* requests, size_t num_requests,
                                        ferry_ready_fn on_ready, void* user,
                                        DLManagedTensorVersioned** out, ferry_error_t* error) {
  return Guard(error, [&, fn = __func__] {
    CReady ready{on_ready, user, FERRY_HAND_OVER_COMPLETE};
    return RunLoad(loader, reader, requests, num_requests, nullptr, out, nullptr, 2, fn, error,
                   &ready);
  });
}

int ferry_loader_load_packed_streaming(ferry_loader_t* loader, const ferry_reader_t* reader,
                                       void* dst, uint64_t dst_size, int32_t hand_over,
                                       ferry_ready_fn on_ready, void* user, void* stream,
                                       ferry_error_t* error) {
  return Guard(error, [&, fn = __func__] {
    CReady ready{on_ready, user, hand_over};
    return RunPacked(loader, reader, dst, dst_size, stream, 0, fn, error, &ready);
  });
}

}  // extern "C"
