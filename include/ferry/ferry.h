/* TensorFerry C API: write and read device-agnostic tensor checkpoints, and load them onto the
 * caller's current CUDA device on the caller's stream. Pure C99; every language binding goes
 * through this header (C++ programs may use ferry/ferry.hpp and ferry/loader.hpp instead).
 *
 * Conventions
 * - Every function that can fail returns an int status code: FERRY_OK (0) or one of the
 *   FERRY_* codes below (the values of ferry::StatusCode, pinned forever). The last
 *   parameter, `error`, is optional (NULL allowed); on failure it receives the code and a
 *   message naming the file and, where it applies, the tensor and the byte offset. On success
 *   it is left untouched. No C++ exception ever crosses this boundary, and no call aborts on
 *   bad input.
 * - Out-parameters are written only on success.
 * - Option structs start with `size_t struct_size`. Fill them with the matching `_init`
 *   function (which sets struct_size and the defaults), then change fields. A NULL options
 *   pointer means the defaults. Structs the library fills (ferry_tensor_info_t, ...) are
 *   filled up to the caller's struct_size, so older callers keep working with newer builds.
 * - Streams are `void*` holding a cudaStream_t (CUstream); NULL is the legacy default stream
 *   of the current device. They are caller-owned and come last before `error`. A function
 *   named `_async` only enqueues work on the stream.
 * - Booleans are int32_t (0 or 1). Strings are NUL-terminated UTF-8.
 * - Tensors come out as DLPack 1.x DLManagedTensorVersioned: the consumer owns each one and
 *   releases it by calling its `deleter` (or ferry_dlpack_free). Data is dense row-major;
 *   `strides` is always set. Sub-byte types (FP4) are packed, two elements per byte, element
 *   2i in the low nibble of byte i; FP6 takes one byte per element (low 6 bits), flagged
 *   DLPACK_FLAG_BITMASK_IS_SUBBYTE_TYPE_PADDED.
 *
 * Handles, lifetime and threads
 * - ferry_writer_t: owned by its creator; free with ferry_writer_free. Not thread-safe: one
 *   thread at a time. Freeing a writer that was not committed removes its temporary file and
 *   leaves any previous file at the path untouched.
 * - ferry_reader_t: owned by its creator; free with ferry_reader_free. Immutable after open:
 *   every ferry_reader_* call may run on any number of threads at once. Pointers it hands
 *   out (names, shapes, metadata strings, scaling state) stay valid until the reader is
 *   freed. Tensors from ferry_reader_view and from the loader hold their own reference to
 *   the file mapping or memory, so they may outlive the reader.
 * - ferry_loader_t: owned by its creator; free with ferry_loader_free, before the CUDA
 *   context goes away (not from atexit handlers or static destructors). Calls on one loader
 *   are serialized internally; use one loader per thread for parallel loads. A loader never
 *   calls cudaSetDevice and touches no device other than the current one of the calling
 *   thread.
 * - ferry_sharded_t: owned by its creator; immutable, any number of threads at once.
 * - ferry_sharded_save_t, ferry_dist_plan_t: owned by their creator; one thread at a time.
 *   Their collective calls (see each) must be made by every rank of the group, in the same
 *   order, and call back the caller's ferry_all_reduce_max_fn on the calling thread.
 * - ferry_*_free(NULL) is a no-op.
 */
#ifndef FERRY_FERRY_H_
#define FERRY_FERRY_H_

#include <stddef.h>
#include <stdint.h>

#include "ferry/api.h"
#include "ferry/version.h"

/* ---- DLPack 1.x declarations -------------------------------------------------------------
 * Written from the DLPack specification (dlpack.h, version 1.1), layout-identical to it. When
 * <dlpack/dlpack.h> was included first, its declarations are used instead. When ferry.h comes
 * first, it defines dlpack.h's include guard so that a later #include <dlpack/dlpack.h> is
 * skipped rather than clashing; include dlpack.h first if you need the rest of it (the
 * exchange API tables). */
#if !defined(DLPACK_DLPACK_H_) && !defined(DLPACK_MAJOR_VERSION)
#define DLPACK_DLPACK_H_
#define DLPACK_MAJOR_VERSION 1
#define DLPACK_MINOR_VERSION 1
#define FERRY_DECLARED_DLPACK 1

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
  uint32_t major;
  uint32_t minor;
} DLPackVersion;

#ifdef __cplusplus
typedef enum : int32_t {
#else
typedef enum {
#endif
  kDLCPU = 1,
  kDLCUDA = 2,
  kDLCUDAHost = 3,
  kDLOpenCL = 4,
  kDLVulkan = 7,
  kDLMetal = 8,
  kDLVPI = 9,
  kDLROCM = 10,
  kDLROCMHost = 11,
  kDLExtDev = 12,
  kDLCUDAManaged = 13,
  kDLOneAPI = 14,
  kDLWebGPU = 15,
  kDLHexagon = 16,
  kDLMAIA = 17,
  kDLTrn = 18
} DLDeviceType;

typedef struct {
  DLDeviceType device_type;
  int32_t device_id;
} DLDevice;

typedef enum {
  kDLInt = 0U,
  kDLUInt = 1U,
  kDLFloat = 2U,
  kDLOpaqueHandle = 3U,
  kDLBfloat = 4U,
  kDLComplex = 5U,
  kDLBool = 6U,
  kDLFloat8_e3m4 = 7U,
  kDLFloat8_e4m3 = 8U,
  kDLFloat8_e4m3b11fnuz = 9U,
  kDLFloat8_e4m3fn = 10U,
  kDLFloat8_e4m3fnuz = 11U,
  kDLFloat8_e5m2 = 12U,
  kDLFloat8_e5m2fnuz = 13U,
  kDLFloat8_e8m0fnu = 14U,
  kDLFloat6_e2m3fn = 15U,
  kDLFloat6_e3m2fn = 16U,
  kDLFloat4_e2m1fn = 17U
} DLDataTypeCode;

typedef struct {
  uint8_t code; /* a DLDataTypeCode */
  uint8_t bits;
  uint16_t lanes;
} DLDataType;

typedef struct {
  void* data;
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t* shape;
  int64_t* strides; /* in elements */
  uint64_t byte_offset;
} DLTensor;

/* Legacy (pre-1.0) managed tensor, for consumers that only take the "dltensor" capsule. */
typedef struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(struct DLManagedTensor* self);
} DLManagedTensor;

#define DLPACK_FLAG_BITMASK_READ_ONLY (1UL << 0UL)
#define DLPACK_FLAG_BITMASK_IS_COPIED (1UL << 1UL)
#define DLPACK_FLAG_BITMASK_IS_SUBBYTE_TYPE_PADDED (1UL << 2UL)

typedef struct DLManagedTensorVersioned {
  DLPackVersion version;
  void* manager_ctx;
  void (*deleter)(struct DLManagedTensorVersioned* self);
  uint64_t flags;
  DLTensor dl_tensor;
} DLManagedTensorVersioned;

#ifdef __cplusplus
}
#endif
#endif /* DLPack declarations */

#ifdef __cplusplus
extern "C" {
#endif

/* ---- status and errors -------------------------------------------------------------------- */

/* Status codes: equal to ferry::StatusCode, pinned forever. */
#define FERRY_OK 0
#define FERRY_INVALID_ARGUMENT 1 /* the caller passed something unusable */
#define FERRY_NOT_FOUND 2        /* no such file or tensor */
#define FERRY_DATA_LOSS 3        /* corrupt, truncated or hostile file; checksum mismatch */
#define FERRY_RESOURCE_EXHAUSTED 4
#define FERRY_UNIMPLEMENTED 5 /* valid request this build cannot serve (e.g. no CUDA) */
#define FERRY_INTERNAL 6      /* a bug in TensorFerry */
#define FERRY_CUDA_ERROR 7
#define FERRY_IO_ERROR 8

/* Longest message kept, terminating NUL included; longer messages are cut. */
#define FERRY_ERROR_MESSAGE_SIZE 1024

typedef struct ferry_error_t {
  int code;
  char message[FERRY_ERROR_MESSAGE_SIZE];
} ferry_error_t;

/* "OK", "InvalidArgument", ...; "Unknown" for other values. Static storage. */
FERRY_API const char* ferry_status_name(int code);

/* The operating system's errno behind an error (ENOENT for a missing folder, ENOSPC for a full
 * disk, EFBIG past a file size limit, ...), or 0 when the system refused nothing (the input was
 * bad, a tensor was missing). Set on FERRY_IO_ERROR, and on FERRY_NOT_FOUND and
 * FERRY_RESOURCE_EXHAUSTED where a system call gave them. Read from `error`, which it does not
 * keep; thread-safe; 0 for NULL. */
FERRY_API int ferry_error_errno(const ferry_error_t* error);

/* ---- version ------------------------------------------------------------------------------ */

/* The library's "MAJOR.MINOR.PATCH" (static storage); compare with FERRY_VERSION_STRING from
 * ferry/version.h to detect a header/library mismatch. */
FERRY_API const char* ferry_version(void);
/* The newest checkpoint format version this library reads and the one it writes. */
FERRY_API uint32_t ferry_format_version(void);

/* ---- element types ------------------------------------------------------------------------ */

/* Values equal the schema's DType (schema/ferry.fbs), pinned forever. */
typedef enum ferry_dtype_t {
  FERRY_DTYPE_BOOL = 0,
  FERRY_DTYPE_U8 = 1,
  FERRY_DTYPE_U16 = 2,
  FERRY_DTYPE_U32 = 3,
  FERRY_DTYPE_U64 = 4,
  FERRY_DTYPE_I8 = 5,
  FERRY_DTYPE_I16 = 6,
  FERRY_DTYPE_I32 = 7,
  FERRY_DTYPE_I64 = 8,
  FERRY_DTYPE_F16 = 9,
  FERRY_DTYPE_BF16 = 10,
  FERRY_DTYPE_F32 = 11,
  FERRY_DTYPE_F64 = 12,
  FERRY_DTYPE_C64 = 13,
  FERRY_DTYPE_C128 = 14,
  FERRY_DTYPE_F8_E4M3FN = 15,
  FERRY_DTYPE_F8_E5M2 = 16,
  FERRY_DTYPE_F8_E8M0FNU = 17,
  FERRY_DTYPE_F8_E4M3FNUZ = 18,
  FERRY_DTYPE_F8_E5M2FNUZ = 19,
  FERRY_DTYPE_F6_E2M3FN = 20,
  FERRY_DTYPE_F6_E3M2FN = 21,
  FERRY_DTYPE_F4_E2M1FN = 22 /* two per byte, element 2i in the low nibble */
} ferry_dtype_t;
#define FERRY_NUM_DTYPES 23

/* "BF16", "F8_E4M3FN", ... (the schema's names); "?" when out of range. Static storage. */
FERRY_API const char* ferry_dtype_name(int32_t dtype);
/* Parses a ferry_dtype_name; FERRY_NOT_FOUND when unknown. */
FERRY_API int ferry_dtype_parse(const char* name, int32_t* dtype, ferry_error_t* error);
/* Bytes of storage for `numel` elements (ceil(numel / 2) for F4). */
FERRY_API int ferry_dtype_storage_bytes(int32_t dtype, uint64_t numel, uint64_t* nbytes,
                                        ferry_error_t* error);
/* The DLPack type of a ferry dtype: bits is 4 for F4 (packed), 6 for F6, and 8 * itemsize
 * otherwise; lanes is 1. */
FERRY_API int ferry_dtype_to_dlpack(int32_t dtype, DLDataType* out, ferry_error_t* error);
/* The ferry dtype of a DLPack type (lanes must be 1). FERRY_INVALID_ARGUMENT when none. */
FERRY_API int ferry_dtype_from_dlpack(DLDataType type, int32_t* dtype, ferry_error_t* error);

/* Encodings of stored tensor bytes. */
#define FERRY_ENCODING_DEFAULT (-1) /* the writer's default (ferry_writer_options_t) */
#define FERRY_ENCODING_RAW 0
#define FERRY_ENCODING_ZSTD 1
#define FERRY_ENCODING_SHUFFLE_ZSTD 2 /* byte planes, then zstd: best for bf16/f16/f32 */
#define FERRY_ENCODING_PLANES 3       /* byte planes, Huffman-coded exponents: decoded on the GPU */

/* ---- DLPack helpers ----------------------------------------------------------------------- */

/* Calls tensor->deleter(tensor) when both are non-NULL. */
FERRY_API void ferry_dlpack_free(DLManagedTensorVersioned* tensor);
/* Wraps a versioned tensor as a legacy DLManagedTensor that owns it (for consumers of the
 * "dltensor" capsule). On success `tensor` belongs to *out: release only *out, through its
 * deleter or ferry_dlpack_legacy_free. The read-only flag has no legacy equivalent. */
FERRY_API int ferry_dlpack_to_legacy(DLManagedTensorVersioned* tensor, DLManagedTensor** out,
                                     ferry_error_t* error);
FERRY_API void ferry_dlpack_legacy_free(DLManagedTensor* tensor);
/* A PyCapsule destructor for bindings that pass these tensors to Python in DLPack capsules:
 * "dltensor_versioned" holding a DLManagedTensorVersioned, or "dltensor" holding a legacy
 * DLManagedTensor from ferry_dlpack_to_legacy. Frees the tensor when the capsule dies
 * unconsumed (a consumer renames the capsule it takes, so a taken tensor is left alone).
 * `capsule` is a PyObject*; the call runs under the GIL like any capsule destructor. It looks
 * up the Python C API in the running process (libferry does not link Python), and neither
 * sets nor clears a pending Python exception: a consumer that raises while refusing a tensor
 * keeps its exception. Outside a Python process it does nothing. */
FERRY_API void ferry_dlpack_capsule_destructor(void* capsule);

/* ---- writer ------------------------------------------------------------------------------- */

typedef struct ferry_writer_t ferry_writer_t;

/* Host staging memory for writers (ferry::StagingPool): a ring of `bytes` reused by every save
 * that names it, so a training job that saves every few minutes allocates and pins it once.
 * pin 1 registers it with CUDA now, in the current device's context (needs a device); pin 0
 * leaves that to the first save from device memory. Shared and thread-safe: any number of
 * writers may use one pool at once. ferry_staging_pool_free drops the caller's reference;
 * writers and saves in progress keep the memory until they are done. Free it before the CUDA
 * context goes away (not from atexit handlers). */
typedef struct ferry_staging_pool_t ferry_staging_pool_t;
FERRY_API int ferry_staging_pool_create(uint64_t bytes, int32_t pin, ferry_staging_pool_t** out,
                                        ferry_error_t* error);
FERRY_API uint64_t ferry_staging_pool_bytes(const ferry_staging_pool_t* pool);
FERRY_API void ferry_staging_pool_free(ferry_staging_pool_t* pool);

/* The rest of a save running in the background (ferry_writer_commit_async). Owned by its
 * creator; ferry_save_wait and ferry_save_done may be called from any thread. */
typedef struct ferry_save_t ferry_save_t;

typedef struct ferry_writer_options_t {
  size_t struct_size;
  /* Raw bytes per checksum block and per compressed chunk: a power of two, >= 4096. */
  uint64_t block_size;
  /* Encoding of tensors added with FERRY_ENCODING_DEFAULT. */
  int32_t encoding;
  int32_t zstd_level;
  /* A chunk is stored uncompressed unless compression saves at least this fraction. */
  double min_savings;
  /* Compression threads; 0: one per hardware thread, at most 16. */
  int32_t threads;
  /* fsync the file and its directory on commit (turn off only for scratch files). */
  int32_t durable;
  /* Stored as the checkpoint's producer; NULL or "": "tensorferry <version>". Copied. */
  const char* producer;
  /* NULL: host tensors are written from the caller's memory during each add call, device
   * tensors go through a pinned pool of the writer's own. A pool: every tensor is first
   * copied into it (a snapshot), so add calls return without waiting for the disk and
   * ferry_writer_commit_async returns once the snapshot is complete. The writer keeps its own
   * reference to the pool. */
  ferry_staging_pool_t* staging;
  /* Write through O_DIRECT where the file system supports it (1, the default), else, or with
   * 0, through the page cache. */
  int32_t direct_io;
  /* Called after each block is written with the raw bytes of the tensors written so far, and
   * `progress_user`; a non-zero return stops the save (its commit fails with FERRY_IO_ERROR
   * and the previous file at the path stays). Runs on the writer's threads, one call at a
   * time; it must not call the writer. NULL: none. */
  int32_t (*progress)(void* user, uint64_t raw_bytes_written);
  void* progress_user;
} ferry_writer_options_t;

FERRY_API void ferry_writer_options_init(ferry_writer_options_t* options);

/* Starts a checkpoint at `path`. Data streams to a temporary file beside it; nothing replaces
 * `path` before ferry_writer_commit. */
FERRY_API int ferry_writer_create(const char* path, const ferry_writer_options_t* options,
                                  ferry_writer_t** out, ferry_error_t* error);
/* Adds a tensor from host memory. `shape` has `ndim` logical element counts (ndim 0: a
 * scalar; shape may then be NULL). `data` holds `nbytes` = ferry_dtype_storage_bytes bytes,
 * dense row-major; it is read before the call returns. Names are unique, non-empty UTF-8. */
FERRY_API int ferry_writer_add_tensor(ferry_writer_t* writer, const char* name, int32_t dtype,
                                      const int64_t* shape, int32_t ndim, const void* data,
                                      uint64_t nbytes, int32_t encoding, ferry_error_t* error);
/* As ferry_writer_add_tensor, from a DLTensor in host memory (kDLCPU, kDLCUDAHost or
 * kDLCUDAManaged) that is dense row-major (strides NULL or compact). */
FERRY_API int ferry_writer_add_dltensor(ferry_writer_t* writer, const char* name,
                                        const DLTensor* tensor, int32_t encoding,
                                        ferry_error_t* error);
/* Adds a tensor from memory of the calling thread's current CUDA device: enqueues
 * device-to-host copies into pinned staging memory on `stream` (NULL: the legacy default
 * stream) and returns once they are enqueued, blocking only while the staging pool is full.
 * The copies run after the work already on `stream`; work enqueued on `stream` afterwards may
 * overwrite or free `data` at once, anything else must wait until ferry_writer_wait_snapshot,
 * ferry_writer_commit_async or ferry_writer_commit returns. All device tensors of one writer
 * are on one device; no other device is touched. FERRY_UNIMPLEMENTED without CUDA support. */
FERRY_API int ferry_writer_add_device_tensor_async(ferry_writer_t* writer, const char* name,
                                                   int32_t dtype, const int64_t* shape,
                                                   int32_t ndim, const void* data, uint64_t nbytes,
                                                   int32_t encoding, void* stream,
                                                   ferry_error_t* error);
/* Waits until every tensor added so far is in host memory (on the writer's own events, not on
 * the streams); every source buffer may then be reused. Reports the save's first error. */
FERRY_API int ferry_writer_wait_snapshot(ferry_writer_t* writer, ferry_error_t* error);
/* Converts the checkpoint at `src` into `dst`, atomically (nothing replaces `dst` unless the
 * whole conversion succeeds). `src`: a torch.save file (.pt, .bin), a sharded
 * pytorch_model.bin.index.json, a PyTorch Distributed Checkpoint folder, a safetensors file
 * or a TensorFerry checkpoint. PyTorch inputs are read without running their pickles: only
 * tensors, plain values and TransformerEngine extra state are imported, anything else is
 * refused with an error naming it. `dst` ending in ".safetensors" writes safetensors (PyTorch
 * inputs without FP8 scaling state only), ".ferry" a TensorFerry checkpoint written with
 * `options` (NULL: defaults); any other name is FERRY_INVALID_ARGUMENT, before anything is read
 * or written (a TensorFerry file named model.pt or model.safetensor would mislead its readers):
 * name the format with ferry_convert_to. So is a `dst` that exists and is not a regular file
 * (a directory, FIFO, device node or socket, or a link to one). Thread-safe (touches no shared
 * state). */
FERRY_API int ferry_convert(const char* src, const char* dst, const ferry_writer_options_t* options,
                            ferry_error_t* error);
/* As ferry_convert, with the output format named: `format` "ferry" (or "tensorferry") or
 * "safetensors", whatever `dst` is called; NULL or "" chooses by the extension, as
 * ferry_convert does. A format that contradicts the extension (format "ferry", dst
 * "x.safetensors") is FERRY_INVALID_ARGUMENT. */
FERRY_API int ferry_convert_to(const char* src, const char* dst, const char* format,
                               const ferry_writer_options_t* options, ferry_error_t* error);
/* Sets a string metadata entry (a later value for the same key replaces the earlier one). */
FERRY_API int ferry_writer_set_metadata(ferry_writer_t* writer, const char* key, const char* value,
                                        ferry_error_t* error);

/* ---- FP8 / FP4 scaling state (TransformerEngine recipes), stored as data, never pickled --- */

#define FERRY_FP8_FORMAT_E4M3 0
#define FERRY_FP8_FORMAT_E5M2 1
#define FERRY_FP8_FORMAT_HYBRID 2

#define FERRY_AMAX_COMPUTE_MAX 0
#define FERRY_AMAX_COMPUTE_MOST_RECENT 1

#define FERRY_RECIPE_NONE 0
#define FERRY_RECIPE_DELAYED_SCALING 1
#define FERRY_RECIPE_FLOAT8_CURRENT_SCALING 2
#define FERRY_RECIPE_MXFP8_BLOCK_SCALING 3
#define FERRY_RECIPE_FLOAT8_BLOCK_SCALING 4
#define FERRY_RECIPE_NVFP4_BLOCK_SCALING 5
#define FERRY_RECIPE_CUSTOM 6

#define FERRY_DIRECTION_FORWARD 0
#define FERRY_DIRECTION_BACKWARD 1

#define FERRY_SLOT_INPUT 0
#define FERRY_SLOT_WEIGHT 1
#define FERRY_SLOT_OUTPUT 2
#define FERRY_SLOT_GRAD_OUTPUT 3
#define FERRY_SLOT_GRAD_INPUT 4

/* A recipe: `kind` selects which fields mean something.
 * DELAYED_SCALING: fp8_format, margin, amax_history_len, amax_compute_algo, reduce_amax,
 *                  fp8_dpa, fp8_mha.
 * FLOAT8_CURRENT_SCALING: fp8_format, fp8_dpa, fp8_mha.
 * MXFP8_BLOCK_SCALING: fp8_format.
 * FLOAT8_BLOCK_SCALING: fp8_format, x/w/grad_block_scaling_dim.
 * NVFP4_BLOCK_SCALING: disable_rht, disable_stochastic_rounding, disable_2d_quantization.
 * CUSTOM: custom_name (required), custom_qfactory (may be NULL). */
typedef struct ferry_recipe_t {
  size_t struct_size;
  int32_t kind;
  int32_t fp8_format;
  int32_t margin;
  int32_t amax_history_len;
  int32_t amax_compute_algo;
  int32_t reduce_amax;
  int32_t fp8_dpa;
  int32_t fp8_mha;
  int32_t x_block_scaling_dim;
  int32_t w_block_scaling_dim;
  int32_t grad_block_scaling_dim;
  int32_t disable_rht;
  int32_t disable_stochastic_rounding;
  int32_t disable_2d_quantization;
  const char* custom_name;
  const char* custom_qfactory;
} ferry_recipe_t;

/* Sets struct_size, `kind`, and the schema's defaults for that kind. */
FERRY_API void ferry_recipe_init(ferry_recipe_t* recipe, int32_t kind);

/* The scaling state of one direction of one module: S = num_slots slots, L = history_len rows
 * of amax history stored F32[L, S] row-major (row 0 current). */
typedef struct ferry_direction_state_t {
  int32_t direction; /* FERRY_DIRECTION_* */
  int32_t num_gemms;
  int32_t num_slots;
  int32_t history_len;
  const int32_t* slot_roles; /* num_slots FERRY_SLOT_* values */
  const float* scale;        /* num_slots */
  const float* amax_history; /* history_len * num_slots */
} ferry_direction_state_t;

/* Records the scaling state of `module` (unique per checkpoint). Stateless recipes pass
 * num_states 0. Everything is copied before the call returns. */
FERRY_API int ferry_writer_add_scaling_state(ferry_writer_t* writer, const char* module,
                                             const ferry_recipe_t* recipe,
                                             const ferry_direction_state_t* states,
                                             size_t num_states, ferry_error_t* error);

/* Writes the footer, fsyncs (when durable) and atomically replaces the file at the path. The
 * writer is spent afterwards, whatever the result: free it. */
FERRY_API int ferry_writer_commit(ferry_writer_t* writer, ferry_error_t* error);
/* Waits for the snapshot (ferry_writer_wait_snapshot), then returns while compression, writes,
 * fsync and the atomic rename finish in the background; *out receives the save, whose
 * ferry_save_wait gives the final status. Every source buffer may be reused once this returns.
 * With a staging pool smaller than the checkpoint, the add calls already waited for earlier
 * blocks to be written (not fsynced) to free pool space: all but the last pool-full of bytes
 * are then in the file. The writer is spent afterwards, whatever the result: free it (the save
 * goes on without it). A crash before the save succeeds leaves the previous file untouched. */
FERRY_API int ferry_writer_commit_async(ferry_writer_t* writer, ferry_save_t** out,
                                        ferry_error_t* error);
/* Blocks until the save has finished; returns its final status (the same on every call). */
FERRY_API int ferry_save_wait(ferry_save_t* save, ferry_error_t* error);
/* 1 once the save has finished (ferry_save_wait would not block) or `save` is NULL, else 0. */
FERRY_API int ferry_save_done(const ferry_save_t* save);
/* Waits for the save to finish, then frees the handle. NULL is a no-op. */
FERRY_API void ferry_save_free(ferry_save_t* save);
/* Drops the temporary file; the path is untouched. Idempotent; NULL is a no-op. */
FERRY_API void ferry_writer_abort(ferry_writer_t* writer);
/* Aborts (if not committed) and frees. */
FERRY_API void ferry_writer_free(ferry_writer_t* writer);

/* ---- sharded checkpoints ------------------------------------------------------------------ */

/* Writes the index of a sharded checkpoint (ferry/sharded.hpp: "weight_map" of every tensor of
 * every file, "metadata" with "total_size") for shard files that already exist, relative to the
 * index's directory. Atomic: temporary file, fsync, rename, fsync of the directory. Keys and
 * values: `num_metadata` strings each (may be NULL when 0). FERRY_INVALID_ARGUMENT when two
 * files hold a tensor of the same name or a name is not a plain relative path. */
FERRY_API int ferry_write_shard_index(const char* index_path, const char* const* shard_files,
                                      size_t num_files, const char* const* metadata_keys,
                                      const char* const* metadata_values, size_t num_metadata,
                                      ferry_error_t* error);

/* ---- reader ------------------------------------------------------------------------------- */

typedef struct ferry_reader_t ferry_reader_t;

typedef struct ferry_reader_options_t {
  size_t struct_size;
  /* Check every tensor's checksums at open (reads the whole file). */
  int32_t verify_on_open;
  /* http://, https:// and s3:// paths (docs/STORAGE.md); 0 or NULL keeps the default, which
   * the environment may set (AWS_* variables, AWS_CA_BUNDLE, CURL_CA_BUNDLE, SSL_CERT_FILE).
   * ca_bundle: PEM file of the certificate authorities to trust (copied at open). */
  const char* ca_bundle;
  int32_t max_attempts;  /* attempts of one request before its error is returned (5) */
  int32_t max_in_flight; /* range GETs at once (8) */
  uint64_t piece_bytes;  /* bytes per range GET (8 MiB) */
} ferry_reader_options_t;

FERRY_API void ferry_reader_options_init(ferry_reader_options_t* options);

/* Opens `path`: a local file (mapped, or read with pread on network file systems), an
 * http:// or https:// URL, or an s3://bucket/key object (parallel range GETs, ETag pinned).
 * Checks trailer and footer and validates the index. FERRY_NOT_FOUND or FERRY_IO_ERROR for
 * file or network trouble, FERRY_INVALID_ARGUMENT for an unsupported URL, FERRY_DATA_LOSS for
 * any malformed byte. */
FERRY_API int ferry_reader_open(const char* path, const ferry_reader_options_t* options,
                                ferry_reader_t** out, ferry_error_t* error);
FERRY_API void ferry_reader_free(ferry_reader_t* reader);

/* Path, file size, format version and producer. Strings live as long as the reader. */
FERRY_API const char* ferry_reader_path(const ferry_reader_t* reader);
FERRY_API uint64_t ferry_reader_file_size(const ferry_reader_t* reader);
FERRY_API uint32_t ferry_reader_format_version(const ferry_reader_t* reader);
FERRY_API const char* ferry_reader_producer(const ferry_reader_t* reader);

/* Tensors are indexed 0..n-1 in name order. */
FERRY_API size_t ferry_reader_num_tensors(const ferry_reader_t* reader);

typedef struct ferry_tensor_info_t {
  size_t struct_size; /* set by the caller: sizeof(ferry_tensor_info_t) */
  const char* name;   /* owned by the reader */
  int32_t dtype;      /* ferry_dtype_t */
  int32_t ndim;
  const int64_t* shape; /* ndim entries, owned by the reader */
  uint64_t nbytes;      /* raw bytes */
  uint64_t data_offset; /* absolute file offset of the stored bytes */
  uint64_t data_size;   /* stored bytes (== nbytes for raw) */
  int32_t encoding;     /* FERRY_ENCODING_* */
  uint64_t block_size;  /* raw bytes per checksum block / chunk */
  size_t index;         /* position in name order */
} ferry_tensor_info_t;

FERRY_API int ferry_reader_tensor_info(const ferry_reader_t* reader, size_t index,
                                       ferry_tensor_info_t* info, ferry_error_t* error);
/* By exact name; FERRY_NOT_FOUND (naming file and tensor) when absent. */
FERRY_API int ferry_reader_find_tensor(const ferry_reader_t* reader, const char* name,
                                       ferry_tensor_info_t* info, ferry_error_t* error);

/* Every tensor's description in one call, for bindings that would otherwise cross this
 * boundary once per tensor (a mixture-of-experts checkpoint holds ~100,000). Built on the first
 * call (or the first ferry_reader_tensor_info / find_tensor) and kept by the reader: every
 * pointer lives as long as the reader; any number of threads may call it at once. */
typedef struct ferry_tensor_record_t {
  uint64_t name_offset;  /* into ferry_tensor_table_t.names, where the NUL-terminated name starts */
  uint64_t name_size;    /* bytes, without the NUL */
  uint64_t shape_offset; /* into ferry_tensor_table_t.shapes: ndim entries */
  uint64_t nbytes;       /* raw bytes */
  uint64_t data_offset;  /* absolute file offset of the stored bytes */
  uint64_t data_size;    /* stored bytes (== nbytes for raw) */
  uint64_t block_size;   /* raw bytes per checksum block / chunk */
  uint64_t packed_offset; /* where the tensor lands in a packed load (ferry_loader_load_packed) */
  int32_t dtype;          /* ferry_dtype_t */
  int32_t ndim;
  int32_t encoding; /* FERRY_ENCODING_* */
  int32_t reserved; /* 0 */
} ferry_tensor_record_t;

/* Alignment of every packed_offset (device copies and vector loads want aligned starts). */
#define FERRY_PACKED_ALIGNMENT 256

typedef struct ferry_tensor_table_t {
  size_t struct_size; /* set by the caller: sizeof(ferry_tensor_table_t) */
  size_t num_tensors; /* == ferry_reader_num_tensors */
  size_t record_size; /* stride of `records` in bytes (>= sizeof(ferry_tensor_record_t)) */
  const ferry_tensor_record_t* records; /* num_tensors records, in name order */
  /* Every name followed by one NUL byte, in name order (names never hold a NUL). */
  const char* names;
  uint64_t names_size; /* bytes of `names`, the NULs included */
  const int64_t* shapes;
  uint64_t num_shape_entries;
  /* Bytes a packed load needs: every tensor at its packed_offset. */
  uint64_t packed_bytes;
} ferry_tensor_table_t;

FERRY_API int ferry_reader_tensor_table(const ferry_reader_t* reader, ferry_tensor_table_t* table,
                                        ferry_error_t* error);

/* Metadata entries, in key order. Strings live as long as the reader. */
FERRY_API size_t ferry_reader_num_metadata(const ferry_reader_t* reader);
FERRY_API int ferry_reader_metadata_at(const ferry_reader_t* reader, size_t index, const char** key,
                                       const char** value, ferry_error_t* error);
/* As ferry_reader_metadata_at, with the strings' lengths in bytes: a value (of a safetensors
 * file, say) may hold NUL bytes, which a NUL-terminated string would hide. */
FERRY_API int ferry_reader_metadata_entry(const ferry_reader_t* reader, size_t index,
                                          const char** key, size_t* key_size, const char** value,
                                          size_t* value_size, ferry_error_t* error);
/* FERRY_NOT_FOUND when the key is absent. */
FERRY_API int ferry_reader_metadata_get(const ferry_reader_t* reader, const char* key,
                                        const char** value, ferry_error_t* error);

/* Scaling state, in module order. Pointers live as long as the reader. */
typedef struct ferry_scaling_state_t {
  size_t struct_size; /* set by the caller: sizeof(ferry_scaling_state_t) */
  const char* module;
  ferry_recipe_t recipe;
  size_t num_states;
  const ferry_direction_state_t* states;
} ferry_scaling_state_t;

FERRY_API size_t ferry_reader_num_scaling_states(const ferry_reader_t* reader);
FERRY_API int ferry_reader_scaling_state_at(const ferry_reader_t* reader, size_t index,
                                            ferry_scaling_state_t* state, ferry_error_t* error);
FERRY_API int ferry_reader_find_scaling_state(const ferry_reader_t* reader, const char* module,
                                              ferry_scaling_state_t* state, ferry_error_t* error);

/* Flags of the read calls. */
#define FERRY_READ_VERIFY 1u /* check the block checksums of the bytes read */

/* Zero-copy view of a raw-encoded tensor (kDLCPU): a private copy-on-write mapping of its bytes
 * in the file. It is writable, and a write copies the touched page into this process: it never
 * reaches the file, other views or other processes, and never faults (a DLPack consumer may
 * write without honouring a read-only flag). The tensor keeps the mapping alive until its
 * deleter runs, also after ferry_reader_free. FERRY_UNIMPLEMENTED for compressed tensors: use
 * ferry_reader_read_into. */
FERRY_API int ferry_reader_view(const ferry_reader_t* reader, const char* name, uint32_t flags,
                                DLManagedTensorVersioned** out, ferry_error_t* error);
/* Zero-copy view of the whole file (kDLCPU, U8, 1-D of the file's size): one private
 * copy-on-write mapping, as ferry_reader_view makes for one tensor, for a binding that hands
 * out every raw tensor of a load at once (each at its data_offset in the tensor table) with one
 * mapping instead of one per tensor (a process may hold only so many mappings). Writes stay in
 * this process and in this view. No checksum is verified: call ferry_reader_verify first where
 * wanted. The tensor keeps the mapping alive until its deleter runs, also after
 * ferry_reader_free. FERRY_UNIMPLEMENTED for a reader whose file is not mapped. */
FERRY_API int ferry_reader_view_file(const ferry_reader_t* reader, DLManagedTensorVersioned** out,
                                     ferry_error_t* error);
/* Copies (decoding as needed) the whole tensor into host memory `dst` of `dst_size` bytes
 * (at least the tensor's nbytes). */
FERRY_API int ferry_reader_read_into(const ferry_reader_t* reader, const char* name, void* dst,
                                     uint64_t dst_size, uint32_t flags, ferry_error_t* error);
/* Copies rows [row_begin, row_end) of dimension 0 (a tensor-parallel shard); row_end -1:
 * through the last row. */
FERRY_API int ferry_reader_read_rows_into(const ferry_reader_t* reader, const char* name,
                                          int64_t row_begin, int64_t row_end, void* dst,
                                          uint64_t dst_size, uint32_t flags, ferry_error_t* error);
/* Checks the checksums of one tensor, or of every tensor when `name` is NULL. */
FERRY_API int ferry_reader_verify(const ferry_reader_t* reader, const char* name,
                                  ferry_error_t* error);

/* ---- loader ------------------------------------------------------------------------------- */

typedef struct ferry_loader_t ferry_loader_t;

#define FERRY_HOST_PATH_AUTO 0
#define FERRY_HOST_PATH_STAGING 1          /* CPU copies into the pinned ring, then DMA */
#define FERRY_HOST_PATH_REGISTER 2         /* register the mapped file, DMA from the page cache */
#define FERRY_HOST_PATH_REGISTER_WINDOWS 3 /* register window by window (measured slower) */

#define FERRY_IO_AUTO 0       /* page cache when resident, else O_DIRECT (sampled per load) */
#define FERRY_IO_PAGE_CACHE 1 /* read through the file mapping */
#define FERRY_IO_DIRECT 2     /* O_DIRECT reads into the pinned ring (tmpfs: page cache) */

#define FERRY_PINNED_HOST_REGISTER 0 /* malloc + prefault + cudaHostRegister */
#define FERRY_PINNED_HOST_ALLOC 1    /* cudaHostAlloc */

typedef struct ferry_loader_options_t {
  size_t struct_size;
  uint64_t staging_bytes; /* total pinned staging memory */
  uint64_t slot_bytes;    /* bytes per staging slot and per DMA */
  int32_t threads;        /* CPU workers; 0: up to 16, 8 of them for uncompressed loads */
  int32_t host_path;      /* FERRY_HOST_PATH_* */
  int32_t pinned_alloc;   /* FERRY_PINNED_* */
  int32_t verify;         /* check block checksums while loading: 1 (the default), 0 opts out */
  int32_t io;             /* FERRY_IO_* */
  /* FERRY_HOST_PATH_REGISTER_WINDOWS: bytes of the mapping each worker registers at a time. */
  uint64_t register_window_bytes;
  int32_t streaming_stores; /* fill staging slots with non-temporal stores (measured slower) */
} ferry_loader_options_t;

FERRY_API void ferry_loader_options_init(ferry_loader_options_t* options);

/* 1 when this build has the CUDA loader and a device is usable, else 0. */
FERRY_API int ferry_cuda_available(void);

/* Creates a loader. Pinned staging memory is allocated on its first device load. */
FERRY_API int ferry_loader_create(const ferry_loader_options_t* options, ferry_loader_t** out,
                                  ferry_error_t* error);
/* Waits for the loader's own in-flight copies (its events only), then frees it. */
FERRY_API void ferry_loader_free(ferry_loader_t* loader);

/* Device memory from the caller's allocator (a framework's caching allocator, say). Called on
 * the loading thread with the target device current; memory must be usable in stream order
 * on `stream`. `allocate` returns NULL on failure. `deallocate` runs when the last tensor
 * using the memory is released (from whichever thread calls its deleter), so `ctx` and both
 * functions must stay valid until every tensor loaded with them is freed. */
typedef struct ferry_allocator_t {
  size_t struct_size;
  void* ctx;
  void* (*allocate)(void* ctx, uint64_t bytes, void* stream);
  void (*deallocate)(void* ctx, void* ptr, uint64_t bytes, void* stream);
} ferry_allocator_t;

/* One tensor, or a row range of one. With dst NULL the loader allocates (caller's allocator,
 * else cudaMallocAsync on the stream; malloc for host loads); else dst holds dst_bytes >= the
 * bytes loaded, on the target (current device memory, or host memory for host loads). */
typedef struct ferry_load_request_t {
  const char* name;
  int64_t row_begin; /* 0 for the whole tensor */
  int64_t row_end;   /* -1: through the last row */
  void* dst;
  uint64_t dst_bytes;
} ferry_load_request_t;

/* Fills a request for the whole tensor `name` into a loader-allocated buffer. */
FERRY_API void ferry_load_request_init(ferry_load_request_t* request, const char* name);

/* Loads tensors onto the calling thread's current CUDA device, enqueueing every copy on
 * `stream` (NULL: legacy default stream), and returns once all are enqueued; data is ready
 * when the stream reaches this point. `requests` has `num_requests` entries; num_requests 0
 * loads every tensor in name order. On success out[i] receives tensor i (num_requests
 * entries, or ferry_reader_num_tensors when num_requests is 0): kDLCUDA memory of the current
 * device; for a loader-allocated tensor its deleter frees the memory (stream-ordered on
 * `stream`); for a caller buffer the descriptor only. `out` may be NULL when every request
 * has a dst. `allocator` may be NULL. On failure no tensor is returned; copies already
 * enqueued into caller buffers may still land. */
FERRY_API int ferry_loader_load_async(ferry_loader_t* loader, const ferry_reader_t* reader,
                                      const ferry_load_request_t* requests, size_t num_requests,
                                      const ferry_allocator_t* allocator,
                                      DLManagedTensorVersioned** out, void* stream,
                                      ferry_error_t* error);
/* As ferry_loader_load_async, then waits for `stream` (that stream only). */
FERRY_API int ferry_loader_load(ferry_loader_t* loader, const ferry_reader_t* reader,
                                const ferry_load_request_t* requests, size_t num_requests,
                                const ferry_allocator_t* allocator, DLManagedTensorVersioned** out,
                                void* stream, ferry_error_t* error);
/* Loads into host memory (kDLCPU); needs no GPU. Same request and result rules. */
FERRY_API int ferry_loader_load_to_host(ferry_loader_t* loader, const ferry_reader_t* reader,
                                        const ferry_load_request_t* requests, size_t num_requests,
                                        DLManagedTensorVersioned** out, ferry_error_t* error);

/* Packed loads: every tensor of the checkpoint into one caller buffer, tensor i (name order)
 * at dst + records[i].packed_offset of ferry_reader_tensor_table, `dst_size` >= its
 * packed_bytes. One allocation instead of one per tensor, and no request list: what a binding
 * loading a whole checkpoint wants. Device loads take memory of the current device and copy
 * on `stream` like ferry_loader_load_async / ferry_loader_load; the host form needs no GPU. */
FERRY_API int ferry_loader_load_packed_async(ferry_loader_t* loader, const ferry_reader_t* reader,
                                             void* dst, uint64_t dst_size, void* stream,
                                             ferry_error_t* error);
FERRY_API int ferry_loader_load_packed(ferry_loader_t* loader, const ferry_reader_t* reader,
                                       void* dst, uint64_t dst_size, void* stream,
                                       ferry_error_t* error);
FERRY_API int ferry_loader_load_to_host_packed(ferry_loader_t* loader, const ferry_reader_t* reader,
                                               void* dst, uint64_t dst_size, ferry_error_t* error);

/* Streaming loads: every tensor handed to `on_ready` while the rest still loads, so a
 * framework can build modules as their weights land.
 * - hand_over FERRY_HAND_OVER_COMPLETE: once every copy into the tensor is complete (anything
 *   may read it). FERRY_HAND_OVER_ENQUEUED: once they are enqueued on `stream`, followed by
 *   `event` (a cudaEvent_t): work enqueued on `stream` afterwards runs after them; other
 *   streams wait with cudaStreamWaitEvent(event) inside the callback.
 * - on_ready(user, index, tensor, event): `index` is the request's position (with no
 *   requests, or in a packed load: the tensor's index in name order); `tensor` describes the
 *   destination (borrowed: valid during the call; the owning tensor comes in out[index] when
 *   the load returns); `event` is valid during the call, NULL for host loads. Calls come one at
 *   a time from one thread the loader starts (never a copy worker), in the order the tensors'
 *   last copies were enqueued. The callback must not call the same loader.
 * - The call returns once every tensor was handed over (with ENQUEUED, the stream then still
 *   runs the copies, as ferry_loader_load_async). Otherwise as the non-streaming forms. */
#define FERRY_HAND_OVER_COMPLETE 0
#define FERRY_HAND_OVER_ENQUEUED 1

typedef void (*ferry_ready_fn)(void* user, size_t index, const DLTensor* tensor, void* event);

FERRY_API int ferry_loader_load_streaming(ferry_loader_t* loader, const ferry_reader_t* reader,
                                          const ferry_load_request_t* requests, size_t num_requests,
                                          const ferry_allocator_t* allocator, int32_t hand_over,
                                          ferry_ready_fn on_ready, void* user,
                                          DLManagedTensorVersioned** out, void* stream,
                                          ferry_error_t* error);
FERRY_API int ferry_loader_load_to_host_streaming(ferry_loader_t* loader,
                                                  const ferry_reader_t* reader,
                                                  const ferry_load_request_t* requests,
                                                  size_t num_requests, ferry_ready_fn on_ready,
                                                  void* user, DLManagedTensorVersioned** out,
                                                  ferry_error_t* error);
/* Packed and streaming (device): as ferry_loader_load_packed, each tensor handed over. */
FERRY_API int ferry_loader_load_packed_streaming(ferry_loader_t* loader,
                                                 const ferry_reader_t* reader, void* dst,
                                                 uint64_t dst_size, int32_t hand_over,
                                                 ferry_ready_fn on_ready, void* user, void* stream,
                                                 ferry_error_t* error);

/* ---- sharded checkpoints and distributed plans ------------------------------------------ */

/* A sharded checkpoint: an index ("model.ferry.index.json" or "model.safetensors.index.json":
 * {"metadata": {...}, "weight_map": {tensor: shard file}}) over one reader per shard. The
 * index is parsed strictly and every shard must lie inside the index's directory. Immutable:
 * any number of threads may use one at once; free it with ferry_sharded_free (readers taken
 * from it stay valid). */
typedef struct ferry_sharded_t ferry_sharded_t;

/* Opens the index at `path` and every shard it names (each with `options`, may be NULL).
 * FERRY_DATA_LOSS, naming the index, for a malformed index or a tensor listed in the wrong
 * shard. */
FERRY_API int ferry_sharded_open(const char* path, const ferry_reader_options_t* options,
                                 ferry_sharded_t** out, ferry_error_t* error);
FERRY_API void ferry_sharded_free(ferry_sharded_t* sharded);
/* Shards are numbered in the byte order of their file names. */
FERRY_API size_t ferry_sharded_num_shards(const ferry_sharded_t* sharded);
/* A new reader handle of shard `shard` (free it with ferry_reader_free); it shares the shard's
 * open file with the sharded checkpoint. */
FERRY_API int ferry_sharded_shard(const ferry_sharded_t* sharded, size_t shard,
                                  ferry_reader_t** out, ferry_error_t* error);
/* The shard holding tensor `name`; FERRY_NOT_FOUND when no shard has it. */
FERRY_API int ferry_sharded_find(const ferry_sharded_t* sharded, const char* name, size_t* shard,
                                 ferry_error_t* error);

/* The distributed loader's split (ferry::SplitPlan): items, in the order every rank agrees
 * on, concatenated and cut into nranks * rounds segments, cuts snapped to row boundaries
 * (row_bytes 0: the item is not cut). Rank r reads segments [r * rounds, (r + 1) * rounds). */
typedef struct ferry_plan_item_t {
  uint64_t bytes;
  uint64_t row_bytes;
} ferry_plan_item_t;
typedef struct ferry_plan_piece_t {
  uint32_t item;    /* index into the items */
  uint32_t segment; /* rank = segment / rounds, round = segment % rounds */
  uint64_t begin;   /* byte range [begin, begin + len) of the item */
  uint64_t len;
} ferry_plan_piece_t;
/* Writes up to `capacity` pieces to `pieces` and their total count to *count; when capacity
 * is too small (0 to ask) nothing is written, *count is set and FERRY_OK returned. */
FERRY_API int ferry_split_plan(const ferry_plan_item_t* items, size_t num_items, int32_t nranks,
                               int32_t rounds, ferry_plan_piece_t* pieces, size_t capacity,
                               size_t* count, ferry_error_t* error);

/* ---- collectives of the caller's, sharded saves and distributed plans -------------------
 * For bindings that run their own collectives (torch.distributed, MPI, ...) instead of handing
 * the library an NCCL communicator: the library does the planning, naming, agreeing and
 * committing, and calls back for the one collective it needs. */

/* Replaces words[0, count) with their element-wise maximum, as unsigned 64-bit integers, over
 * every rank of the group, and returns 0 once the result is there; any other value fails the
 * call that made it on this rank (the other ranks then fail or wait in their next call: make
 * them fail too, as a broken communicator does). Every rank makes the same calls in the same
 * order with the same counts. Called on the thread that called the library, never on two
 * threads at once for one save or plan. */
typedef int32_t (*ferry_all_reduce_max_fn)(void* user, uint64_t* words, size_t count);

/* A single file as a one-shard checkpoint (so callers handle both forms alike). The new
 * handle shares the reader's open file; free it with ferry_sharded_free. */
FERRY_API int ferry_sharded_from_reader(const ferry_reader_t* reader, ferry_sharded_t** out,
                                        ferry_error_t* error);

/* A sharded checkpoint saved by every rank of a group at once (ferry::ShardedSave): each rank
 * writes its own tensors to its own shard file, in parallel, and rank 0 commits the index
 * (ferry_sharded_open's format) only after every shard is durable. Shard files are named
 * "<stem>-<save id>-<rank + 1>-of-<nranks>.ferry" beside the index ("<stem>.ferry.index.json",
 * "<stem>.index.json" or "<stem>.json"), with a save id no earlier save used, so the files of
 * the checkpoint the index names now are never touched before the new index replaces it: a
 * crash at any point leaves the previous checkpoint complete and loadable, or the new one.
 * Owned by its creator and used by one thread at a time; free it with
 * ferry_sharded_save_free. begin, commit and finish are collective (each calls
 * all_reduce_max). */
typedef struct ferry_sharded_save_t ferry_sharded_save_t;

typedef struct ferry_sharded_save_options_t {
  size_t struct_size;
  int32_t rank;                           /* this process's rank, 0 <= rank < nranks */
  int32_t nranks;                         /* at most 99999 */
  ferry_all_reduce_max_fn all_reduce_max; /* required; called with all_reduce_user */
  void* all_reduce_user;
  const ferry_writer_options_t* writer; /* this rank's shard file (NULL: the defaults) */
  /* Entries of the index's "metadata" ("total_size" is added when absent): num_metadata
   * strings each (may be NULL when 0). */
  const char* const* metadata_keys;
  const char* const* metadata_values;
  size_t num_metadata;
  /* After the commit, rank 0 deletes the shard files of the replaced index that follow the
   * naming above and are not part of the new checkpoint (1, the default). Other files are
   * never deleted. */
  int32_t remove_replaced;
} ferry_sharded_save_options_t;

FERRY_API void ferry_sharded_save_options_init(ferry_sharded_save_options_t* options);
/* Collective: rank 0 draws the save id, every rank learns it and opens its shard's writer,
 * and all agree that every rank could. The options (and what they point to) are copied;
 * all_reduce_max and its user pointer must stay usable until the save is freed.
 * FERRY_INVALID_ARGUMENT for a bad rank or nranks or a missing all_reduce_max. */
FERRY_API int ferry_sharded_save_begin(const char* index_path,
                                       const ferry_sharded_save_options_t* options,
                                       ferry_sharded_save_t** out, ferry_error_t* error);
/* This rank's shard: add its tensors (names unique across the ranks), metadata and scaling
 * state with the ferry_writer_* calls. The save owns it: valid until ferry_sharded_save_free,
 * ferry_writer_commit and _commit_async refuse it, ferry_writer_free is a no-op on it. To give
 * up on this rank (a tensor could not be added), ferry_writer_abort it and still commit: the
 * save then fails on every rank and no index is written. NULL for NULL. */
FERRY_API ferry_writer_t* ferry_sharded_save_writer(ferry_sharded_save_t* save);
/* The path of this rank's shard file ("" for NULL); valid while the save lives. */
FERRY_API const char* ferry_sharded_save_shard_path(const ferry_sharded_save_t* save);
/* Collective: commits this rank's shard (fsynced), agrees with the other ranks that every
 * shard is, then rank 0 writes the index atomically. The same status on every rank; on
 * failure every rank removes its new shard and the previous checkpoint stays as it was. */
FERRY_API int ferry_sharded_save_commit(ferry_sharded_save_t* save, ferry_error_t* error);
/* Not collective: starts this rank's shard commit in the background and returns once its
 * tensors are snapshotted (their buffers may then be reused). ferry_sharded_save_finish must
 * follow on every rank, even when this call failed. */
FERRY_API int ferry_sharded_save_commit_async(ferry_sharded_save_t* save, ferry_error_t* error);
/* 1 once this rank's shard is no longer being written (committed, or the background commit
 * finished or failed), else 0; no communication. 1 for NULL. */
FERRY_API int ferry_sharded_save_shard_done(const ferry_sharded_save_t* save);
/* Collective: waits for this rank's background shard commit, then agrees and commits the
 * index as ferry_sharded_save_commit does. */
FERRY_API int ferry_sharded_save_finish(ferry_sharded_save_t* save, ferry_error_t* error);
/* Frees the save; a shard that was not committed is removed. Freeing a save on one rank
 * before its commit leaves the other ranks waiting in their next collective. */
FERRY_API void ferry_sharded_save_free(ferry_sharded_save_t* save);

/* The plan of a distributed load for callers that move the bytes themselves (the NCCL form is
 * ferry::DistributedLoader): the replicated tensors, in file order, form one byte sequence cut
 * into nranks * rounds segments at row boundaries (ferry_split_plan); rank r reads segments
 * [r * rounds, (r + 1) * rounds) into place, and the broadcasts deliver every segment to every
 * rank. Entries below own_min_bytes share one arena (256-byte aligned), and the arena pieces of
 * one segment travel in one broadcast; larger entries get a buffer of their own. Every rank
 * that passes the same checkpoint, requests and options gets the same plan. Immutable after
 * create (ferry_dist_plan_conclude calls all_reduce_max); free with ferry_dist_plan_free. */
typedef struct ferry_dist_plan_t ferry_dist_plan_t;

typedef struct ferry_dist_plan_options_t {
  size_t struct_size;
  int32_t rank;
  int32_t nranks;
  int32_t rounds;         /* pieces per rank, 1 to 64 (default 4) */
  int32_t check_plan;     /* all ranks compare a hash of their plans at create (default 1) */
  uint64_t own_min_bytes; /* entries this large get their own buffer (default UINT64_MAX) */
  /* The collective for check_plan and ferry_dist_plan_conclude, called with all_reduce_user;
   * it must stay usable until the plan is freed. */
  ferry_all_reduce_max_fn all_reduce_max;
  void* all_reduce_user;
  /* Tensors this rank reads alone (its tensor-parallel slices): checked to exist at create,
   * so that a missing one fails the plan on every rank; they are not in the plan. */
  const char* const* local_names;
  size_t num_local;
} ferry_dist_plan_options_t;

FERRY_API void ferry_dist_plan_options_init(ferry_dist_plan_options_t* options);

#define FERRY_DIST_OWN_BUFFER UINT64_MAX

typedef struct ferry_dist_item_t {
  const char* name; /* the tensor */
  size_t request;   /* its index in the requests (in the checkpoint's names when none) */
  uint32_t shard;   /* in ferry_sharded_shard's numbering */
  int32_t reserved;
  uint64_t bytes;        /* raw bytes delivered (of the requested rows) */
  uint64_t row_bytes;    /* bytes of one row where it may be cut, else 0 */
  uint64_t arena_offset; /* where it lies in the arena, or FERRY_DIST_OWN_BUFFER */
  int64_t row_begin;     /* the requested rows (0 and -1: the whole tensor) */
  int64_t row_end;
} ferry_dist_item_t;

/* One broadcast from rank `root`: `bytes` bytes from byte `begin` of item `item`'s buffer; an
 * arena broadcast (item's arena_offset set) covers arena bytes [arena_offset + begin,
 * arena_offset + begin + bytes), which may run on through the items that follow. */
typedef struct ferry_dist_broadcast_t {
  int32_t round;
  int32_t root;
  uint32_t item;
  int32_t reserved;
  uint64_t begin;
  uint64_t bytes;
} ferry_dist_broadcast_t;

/* A piece this rank reads: rows [row_begin, row_end) of item `item`'s tensor (0 and -1: the
 * whole tensor), `bytes` bytes that land at byte `begin` of the item's buffer. */
typedef struct ferry_dist_read_t {
  int32_t round;
  uint32_t item;
  uint64_t begin;
  uint64_t bytes;
  int64_t row_begin;
  int64_t row_end;
} ferry_dist_read_t;

/* The whole plan, pointing into the plan handle (valid until it is freed). Broadcasts come in
 * the order every rank issues them: round by round, and within a round by root; reads round
 * by round. A round's reads must be complete (or ordered before) its broadcasts. */
typedef struct ferry_dist_plan_view_t {
  size_t struct_size;
  size_t num_items;
  const ferry_dist_item_t* items;
  uint64_t arena_bytes;
  size_t num_broadcasts;
  const ferry_dist_broadcast_t* broadcasts;
  size_t num_reads;
  const ferry_dist_read_t* reads;
  int32_t rounds;
} ferry_dist_plan_view_t;

/* Collective when check_plan: plans the load of `requests` (NULL and 0: every tensor, whole;
 * dst must be NULL, since the plan places every item) from `checkpoint`. A request naming no
 * tensor, or a failed plan on any rank, fails on every rank (the others with
 * FERRY_INVALID_ARGUMENT: the ranks disagree or another rank failed to plan). */
FERRY_API int ferry_dist_plan_create(const ferry_sharded_t* checkpoint,
                                     const ferry_load_request_t* requests, size_t num_requests,
                                     const ferry_dist_plan_options_t* options,
                                     ferry_dist_plan_t** out, ferry_error_t* error);
FERRY_API int ferry_dist_plan_view(const ferry_dist_plan_t* plan, ferry_dist_plan_view_t* view,
                                   ferry_error_t* error);
/* Collective: after the reads and broadcasts, every rank learns whether any rank failed
 * (`failed` 1 on this rank). FERRY_OK when none did; FERRY_INTERNAL, naming the checkpoint and
 * this rank, when this or another rank failed. */
FERRY_API int ferry_dist_plan_conclude(ferry_dist_plan_t* plan, int32_t failed,
                                       ferry_error_t* error);
FERRY_API void ferry_dist_plan_free(ferry_dist_plan_t* plan);

#ifdef __cplusplus
}
#endif

#endif /* FERRY_FERRY_H_ */
