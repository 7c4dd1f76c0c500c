// DLPack tensors handed out by readers and loaders, their deleters and the legacy form.

#include <dlfcn.h>

#include "capi/internal.hpp"

using namespace ferry::capi;  // NOLINT(build/namespaces): the entry points are shells over these

namespace {

// Owns one DLManagedTensorVersioned and whatever keeps its memory alive (the file mapping of a
// view, or the loader's allocation).
struct ManagedCtx {
  DLManagedTensorVersioned managed{};
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;
  std::shared_ptr<const void> keepalive;
};

void DeleteManaged(DLManagedTensorVersioned* self) noexcept {
  if (self == nullptr) return;
  // Freeing device memory through a caller's allocator may throw from user code; a deleter is
  // called from C and must not unwind.
  try {
    delete static_cast<ManagedCtx*>(self->manager_ctx);
  } catch (...) {
  }
}

struct LegacyCtx {
  DLManagedTensor legacy{};
  DLManagedTensorVersioned* versioned = nullptr;
};

void DeleteLegacy(DLManagedTensor* self) noexcept {
  if (self == nullptr) return;
  auto* ctx = static_cast<LegacyCtx*>(self->manager_ctx);
  ferry_dlpack_free(ctx->versioned);
  delete ctx;
}

}  // namespace

namespace ferry::capi {

DLManagedTensorVersioned* MakeManaged(const ferry::TensorInfo& info, void* data, DLDevice device,
                                      uint64_t flags, std::shared_ptr<const void> keepalive) {
  auto ctx = std::make_unique<ManagedCtx>();
  ctx->shape = info.shape;
  ctx->strides.assign(info.shape.size(), 1);
  for (size_t d = info.shape.size(); d > 1; --d) {
    ctx->strides[d - 2] = ctx->strides[d - 1] * std::max<int64_t>(info.shape[d - 1], 1);
  }
  ctx->keepalive = std::move(keepalive);
  DLManagedTensorVersioned& m = ctx->managed;
  m.version.major = DLPACK_MAJOR_VERSION;
  m.version.minor = DLPACK_MINOR_VERSION;
  m.manager_ctx = ctx.get();
  m.deleter = DeleteManaged;
  m.flags = flags;
  if (info.dtype == ferry::DType::kF6_E2M3FN || info.dtype == ferry::DType::kF6_E3M2FN) {
    m.flags |= DLPACK_FLAG_BITMASK_IS_SUBBYTE_TYPE_PADDED;
  }
  m.dl_tensor.data = data;
  m.dl_tensor.device = device;
  m.dl_tensor.ndim = static_cast<int32_t>(ctx->shape.size());
  m.dl_tensor.dtype = ToDl(info.dtype);
  // A non-NULL pointer even for scalars: some consumers read shape[0] of ndim 0 tensors.
  m.dl_tensor.shape = ctx->shape.empty() ? nullptr : ctx->shape.data();
  m.dl_tensor.strides = ctx->strides.empty() ? nullptr : ctx->strides.data();
  m.dl_tensor.byte_offset = 0;
  return &ctx.release()->managed;
}

}  // namespace ferry::capi

extern "C" {

void ferry_dlpack_free(DLManagedTensorVersioned* tensor) {
  if (tensor != nullptr && tensor->deleter != nullptr) tensor->deleter(tensor);
}

int ferry_dlpack_to_legacy(DLManagedTensorVersioned* tensor, DLManagedTensor** out,
                           ferry_error_t* error) {
  return Guard(error, [&, fn = __func__] {
    FERRY_C_REQUIRE(tensor);
    FERRY_C_REQUIRE(out);
    auto ctx = std::make_unique<LegacyCtx>();
    ctx->versioned = tensor;
    ctx->legacy.dl_tensor = tensor->dl_tensor;
    ctx->legacy.manager_ctx = ctx.get();
    ctx->legacy.deleter = DeleteLegacy;
    *out = &ctx.release()->legacy;
    return FERRY_OK;
  });
}

void ferry_dlpack_legacy_free(DLManagedTensor* tensor) {
  if (tensor != nullptr && tensor->deleter != nullptr) tensor->deleter(tensor);
}

void ferry_dlpack_capsule_destructor(void* capsule) {
  // A destructor written in Python (ctypes) cannot work here: it runs while the consumer's
  // exception is pending, its first Python API call raises that exception inside the callback,
  // which swallows it, and the consumer then fails with SystemError and the tensor leaks.
  // These two functions touch no error state for a capsule of the name asked.
  using IsValidFn = int (*)(void*, const char*);
  using GetPointerFn = void* (*)(void*, const char*);
  static const auto is_valid =
      reinterpret_cast<IsValidFn>(::dlsym(RTLD_DEFAULT, "PyCapsule_IsValid"));
  static const auto get_pointer =
      reinterpret_cast<GetPointerFn>(::dlsym(RTLD_DEFAULT, "PyCapsule_GetPointer"));
  if (capsule == nullptr || is_valid == nullptr || get_pointer == nullptr) return;
  if (is_valid(capsule, "dltensor_versioned")) {
    ferry_dlpack_free(
        static_cast<DLManagedTensorVersioned*>(get_pointer(capsule, "dltensor_versioned")));
  } else if (is_valid(capsule, "dltensor")) {
    ferry_dlpack_legacy_free(static_cast<DLManagedTensor*>(get_pointer(capsule, "dltensor")));
  }
}

}  // extern "C"
