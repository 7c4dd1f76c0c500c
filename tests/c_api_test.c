/* C API test: a plain C99 program (built with -std=c99 -pedantic -Werror) that writes,
 * reads, views and loads a checkpoint through include/ferry/ferry.h alone, and checks error
 * codes and messages. Exits non-zero on any failed check.
 * Usage: c_api_test <scratch directory> */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ferry/ferry.h"

static int g_failures = 0;
static int g_checks = 0;

#define CHECK(cond)                                                            \
  do {                                                                         \
    ++g_checks;                                                                \
    if (!(cond)) {                                                             \
      ++g_failures;                                                            \
      fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
    }                                                                          \
  } while (0)

/* Checks that a call succeeded, printing the library's message when it did not. Every caller
 * has a `ferry_error_t err` in scope and passes &err. */
#define CHECK_OK(call)                                                          \
  do {                                                                          \
    int rc_;                                                                    \
    ++g_checks;                                                                 \
    rc_ = (call);                                                               \
    if (rc_ != FERRY_OK) {                                                      \
      ++g_failures;                                                             \
      fprintf(stderr, "%s:%d: %s returned %s: %s\n", __FILE__, __LINE__, #call, \
              ferry_status_name(rc_), err.message);                             \
    }                                                                           \
  } while (0)

static char g_dir[512];

static void path_of(char* out, size_t size, const char* name) {
  snprintf(out, size, "%s/%s", g_dir, name);
}

static int contains(const char* haystack, const char* needle) {
  return strstr(haystack, needle) != NULL;
}

static int file_exists(const char* path) {
  FILE* f = fopen(path, "rb");
  if (f == NULL) return 0;
  fclose(f);
  return 1;
}

/* ---- fixtures -------------------------------------------------------------------------- */

static float g_matrix[6][4];  /* F32 [6, 4] */
static uint16_t g_bf16[3000]; /* BF16 bit patterns, compressible */
static uint8_t g_fp4[3];      /* F4 [5]: 5 elements, 3 bytes, last high nibble zero */
static uint8_t g_fp8[16];     /* F8_E4M3FN [2, 8] */
static int64_t g_scalar = -42;

static void make_fixtures(void) {
  int i, j;
  for (i = 0; i < 6; ++i) {
    for (j = 0; j < 4; ++j) g_matrix[i][j] = (float)(i * 10 + j);
  }
  for (i = 0; i < 3000; ++i) g_bf16[i] = (uint16_t)(0x3f80 + (i % 7));
  g_fp4[0] = 0x21;
  g_fp4[1] = 0x43;
  g_fp4[2] = 0x05;
  for (i = 0; i < 16; ++i) g_fp8[i] = (uint8_t)(i * 9);
}

static int write_checkpoint(const char* path) {
  ferry_writer_options_t opts;
  ferry_writer_t* w = NULL;
  ferry_error_t err;
  int64_t shape_m[2] = {6, 4};
  int64_t shape_b[1] = {3000};
  int64_t shape_f4[1] = {5};
  ferry_recipe_t recipe;
  ferry_direction_state_t dirs[2];
  int32_t roles_fwd[3] = {FERRY_SLOT_INPUT, FERRY_SLOT_WEIGHT, FERRY_SLOT_OUTPUT};
  int32_t roles_bwd[2] = {FERRY_SLOT_GRAD_OUTPUT, FERRY_SLOT_GRAD_INPUT};
  float scale_fwd[3] = {1.0f, 2.0f, 4.0f};
  float scale_bwd[2] = {0.5f, 0.25f};
  float hist_fwd[2 * 3] = {1, 2, 3, 4, 5, 6};
  float hist_bwd[2 * 2] = {7, 8, 9, 10};
  DLTensor dl;
  int64_t dl_shape[2] = {2, 8};
  int rc;

  ferry_writer_options_init(&opts);
  CHECK(opts.struct_size == sizeof(opts));
  CHECK(opts.encoding == FERRY_ENCODING_RAW);
  opts.durable = 0;
  opts.producer = "c_api_test";
  rc = ferry_writer_create(path, &opts, &w, &err);
  CHECK(rc == FERRY_OK);
  if (rc != FERRY_OK) return rc;

  CHECK_OK(ferry_writer_add_tensor(w, "matrix", FERRY_DTYPE_F32, shape_m, 2, g_matrix,
                                   sizeof(g_matrix), FERRY_ENCODING_DEFAULT, &err));
  CHECK_OK(ferry_writer_add_tensor(w, "bf16", FERRY_DTYPE_BF16, shape_b, 1, g_bf16, sizeof(g_bf16),
                                   FERRY_ENCODING_SHUFFLE_ZSTD, &err));
  CHECK_OK(ferry_writer_add_tensor(w, "fp4", FERRY_DTYPE_F4_E2M1FN, shape_f4, 1, g_fp4,
                                   sizeof(g_fp4), FERRY_ENCODING_RAW, &err));
  CHECK_OK(ferry_writer_add_tensor(w, "scalar", FERRY_DTYPE_I64, NULL, 0, &g_scalar,
                                   sizeof(g_scalar), FERRY_ENCODING_DEFAULT, &err));

  /* A DLTensor source, as other frameworks hand them over. */
  memset(&dl, 0, sizeof(dl));
  dl.data = g_fp8;
  dl.device.device_type = kDLCPU;
  dl.device.device_id = 0;
  dl.ndim = 2;
  dl.dtype.code = kDLFloat8_e4m3fn;
  dl.dtype.bits = 8;
  dl.dtype.lanes = 1;
  dl.shape = dl_shape;
  dl.strides = NULL;
  CHECK_OK(ferry_writer_add_dltensor(w, "fp8", &dl, FERRY_ENCODING_DEFAULT, &err));

  /* A device DLTensor is refused with a message, not dereferenced. */
  dl.device.device_type = kDLCUDA;
  rc = ferry_writer_add_dltensor(w, "on_gpu", &dl, FERRY_ENCODING_DEFAULT, &err);
  CHECK(rc == FERRY_INVALID_ARGUMENT);
  CHECK(err.code == FERRY_INVALID_ARGUMENT);
  CHECK(contains(err.message, "'on_gpu'"));
  CHECK(contains(err.message, "host memory"));

  /* Wrong byte count names the tensor. */
  rc = ferry_writer_add_tensor(w, "short", FERRY_DTYPE_F32, shape_m, 2, g_matrix, 8,
                               FERRY_ENCODING_DEFAULT, &err);
  CHECK(rc == FERRY_INVALID_ARGUMENT);
  CHECK(contains(err.message, "'short'"));
  rc = ferry_writer_add_tensor(w, "bad_dtype", 99, shape_m, 2, g_matrix, sizeof(g_matrix),
                               FERRY_ENCODING_DEFAULT, &err);
  CHECK(rc == FERRY_INVALID_ARGUMENT);

  CHECK_OK(ferry_writer_set_metadata(w, "step", "1200", &err));
  CHECK_OK(ferry_writer_set_metadata(w, "framework", "c", &err));

  ferry_recipe_init(&recipe, FERRY_RECIPE_DELAYED_SCALING);
  CHECK(recipe.fp8_format == FERRY_FP8_FORMAT_HYBRID);
  CHECK(recipe.amax_history_len == 1024);
  CHECK(recipe.reduce_amax == 1);
  recipe.margin = 2;
  recipe.amax_history_len = 2;
  recipe.amax_compute_algo = FERRY_AMAX_COMPUTE_MOST_RECENT;
  recipe.fp8_mha = 1;
  dirs[0].direction = FERRY_DIRECTION_FORWARD;
  dirs[0].num_gemms = 1;
  dirs[0].num_slots = 3;
  dirs[0].history_len = 2;
  dirs[0].slot_roles = roles_fwd;
  dirs[0].scale = scale_fwd;
  dirs[0].amax_history = hist_fwd;
  dirs[1].direction = FERRY_DIRECTION_BACKWARD;
  dirs[1].num_gemms = 1;
  dirs[1].num_slots = 2;
  dirs[1].history_len = 2;
  dirs[1].slot_roles = roles_bwd;
  dirs[1].scale = scale_bwd;
  dirs[1].amax_history = hist_bwd;
  CHECK_OK(ferry_writer_add_scaling_state(w, "layers.0.fc1", &recipe, dirs, 2, &err));

  ferry_recipe_init(&recipe, FERRY_RECIPE_CUSTOM);
  rc = ferry_writer_add_scaling_state(w, "custom_without_name", &recipe, NULL, 0, &err);
  CHECK(rc == FERRY_INVALID_ARGUMENT);
  CHECK(contains(err.message,
                 "c_api_test.ferry: scaling state 'custom_without_name': a custom "
                 "recipe needs custom_name"));
  ferry_recipe_init(&recipe, FERRY_RECIPE_MXFP8_BLOCK_SCALING);
  recipe.fp8_format = 9;
  rc = ferry_writer_add_scaling_state(w, "m", &recipe, NULL, 0, &err);
  CHECK(rc == FERRY_INVALID_ARGUMENT);
  CHECK(contains(err.message, "scaling state 'm': recipe field fp8_format has invalid value 9"));
  ferry_recipe_init(&recipe, FERRY_RECIPE_CUSTOM);
  dirs[0].direction = 5;
  rc = ferry_writer_add_scaling_state(w, "d", &recipe, dirs, 1, &err);
  CHECK(rc == FERRY_INVALID_ARGUMENT);
  CHECK(contains(err.message, "scaling state 'd': a custom recipe needs custom_name"));
  recipe.custom_name = "x";
  rc = ferry_writer_add_scaling_state(w, "d", &recipe, dirs, 1, &err);
  CHECK(rc == FERRY_INVALID_ARGUMENT);
  CHECK(contains(err.message, "scaling state 'd' direction 0: invalid direction 5"));
  dirs[0].direction = FERRY_DIRECTION_FORWARD;
  ferry_recipe_init(&recipe, FERRY_RECIPE_CUSTOM);
  recipe.custom_name = "my_recipe";
  CHECK_OK(ferry_writer_add_scaling_state(w, "layers.1.custom", &recipe, NULL, 0, &err));

  rc = ferry_writer_commit(w, &err);
  CHECK(rc == FERRY_OK);
  /* The writer is spent: a second commit is an error, not a crash. */
  CHECK(ferry_writer_commit(w, &err) == FERRY_INVALID_ARGUMENT);
  ferry_writer_free(w);
  return rc;
}

/* ---- tests ----------------------------------------------------------------------------- */

static void test_version_and_dtypes(void) {
  DLDataType t;
  int32_t d, back;
  uint64_t n;
  ferry_error_t err;
  CHECK(strcmp(ferry_version(), FERRY_VERSION_STRING) == 0);
  CHECK(ferry_format_version() == 1);
  CHECK(FERRY_VERSION ==
        FERRY_VERSION_MAJOR * 10000 + FERRY_VERSION_MINOR * 100 + FERRY_VERSION_PATCH);
  CHECK(strcmp(ferry_status_name(FERRY_DATA_LOSS), "DataLoss") == 0);
  CHECK(strcmp(ferry_status_name(1234), "Unknown") == 0);
  CHECK(strcmp(ferry_dtype_name(FERRY_DTYPE_F8_E4M3FN), "F8_E4M3FN") == 0);
  CHECK(strcmp(ferry_dtype_name(-1), "?") == 0);
  CHECK_OK(ferry_dtype_parse("BF16", &d, &err));
  CHECK(d == FERRY_DTYPE_BF16);
  CHECK(ferry_dtype_parse("F9", &d, &err) == FERRY_NOT_FOUND);

  CHECK_OK(ferry_dtype_to_dlpack(FERRY_DTYPE_F8_E4M3FN, &t, &err));
  CHECK(t.code == kDLFloat8_e4m3fn && t.code == 10 && t.bits == 8 && t.lanes == 1);
  CHECK_OK(ferry_dtype_to_dlpack(FERRY_DTYPE_F8_E5M2FNUZ, &t, &err));
  CHECK(t.code == kDLFloat8_e5m2fnuz && t.bits == 8);
  CHECK_OK(ferry_dtype_to_dlpack(FERRY_DTYPE_F8_E8M0FNU, &t, &err));
  CHECK(t.code == kDLFloat8_e8m0fnu);
  CHECK_OK(ferry_dtype_to_dlpack(FERRY_DTYPE_F6_E3M2FN, &t, &err));
  CHECK(t.code == kDLFloat6_e3m2fn && t.bits == 6);
  CHECK_OK(ferry_dtype_to_dlpack(FERRY_DTYPE_F4_E2M1FN, &t, &err));
  CHECK(t.code == kDLFloat4_e2m1fn && t.code == 17 && t.bits == 4);
  CHECK_OK(ferry_dtype_to_dlpack(FERRY_DTYPE_BF16, &t, &err));
  CHECK(t.code == kDLBfloat && t.bits == 16);
  CHECK_OK(ferry_dtype_to_dlpack(FERRY_DTYPE_C128, &t, &err));
  CHECK(t.code == kDLComplex && t.bits == 128);
  CHECK_OK(ferry_dtype_to_dlpack(FERRY_DTYPE_BOOL, &t, &err));
  CHECK(t.code == kDLBool && t.bits == 8);
  CHECK(ferry_dtype_to_dlpack(FERRY_NUM_DTYPES, &t, &err) == FERRY_INVALID_ARGUMENT);

  /* Every dtype maps to a distinct DLPack type and back. */
  for (d = 0; d < FERRY_NUM_DTYPES; ++d) {
    CHECK_OK(ferry_dtype_to_dlpack(d, &t, &err));
    CHECK_OK(ferry_dtype_from_dlpack(t, &back, &err));
    CHECK(back == d);
  }
  t.code = kDLFloat;
  t.bits = 32;
  t.lanes = 4;
  CHECK(ferry_dtype_from_dlpack(t, &back, &err) == FERRY_INVALID_ARGUMENT);
  CHECK(contains(err.message, "lanes 4"));

  CHECK_OK(ferry_dtype_storage_bytes(FERRY_DTYPE_F4_E2M1FN, 5, &n, &err));
  CHECK(n == 3);
  CHECK_OK(ferry_dtype_storage_bytes(FERRY_DTYPE_C64, 3, &n, &err));
  CHECK(n == 24);
}

static void test_null_handles(void) {
  ferry_error_t err;
  ferry_tensor_info_t info;
  /* free(NULL) and abort(NULL) are no-ops; NULL handles give errors, not crashes. */
  ferry_writer_free(NULL);
  ferry_writer_abort(NULL);
  ferry_reader_free(NULL);
  ferry_loader_free(NULL);
  ferry_dlpack_free(NULL);
  ferry_dlpack_legacy_free(NULL);
  CHECK(ferry_reader_num_tensors(NULL) == 0);
  info.struct_size = sizeof(info);
  CHECK(ferry_reader_tensor_info(NULL, 0, &info, &err) == FERRY_INVALID_ARGUMENT);
  CHECK(contains(err.message, "reader must not be NULL"));
  CHECK(ferry_writer_create(NULL, NULL, NULL, NULL) == FERRY_INVALID_ARGUMENT);
}

static void test_read(const char* path) {
  ferry_reader_t* r = NULL;
  ferry_reader_options_t ropts;
  ferry_tensor_info_t info;
  ferry_error_t err;
  ferry_scaling_state_t st;
  DLManagedTensorVersioned* view = NULL;
  DLManagedTensor* legacy = NULL;
  const char* value = NULL;
  const char* key = NULL;
  float rows[2][4];
  uint16_t bf16[3000];
  int rc;

  ferry_reader_options_init(&ropts);
  ropts.verify_on_open = 1;
  rc = ferry_reader_open(path, &ropts, &r, &err);
  CHECK(rc == FERRY_OK);
  if (rc != FERRY_OK) {
    fprintf(stderr, "open: %s\n", err.message);
    return;
  }
  CHECK(strcmp(ferry_reader_path(r), path) == 0);
  CHECK(ferry_reader_format_version(r) == 1);
  CHECK(strcmp(ferry_reader_producer(r), "c_api_test") == 0);
  CHECK(ferry_reader_file_size(r) > 4096);
  CHECK(ferry_reader_num_tensors(r) == 5);

  /* Name order: bf16, fp4, fp8, matrix, scalar. */
  info.struct_size = sizeof(info);
  CHECK_OK(ferry_reader_tensor_info(r, 0, &info, &err));
  CHECK(strcmp(info.name, "bf16") == 0);
  CHECK(info.dtype == FERRY_DTYPE_BF16);
  CHECK(info.encoding == FERRY_ENCODING_SHUFFLE_ZSTD);
  CHECK(info.nbytes == sizeof(g_bf16));
  CHECK(info.data_size < info.nbytes);
  CHECK(info.index == 0);
  CHECK(ferry_reader_tensor_info(r, 5, &info, &err) == FERRY_INVALID_ARGUMENT);
  CHECK(contains(err.message, "out of range"));

  CHECK_OK(ferry_reader_find_tensor(r, "matrix", &info, &err));
  CHECK(info.dtype == FERRY_DTYPE_F32 && info.ndim == 2);
  CHECK(info.shape[0] == 6 && info.shape[1] == 4);
  CHECK(info.index == 3);
  CHECK(info.data_offset % 64 == 0);
  CHECK_OK(ferry_reader_find_tensor(r, "fp4", &info, &err));
  CHECK(info.dtype == FERRY_DTYPE_F4_E2M1FN && info.shape[0] == 5 && info.nbytes == 3);
  CHECK_OK(ferry_reader_find_tensor(r, "scalar", &info, &err));
  CHECK(info.ndim == 0);

  /* A caller compiled against a shorter struct gets only what fits. */
  {
    ferry_tensor_info_t small;
    memset(&small, 0xAB, sizeof(small));
    small.struct_size = offsetof(ferry_tensor_info_t, dtype) + sizeof(int32_t);
    CHECK_OK(ferry_reader_find_tensor(r, "matrix", &small, &err));
    CHECK(strcmp(small.name, "matrix") == 0);
    CHECK(small.dtype == FERRY_DTYPE_F32);
    CHECK(small.struct_size == offsetof(ferry_tensor_info_t, dtype) + sizeof(int32_t));
    CHECK(small.nbytes == 0xABABABABABABABABull); /* untouched */
  }

  /* Missing tensor: NOT_FOUND, the message names the file and the tensor. */
  err.code = 0;
  rc = ferry_reader_find_tensor(r, "nope", &info, &err);
  CHECK(rc == FERRY_NOT_FOUND);
  CHECK(err.code == FERRY_NOT_FOUND);
  CHECK(contains(err.message, path));
  CHECK(contains(err.message, "'nope'"));
  /* The error struct is optional. */
  CHECK(ferry_reader_find_tensor(r, "nope", &info, NULL) == FERRY_NOT_FOUND);

  /* Metadata. */
  CHECK(ferry_reader_num_metadata(r) == 2);
  CHECK_OK(ferry_reader_metadata_at(r, 0, &key, &value, &err));
  CHECK(strcmp(key, "framework") == 0 && strcmp(value, "c") == 0);
  CHECK_OK(ferry_reader_metadata_get(r, "step", &value, &err));
  CHECK(strcmp(value, "1200") == 0);
  CHECK(ferry_reader_metadata_get(r, "epoch", &value, &err) == FERRY_NOT_FOUND);
  CHECK(contains(err.message, "'epoch'"));

  /* Scaling state comes back as data. */
  CHECK(ferry_reader_num_scaling_states(r) == 2);
  st.struct_size = sizeof(st);
  CHECK_OK(ferry_reader_find_scaling_state(r, "layers.0.fc1", &st, &err));
  CHECK(st.recipe.kind == FERRY_RECIPE_DELAYED_SCALING);
  CHECK(st.recipe.margin == 2);
  CHECK(st.recipe.amax_history_len == 2);
  CHECK(st.recipe.amax_compute_algo == FERRY_AMAX_COMPUTE_MOST_RECENT);
  CHECK(st.recipe.fp8_format == FERRY_FP8_FORMAT_HYBRID);
  CHECK(st.recipe.fp8_mha == 1 && st.recipe.fp8_dpa == 0 && st.recipe.reduce_amax == 1);
  CHECK(st.num_states == 2);
  if (st.num_states == 2) {
    CHECK(st.states[0].direction == FERRY_DIRECTION_FORWARD);
    CHECK(st.states[0].num_slots == 3 && st.states[0].history_len == 2);
    CHECK(st.states[0].slot_roles[1] == FERRY_SLOT_WEIGHT);
    CHECK(st.states[0].scale[2] == 4.0f);
    CHECK(st.states[0].amax_history[5] == 6.0f);
    CHECK(st.states[1].direction == FERRY_DIRECTION_BACKWARD);
    CHECK(st.states[1].slot_roles[0] == FERRY_SLOT_GRAD_OUTPUT);
    CHECK(st.states[1].amax_history[3] == 10.0f);
  }
  CHECK_OK(ferry_reader_scaling_state_at(r, 1, &st, &err));
  CHECK(strcmp(st.module, "layers.1.custom") == 0);
  CHECK(st.recipe.kind == FERRY_RECIPE_CUSTOM);
  CHECK(strcmp(st.recipe.custom_name, "my_recipe") == 0);
  CHECK(st.num_states == 0);
  CHECK(ferry_reader_find_scaling_state(r, "layers.9", &st, &err) == FERRY_NOT_FOUND);

  /* Copies, whole and by rows; compressed tensors decode. */
  memset(bf16, 0, sizeof(bf16));
  CHECK_OK(ferry_reader_read_into(r, "bf16", bf16, sizeof(bf16), FERRY_READ_VERIFY, &err));
  CHECK(memcmp(bf16, g_bf16, sizeof(bf16)) == 0);
  CHECK_OK(ferry_reader_read_rows_into(r, "matrix", 2, 4, rows, sizeof(rows), 0, &err));
  CHECK(rows[0][0] == 20.0f && rows[1][3] == 33.0f);
  CHECK(ferry_reader_read_rows_into(r, "matrix", 4, 9, rows, sizeof(rows), 0, &err) ==
        FERRY_INVALID_ARGUMENT);
  CHECK(contains(err.message, "'matrix'"));
  CHECK(ferry_reader_read_into(r, "matrix", rows, sizeof(rows), 0, &err) == FERRY_INVALID_ARGUMENT);
  CHECK(contains(err.message, "destination holds 32"));
  CHECK_OK(ferry_reader_verify(r, "bf16", &err));
  CHECK_OK(ferry_reader_verify(r, NULL, &err));

  /* Zero-copy view: CPU, dense, a private copy-on-write mapping; it outlives the reader. */
  CHECK(ferry_reader_view(r, "bf16", 0, &view, &err) == FERRY_UNIMPLEMENTED);
  CHECK(contains(err.message, "ReadInto"));
  CHECK_OK(ferry_reader_view(r, "matrix", FERRY_READ_VERIFY, &view, &err));
  ferry_reader_free(r);
  r = NULL;
  if (view != NULL) {
    const DLTensor* t = &view->dl_tensor;
    CHECK(view->version.major == 1);
    CHECK((view->flags & DLPACK_FLAG_BITMASK_READ_ONLY) == 0);
    CHECK(t->device.device_type == kDLCPU);
    CHECK(t->ndim == 2 && t->shape[0] == 6 && t->shape[1] == 4);
    CHECK(t->strides[0] == 4 && t->strides[1] == 1);
    CHECK(t->dtype.code == kDLFloat && t->dtype.bits == 32 && t->dtype.lanes == 1);
    CHECK(t->byte_offset == 0);
    CHECK(memcmp(t->data, g_matrix, sizeof(g_matrix)) == 0);
    {
      /* A consumer's write stays in its view: neither the file nor a new view sees it. */
      DLManagedTensorVersioned* other = NULL;
      float back[6][4];
      ((float*)t->data)[0] = -1.0f;
      CHECK_OK(ferry_reader_open(path, NULL, &r, &err));
      CHECK_OK(ferry_reader_view(r, "matrix", 0, &other, &err));
      if (other != NULL) CHECK(((const float*)other->dl_tensor.data)[0] == g_matrix[0][0]);
      ferry_dlpack_free(other);
      CHECK_OK(ferry_reader_read_into(r, "matrix", back, sizeof(back), FERRY_READ_VERIFY, &err));
      CHECK(memcmp(back, g_matrix, sizeof(back)) == 0);
      ferry_reader_free(r);
      r = NULL;
      ((float*)t->data)[0] = g_matrix[0][0];
    }
    /* Legacy wrapping owns the versioned tensor. */
    CHECK_OK(ferry_dlpack_to_legacy(view, &legacy, &err));
    CHECK(legacy->dl_tensor.data == t->data);
    CHECK(legacy->dl_tensor.shape[1] == 4);
    ferry_dlpack_legacy_free(legacy);
  }
}

static void test_loader_host(const char* path) {
  ferry_reader_t* r = NULL;
  ferry_loader_t* l = NULL;
  ferry_loader_options_t lopts;
  ferry_error_t err;
  DLManagedTensorVersioned* all[5];
  DLManagedTensorVersioned* some[2];
  ferry_load_request_t req[2];
  uint8_t fp4_buf[3];
  size_t i;

  CHECK_OK(ferry_reader_open(path, NULL, &r, &err));
  ferry_loader_options_init(&lopts);
  CHECK(lopts.struct_size == sizeof(lopts));
  CHECK(lopts.staging_bytes > 0 && lopts.slot_bytes > 0);
  lopts.threads = 2;
  lopts.verify = 1;
  CHECK_OK(ferry_loader_create(&lopts, &l, &err));
  if (r == NULL || l == NULL) {
    ferry_reader_free(r);
    ferry_loader_free(l);
    return;
  }

  /* Every tensor, loader-allocated host memory. */
  memset(all, 0, sizeof(all));
  CHECK_OK(ferry_loader_load_to_host(l, r, NULL, 0, all, &err));
  if (all[3] != NULL) {
    CHECK(all[3]->dl_tensor.device.device_type == kDLCPU);
    CHECK((all[3]->flags & DLPACK_FLAG_BITMASK_READ_ONLY) == 0);
    CHECK((all[3]->flags & DLPACK_FLAG_BITMASK_IS_COPIED) != 0);
    CHECK(memcmp(all[3]->dl_tensor.data, g_matrix, sizeof(g_matrix)) == 0);
    CHECK(memcmp(all[0]->dl_tensor.data, g_bf16, sizeof(g_bf16)) == 0);
    CHECK(*(const int64_t*)all[4]->dl_tensor.data == -42);
    CHECK(all[4]->dl_tensor.ndim == 0);
    CHECK(all[1]->dl_tensor.dtype.bits == 4 && all[1]->dl_tensor.shape[0] == 5);
  }
  for (i = 0; i < 5; ++i) ferry_dlpack_free(all[i]);

  /* A row range into loader memory, and a whole tensor into a caller buffer. */
  ferry_load_request_init(&req[0], "matrix");
  req[0].row_begin = 1;
  req[0].row_end = 3;
  ferry_load_request_init(&req[1], "fp4");
  req[1].dst = fp4_buf;
  req[1].dst_bytes = sizeof(fp4_buf);
  memset(some, 0, sizeof(some));
  CHECK_OK(ferry_loader_load_to_host(l, r, req, 2, some, &err));
  if (some[0] != NULL && some[1] != NULL) {
    const float* rows = (const float*)some[0]->dl_tensor.data;
    CHECK(some[0]->dl_tensor.shape[0] == 2 && some[0]->dl_tensor.shape[1] == 4);
    CHECK(rows[0] == 10.0f && rows[7] == 23.0f);
    CHECK(some[1]->dl_tensor.data == (void*)fp4_buf);
    CHECK((some[1]->flags & DLPACK_FLAG_BITMASK_IS_COPIED) == 0);
    CHECK(memcmp(fp4_buf, g_fp4, 3) == 0);
  }
  ferry_dlpack_free(some[0]);
  ferry_dlpack_free(some[1]);

  /* out may be NULL only when nothing is allocated for the caller. */
  CHECK(ferry_loader_load_to_host(l, r, req, 1, NULL, &err) == FERRY_INVALID_ARGUMENT);
  CHECK_OK(ferry_loader_load_to_host(l, r, &req[1], 1, NULL, &err));

  ferry_load_request_init(&req[0], "missing");
  CHECK(ferry_loader_load_to_host(l, r, req, 1, some, &err) == FERRY_NOT_FOUND);
  CHECK(contains(err.message, "'missing'"));

  if (ferry_cuda_available()) {
    /* Device load on the current device and the legacy default stream. */
    DLManagedTensorVersioned* dev[5];
    memset(dev, 0, sizeof(dev));
    CHECK_OK(ferry_loader_load(l, r, NULL, 0, NULL, dev, NULL, &err));
    for (i = 0; i < 5; ++i) {
      CHECK(dev[i] != NULL && dev[i]->dl_tensor.device.device_type == kDLCUDA);
      ferry_dlpack_free(dev[i]);
    }
    printf("c_api_test: device load checked\n");
  } else {
    printf("c_api_test: no CUDA device, device load skipped\n");
  }

  ferry_loader_free(l);
  ferry_reader_free(r);
}

/* Every description in one call, consistent with the per-tensor calls, and a packed host
 * load of every tensor into one buffer. */
static void test_tensor_table(const char* path) {
  ferry_reader_t* r = NULL;
  ferry_loader_t* l = NULL;
  ferry_error_t err;
  ferry_tensor_table_t table;
  ferry_tensor_info_t info;
  uint8_t* packed = NULL;
  const char* expect_names[5] = {"bf16", "fp4", "fp8", "matrix", "scalar"};
  uint64_t name_at = 0, end = 0;
  size_t i;
  int d;

  CHECK_OK(ferry_reader_open(path, NULL, &r, &err));
  CHECK_OK(ferry_loader_create(NULL, &l, &err));
  if (r == NULL || l == NULL) {
    ferry_reader_free(r);
    ferry_loader_free(l);
    return;
  }
  memset(&table, 0, sizeof(table));
  CHECK(ferry_reader_tensor_table(r, &table, &err) == FERRY_INVALID_ARGUMENT);
  CHECK(contains(err.message, "struct_size"));
  table.struct_size = sizeof(table);
  CHECK_OK(ferry_reader_tensor_table(r, &table, &err));
  CHECK(table.num_tensors == 5 && table.num_tensors == ferry_reader_num_tensors(r));
  CHECK(table.record_size >= sizeof(ferry_tensor_record_t));
  for (i = 0; i < table.num_tensors && i < 5; ++i) {
    const ferry_tensor_record_t* rec =
        (const ferry_tensor_record_t*)((const char*)table.records + i * table.record_size);
    info.struct_size = sizeof(info);
    CHECK_OK(ferry_reader_tensor_info(r, i, &info, &err));
    /* Names back to back, each followed by a NUL; the info's name points into the table. */
    CHECK(rec->name_offset == name_at);
    CHECK(strcmp(table.names + rec->name_offset, expect_names[i]) == 0);
    CHECK(rec->name_size == strlen(expect_names[i]));
    CHECK(info.name == table.names + rec->name_offset);
    name_at += rec->name_size + 1;
    CHECK(rec->dtype == info.dtype && rec->ndim == info.ndim && rec->nbytes == info.nbytes);
    CHECK(rec->data_offset == info.data_offset && rec->data_size == info.data_size);
    CHECK(rec->encoding == info.encoding && rec->block_size == info.block_size);
    CHECK(rec->reserved == 0);
    for (d = 0; d < rec->ndim; ++d) CHECK(table.shapes[rec->shape_offset + d] == info.shape[d]);
    /* Packed offsets: aligned, in name order, no overlap, all inside packed_bytes. */
    CHECK(rec->packed_offset % FERRY_PACKED_ALIGNMENT == 0);
    CHECK(rec->packed_offset >= end);
    end = rec->packed_offset + rec->nbytes;
  }
  CHECK(name_at == table.names_size);
  CHECK(end <= table.packed_bytes);

  CHECK(ferry_loader_load_to_host_packed(l, r, NULL, table.packed_bytes, &err) ==
        FERRY_INVALID_ARGUMENT);
  CHECK(contains(err.message, "dst"));
  packed = (uint8_t*)malloc(table.packed_bytes);
  if (packed != NULL && table.num_tensors == 5) {
    const ferry_tensor_record_t* rec = table.records;
    CHECK(ferry_loader_load_to_host_packed(l, r, packed, table.packed_bytes - 1, &err) ==
          FERRY_INVALID_ARGUMENT);
    CHECK(contains(err.message, "packed load needs"));
    memset(packed, 0xAB, table.packed_bytes);
    CHECK_OK(ferry_loader_load_to_host_packed(l, r, packed, table.packed_bytes, &err));
    /* Table records are in name order: bf16 (shuffle+zstd), fp4, fp8, matrix, scalar. */
    CHECK(memcmp(packed + rec[0].packed_offset, g_bf16, sizeof(g_bf16)) == 0);
    CHECK(memcmp(packed + rec[1].packed_offset, g_fp4, sizeof(g_fp4)) == 0);
    CHECK(memcmp(packed + rec[2].packed_offset, g_fp8, sizeof(g_fp8)) == 0);
    CHECK(memcmp(packed + rec[3].packed_offset, g_matrix, sizeof(g_matrix)) == 0);
    CHECK(memcmp(packed + rec[4].packed_offset, &g_scalar, sizeof(g_scalar)) == 0);
    /* Padding between tensors is left alone. */
    CHECK(packed[rec[1].packed_offset + sizeof(g_fp4)] == 0xAB);
  }
  free(packed);
  ferry_loader_free(l);
  ferry_reader_free(r);
}

/* Streaming host loads: each tensor handed over once, loaded already, with its index. */
struct ready_log {
  int calls;
  int seen[5];
  int bytes_ok;
};

static void on_ready_host(void* user, size_t index, const DLTensor* tensor, void* event) {
  struct ready_log* log = (struct ready_log*)user;
  ++log->calls;
  if (index >= 5 || event != NULL || tensor == NULL) {
    log->bytes_ok = 0;
    return;
  }
  ++log->seen[index];
  /* Name order: bf16, fp4, fp8, matrix, scalar. */
  if (index == 0) log->bytes_ok &= memcmp(tensor->data, g_bf16, sizeof(g_bf16)) == 0;
  if (index == 3) {
    log->bytes_ok &= tensor->ndim == 2 && tensor->shape[0] == 6 && tensor->shape[1] == 4;
    log->bytes_ok &= memcmp(tensor->data, g_matrix, sizeof(g_matrix)) == 0;
  }
  if (index == 4) log->bytes_ok &= *(const int64_t*)tensor->data == -42;
}

static void test_streaming_host(const char* path) {
  ferry_reader_t* r = NULL;
  ferry_loader_t* l = NULL;
  ferry_error_t err;
  DLManagedTensorVersioned* all[5];
  struct ready_log log;
  size_t i;

  CHECK_OK(ferry_reader_open(path, NULL, &r, &err));
  CHECK_OK(ferry_loader_create(NULL, &l, &err));
  if (r == NULL || l == NULL) {
    ferry_reader_free(r);
    ferry_loader_free(l);
    return;
  }
  memset(&log, 0, sizeof(log));
  log.bytes_ok = 1;
  memset(all, 0, sizeof(all));
  CHECK_OK(ferry_loader_load_to_host_streaming(l, r, NULL, 0, on_ready_host, &log, all, &err));
  CHECK(log.calls == 5);
  for (i = 0; i < 5; ++i) CHECK(log.seen[i] == 1);
  CHECK(log.bytes_ok);
  if (all[3] != NULL) CHECK(memcmp(all[3]->dl_tensor.data, g_matrix, sizeof(g_matrix)) == 0);
  for (i = 0; i < 5; ++i) ferry_dlpack_free(all[i]);

  CHECK(ferry_loader_load_to_host_streaming(l, r, NULL, 0, NULL, &log, all, &err) ==
        FERRY_INVALID_ARGUMENT);
  CHECK(contains(err.message, "on_ready"));
  CHECK(ferry_loader_load_packed_streaming(l, r, NULL, 0, 7, on_ready_host, &log, NULL, &err) ==
        FERRY_INVALID_ARGUMENT);
  CHECK(contains(err.message, "hand_over 7"));
  ferry_loader_free(l);
  ferry_reader_free(r);
}

/* ferry_convert writes the format its destination's extension names and refuses any other
 * name (a TensorFerry file called model.pt would mislead torch.load); ferry_convert_to names the
 * format. Neither replaces something that is not a regular file. */
static void test_convert(const char* path) {
  char dst[600];
  ferry_error_t err;
  ferry_reader_t* r = NULL;
  const char* refused[] = {"model.pt", "pytorch_model.bin", "model.safetensor", "model"};
  size_t i;

  for (i = 0; i < sizeof(refused) / sizeof(refused[0]); ++i) {
    path_of(dst, sizeof(dst), refused[i]);
    CHECK(ferry_convert(path, dst, NULL, &err) == FERRY_INVALID_ARGUMENT);
    CHECK(contains(err.message, refused[i]));
    CHECK(contains(err.message, "cannot tell which format to write"));
    CHECK(contains(err.message, "ferry_convert_to"));
    CHECK(!file_exists(dst));
  }
  path_of(dst, sizeof(dst), "model.pt");
  CHECK(ferry_convert_to(path, dst, "safetensors", NULL, &err) == FERRY_UNIMPLEMENTED);
  CHECK(ferry_convert_to(path, dst, "pickle", NULL, &err) == FERRY_INVALID_ARGUMENT);
  CHECK(contains(err.message, "unknown output format 'pickle'"));
  CHECK_OK(ferry_convert_to(path, dst, "ferry", NULL, &err));
  CHECK_OK(ferry_reader_open(dst, NULL, &r, &err));
  CHECK(ferry_reader_num_tensors(r) == 5);
  ferry_reader_free(r);
  remove(dst);
  path_of(dst, sizeof(dst), "converted.ferry");
  CHECK_OK(ferry_convert(path, dst, NULL, &err));
  remove(dst);
  path_of(dst, sizeof(dst), "converted.safetensors");
  CHECK(ferry_convert_to(path, dst, "ferry", NULL, &err) == FERRY_INVALID_ARGUMENT);
  CHECK(contains(err.message, "the name says safetensors"));
  /* The scratch directory itself as the destination. */
  CHECK(ferry_convert_to(path, g_dir, "ferry", NULL, &err) == FERRY_INVALID_ARGUMENT);
  CHECK(contains(err.message, "is a directory, not a regular file"));
}

/* The whole file as one private copy-on-write mapping: every raw tensor at its data_offset,
 * writable, and a write reaches neither the file nor a later view. */
static void test_view_file(const char* path) {
  ferry_reader_t* r = NULL;
  ferry_error_t err;
  ferry_tensor_info_t info;
  DLManagedTensorVersioned* file = NULL;
  DLManagedTensorVersioned* again = NULL;
  uint8_t* bytes;

  CHECK_OK(ferry_reader_open(path, NULL, &r, &err));
  if (r == NULL) return;
  CHECK(ferry_reader_view_file(NULL, &file, &err) == FERRY_INVALID_ARGUMENT);
  CHECK_OK(ferry_reader_view_file(r, &file, &err));
  if (file == NULL) {
    ferry_reader_free(r);
    return;
  }
  CHECK(file->dl_tensor.ndim == 1);
  CHECK((uint64_t)file->dl_tensor.shape[0] == ferry_reader_file_size(r));
  CHECK(file->dl_tensor.device.device_type == kDLCPU);
  CHECK(file->dl_tensor.dtype.code == kDLUInt && file->dl_tensor.dtype.bits == 8);
  CHECK((file->flags & DLPACK_FLAG_BITMASK_READ_ONLY) == 0);
  bytes = (uint8_t*)file->dl_tensor.data;
  CHECK(memcmp(bytes, "TFERRY01", 8) == 0);
  info.struct_size = sizeof(info);
  CHECK_OK(ferry_reader_find_tensor(r, "matrix", &info, &err));
  CHECK(memcmp(bytes + info.data_offset, g_matrix, sizeof(g_matrix)) == 0);
  bytes[info.data_offset] ^= 0xFF;
  ferry_reader_free(r); /* the view outlives its reader */
  CHECK(bytes[0] == 'T');
  r = NULL;
  CHECK_OK(ferry_reader_open(path, NULL, &r, &err));
  CHECK_OK(ferry_reader_view_file(r, &again, &err));
  if (again != NULL) {
    CHECK(memcmp((uint8_t*)again->dl_tensor.data + info.data_offset, g_matrix, sizeof(g_matrix)) ==
          0);
    ferry_dlpack_free(again);
  }
  CHECK_OK(ferry_reader_verify(r, NULL, &err));
  ferry_dlpack_free(file);
  ferry_reader_free(r);
}

static void test_errors(const char* path) {
  char missing[600], corrupt[600];
  ferry_reader_t* r = NULL;
  ferry_error_t err;
  ferry_writer_t* w = NULL;
  FILE* in;
  FILE* out;
  long size;
  char* bytes;
  int rc;

  path_of(missing, sizeof(missing), "does_not_exist.ferry");
  rc = ferry_reader_open(missing, NULL, &r, &err);
  CHECK(rc == FERRY_NOT_FOUND);
  CHECK(r == NULL);
  CHECK(contains(err.message, "does_not_exist.ferry"));

  /* Flip a byte of the footer: the checksum catches it and the message has an offset. */
  path_of(corrupt, sizeof(corrupt), "corrupt.ferry");
  in = fopen(path, "rb");
  CHECK(in != NULL);
  if (in == NULL) return;
  fseek(in, 0, SEEK_END);
  size = ftell(in);
  fseek(in, 0, SEEK_SET);
  bytes = (char*)malloc((size_t)size);
  CHECK(fread(bytes, 1, (size_t)size, in) == (size_t)size);
  fclose(in);
  bytes[size - 40] ^= 0x5a;
  out = fopen(corrupt, "wb");
  CHECK(fwrite(bytes, 1, (size_t)size, out) == (size_t)size);
  fclose(out);
  free(bytes);
  rc = ferry_reader_open(corrupt, NULL, &r, &err);
  CHECK(rc == FERRY_DATA_LOSS);
  CHECK(contains(err.message, "corrupt.ferry"));
  CHECK(contains(err.message, "offset"));
  remove(corrupt);

  /* A writer that is freed without commit leaves the old file untouched. */
  CHECK_OK(ferry_writer_create(path, NULL, &w, &err));
  CHECK_OK(ferry_writer_add_tensor(w, "x", FERRY_DTYPE_U8, NULL, 0, "a", 1, FERRY_ENCODING_DEFAULT,
                                   &err));
  ferry_writer_abort(w);
  ferry_writer_abort(w);
  ferry_writer_free(w);
  CHECK_OK(ferry_reader_open(path, NULL, &r, &err));
  CHECK(ferry_reader_num_tensors(r) == 5);
  ferry_reader_free(r);

  /* Bad options are refused with a message. */
  {
    ferry_writer_options_t opts;
    ferry_writer_options_init(&opts);
    opts.struct_size = 0;
    CHECK(ferry_writer_create(corrupt, &opts, &w, &err) == FERRY_INVALID_ARGUMENT);
    CHECK(contains(err.message, "struct_size"));
    CHECK(!file_exists(corrupt));
  }
}

/* A save that the system refuses names its destination, never the temporary file beside it,
 * and keeps the system's errno reachable, even when the message is cut to fit. */
static void test_save_errors(const char* path) {
  char dst[1400];
  ferry_error_t err;
  ferry_writer_t* w = NULL;
  size_t n;

  path_of(dst, sizeof(dst), "no_such_folder/out.ferry");
  CHECK(ferry_writer_create(dst, NULL, &w, &err) == FERRY_IO_ERROR);
  CHECK(w == NULL);
  CHECK(strncmp(err.message, dst, strlen(dst)) == 0);
  CHECK(!contains(err.message, ".tmp."));
  CHECK(ferry_error_errno(&err) == ENOENT);
  path_of(dst, sizeof(dst), "no_such_folder/converted.ferry");
  CHECK(ferry_convert(path, dst, NULL, &err) == FERRY_IO_ERROR);
  CHECK(strncmp(err.message, dst, strlen(dst)) == 0);
  CHECK(!contains(err.message, ".tmp."));
  CHECK(ferry_error_errno(&err) == ENOENT);

  /* A destination longer than the message buffer: the cut keeps the end and its errno. */
  path_of(dst, sizeof(dst), "no_such_folder/");
  n = strlen(dst);
  while (n + 201 < sizeof(dst) - 16) {
    memset(dst + n, 'd', 200);
    dst[n + 200] = '/';
    n += 201;
  }
  strcpy(dst + n, "out.ferry");
  CHECK(strlen(dst) >= FERRY_ERROR_MESSAGE_SIZE);
  CHECK(ferry_writer_create(dst, NULL, &w, &err) == FERRY_IO_ERROR);
  CHECK(strlen(err.message) == FERRY_ERROR_MESSAGE_SIZE - 1);
  CHECK(strncmp(err.message, dst, 100) == 0);
  CHECK(contains(err.message, " ... "));
  CHECK(ferry_error_errno(&err) == ENOENT);

  /* Errors the system did not give carry no errno. */
  CHECK(ferry_writer_create(NULL, NULL, &w, &err) == FERRY_INVALID_ARGUMENT);
  CHECK(ferry_error_errno(&err) == 0);
  CHECK(ferry_error_errno(NULL) == 0);
}

/* An asynchronous save through a staging pool, then a sharded index over two files. */
static void test_async_and_shards(void) {
  ferry_error_t err;
  ferry_staging_pool_t* pool = NULL;
  ferry_writer_options_t opts;
  ferry_writer_t* w = NULL;
  ferry_save_t* save = NULL;
  ferry_reader_t* r = NULL;
  char path[600], a[600], b[600], index[600];
  const char* files[2] = {"c_api_a.ferry", "c_api_b.ferry"};
  const char* keys[1] = {"step"};
  const char* values[1] = {"5"};
  int64_t shape[1] = {3000};
  uint16_t copy[3000];
  float out[6][4];
  int64_t s = 4;

  CHECK(ferry_staging_pool_create(100, 0, &pool, &err) == FERRY_INVALID_ARGUMENT);
  CHECK(ferry_staging_pool_create(1 << 16, 0, &pool, &err) == FERRY_OK);
  CHECK(ferry_staging_pool_bytes(pool) == (1 << 16));
  path_of(path, sizeof(path), "c_api_async.ferry");
  ferry_writer_options_init(&opts);
  opts.staging = pool;
  CHECK(opts.direct_io == 1);
  opts.block_size = 4096;
  opts.durable = 0;
  CHECK(ferry_writer_create(path, &opts, &w, &err) == FERRY_OK);
  ferry_staging_pool_free(pool); /* the writer keeps its own reference */
  memcpy(copy, g_bf16, sizeof(copy));
  CHECK(ferry_writer_add_tensor(w, "bf16", FERRY_DTYPE_BF16, shape, 1, copy, sizeof(copy),
                                FERRY_ENCODING_SHUFFLE_ZSTD, &err) == FERRY_OK);
  memset(copy, 0, sizeof(copy)); /* snapshotted: the file keeps the original */
  CHECK(ferry_writer_add_tensor(w, "matrix", FERRY_DTYPE_F32, (const int64_t[]){6, 4}, 2, g_matrix,
                                sizeof(g_matrix), FERRY_ENCODING_DEFAULT, &err) == FERRY_OK);
  CHECK(ferry_writer_wait_snapshot(w, &err) == FERRY_OK);
  CHECK(ferry_writer_commit_async(w, NULL, &err) == FERRY_INVALID_ARGUMENT);
  CHECK(ferry_writer_commit_async(w, &save, &err) == FERRY_OK);
  CHECK(ferry_writer_commit_async(w, &save, &err) == FERRY_INVALID_ARGUMENT);
  ferry_writer_free(w);
  CHECK(ferry_save_wait(save, &err) == FERRY_OK);
  CHECK(ferry_save_done(save) == 1);
  CHECK(ferry_save_wait(save, &err) == FERRY_OK);
  ferry_save_free(save);
  ferry_save_free(NULL);
  CHECK(ferry_save_done(NULL) == 1);
  CHECK(ferry_reader_open(path, NULL, &r, &err) == FERRY_OK);
  if (r != NULL) {
    CHECK(ferry_reader_read_into(r, "bf16", copy, sizeof(copy), FERRY_READ_VERIFY, &err) ==
          FERRY_OK);
    CHECK(memcmp(copy, g_bf16, sizeof(copy)) == 0);
    CHECK(ferry_reader_read_into(r, "matrix", out, sizeof(out), 0, &err) == FERRY_OK);
    CHECK(memcmp(out, g_matrix, sizeof(out)) == 0);
    ferry_reader_free(r);
  }
  remove(path);

  /* Without a GPU (or without CUDA), a device tensor is refused with a clear error. */
  CHECK(ferry_writer_create(path, NULL, &w, &err) == FERRY_OK);
  if (!ferry_cuda_available()) {
    int rc = ferry_writer_add_device_tensor_async(w, "dev", FERRY_DTYPE_I64, NULL, 0, &s, sizeof(s),
                                                  FERRY_ENCODING_DEFAULT, NULL, &err);
    CHECK(rc == FERRY_UNIMPLEMENTED || rc == FERRY_CUDA_ERROR);
    CHECK(contains(err.message, "'dev'"));
  }
  ferry_writer_free(w);

  path_of(a, sizeof(a), files[0]);
  path_of(b, sizeof(b), files[1]);
  path_of(index, sizeof(index), "c_api.ferry.index.json");
  CHECK(ferry_writer_create(a, NULL, &w, &err) == FERRY_OK);
  CHECK(ferry_writer_add_tensor(w, "x", FERRY_DTYPE_I64, NULL, 0, &s, 8, -1, &err) == FERRY_OK);
  CHECK(ferry_writer_commit(w, &err) == FERRY_OK);
  ferry_writer_free(w);
  CHECK(ferry_writer_create(b, NULL, &w, &err) == FERRY_OK);
  CHECK(ferry_writer_add_tensor(w, "y", FERRY_DTYPE_I64, NULL, 0, &s, 8, -1, &err) == FERRY_OK);
  CHECK(ferry_writer_commit(w, &err) == FERRY_OK);
  ferry_writer_free(w);
  CHECK(ferry_write_shard_index(index, files, 2, keys, values, 1, &err) == FERRY_OK);
  CHECK(file_exists(index));
  CHECK(ferry_write_shard_index(index, NULL, 2, NULL, NULL, 0, &err) == FERRY_INVALID_ARGUMENT);
  files[1] = files[0];
  CHECK(ferry_write_shard_index(index, files, 2, NULL, NULL, 0, &err) == FERRY_INVALID_ARGUMENT);
  CHECK(contains(err.message, "'x'"));
  remove(a);
  remove(b);
  remove(index);
}

/* A sharded index over the test checkpoint; its tensors are found in shard 0. */
static void test_sharded(const char* ckpt) {
  char index[600];
  ferry_error_t err = {0};
  ferry_sharded_t* s = NULL;
  ferry_reader_t* shard = NULL;
  size_t where = 99;
  FILE* f;
  const char* slash = strrchr(ckpt, '/');
  path_of(index, sizeof(index), "c_api_test.ferry.index.json");
  f = fopen(index, "w");
  CHECK(f != NULL);
  if (f == NULL) return;
  fprintf(f,
          "{\"weight_map\": {\"bf16\": \"%s\", \"fp4\": \"%s\", \"fp8\": \"%s\", "
          "\"matrix\": \"%s\", \"scalar\": \"%s\"}}",
          slash + 1, slash + 1, slash + 1, slash + 1, slash + 1);
  fclose(f);
  CHECK(ferry_sharded_open(index, NULL, &s, &err) == FERRY_OK);
  if (s == NULL) {
    fprintf(stderr, "  %s\n", err.message);
    remove(index);
    return;
  }
  CHECK(ferry_sharded_num_shards(s) == 1);
  CHECK(ferry_sharded_find(s, "matrix", &where, &err) == FERRY_OK && where == 0);
  CHECK(ferry_sharded_find(s, "nope", &where, &err) == FERRY_NOT_FOUND);
  CHECK(contains(err.message, "'nope'"));
  CHECK(ferry_sharded_shard(s, 1, &shard, &err) == FERRY_INVALID_ARGUMENT);
  CHECK(ferry_sharded_shard(s, 0, &shard, &err) == FERRY_OK);
  ferry_sharded_free(s); /* the shard's reader outlives the sharded handle */
  CHECK(shard != NULL && ferry_reader_num_tensors(shard) == 5);
  ferry_reader_free(shard);
  f = fopen(index, "w");
  if (f != NULL) {
    fputs("{\"weight_map\": {\"matrix\": \"../escape.ferry\"}}", f);
    fclose(f);
  }
  s = NULL;
  CHECK(ferry_sharded_open(index, NULL, &s, &err) == FERRY_DATA_LOSS && s == NULL);
  CHECK(contains(err.message, "not a relative path inside the index's directory"));
  remove(index);
}

/* The split plan through the C API: every byte of every item once, cut on rows. */
static void test_split_plan(void) {
  ferry_plan_item_t items[3] = {{100, 0}, {300, 30}, {100, 10}};
  ferry_plan_piece_t pieces[16];
  size_t count = 0, i;
  uint64_t covered[3] = {0, 0, 0};
  ferry_error_t err = {0};
  CHECK(ferry_split_plan(items, 3, 2, 2, NULL, 0, &count, &err) == FERRY_OK);
  CHECK(count >= 3 && count <= 16);
  if (count > 16) return;
  CHECK(ferry_split_plan(items, 3, 2, 2, pieces, 16, &count, &err) == FERRY_OK);
  for (i = 0; i < count; ++i) {
    CHECK(pieces[i].segment < 4);
    CHECK(pieces[i].begin == covered[pieces[i].item]);
    if (items[pieces[i].item].row_bytes > 0)
      CHECK(pieces[i].begin % items[pieces[i].item].row_bytes == 0);
    covered[pieces[i].item] += pieces[i].len;
  }
  CHECK(covered[0] == 100 && covered[1] == 300 && covered[2] == 100);
  CHECK(ferry_split_plan(items, 3, 0, 1, pieces, 16, &count, &err) == FERRY_INVALID_ARGUMENT);
}

/* ---- the caller's collectives ---------------------------------------------------------- */

/* A group whose other ranks live in this test: the all-reduce takes the maximum with the words
 * a previous call recorded for "the others" (g_others), and records what it was given. */
static uint64_t g_others[4];
static uint64_t g_given[4];
static int g_reduce_calls = 0;
static int32_t g_reduce_rc = 0;

static int32_t fake_all_reduce(void* user, uint64_t* words, size_t count) {
  size_t i;
  CHECK(user == &g_reduce_calls);
  CHECK(count <= 4);
  ++g_reduce_calls;
  if (g_reduce_rc != 0) return g_reduce_rc;
  for (i = 0; i < count && i < 4; ++i) {
    g_given[i] = words[i];
    if (g_others[i] > words[i]) words[i] = g_others[i];
  }
  return 0;
}

static void reset_group(void) {
  memset(g_others, 0, sizeof(g_others));
  g_reduce_calls = 0;
  g_reduce_rc = 0;
}

/* A one-rank sharded save through the C API, committed twice: the second replaces the first
 * and removes its shard; a rank that gives up fails the save and leaves the index alone. */
static void test_sharded_save(void) {
  ferry_error_t err = {0};
  ferry_sharded_save_options_t opts;
  ferry_writer_options_t wopts;
  ferry_sharded_save_t* save = NULL;
  ferry_sharded_t* s = NULL;
  ferry_writer_t* w;
  char index[600], first[600];
  const char* keys[1] = {"step"};
  const char* values[1] = {"7"};
  int64_t v = 11, back = 0;
  size_t where;
  ferry_reader_t* r = NULL;

  path_of(index, sizeof(index), "c_api_save.ferry.index.json");
  reset_group();
  ferry_sharded_save_options_init(&opts);
  CHECK(opts.struct_size == sizeof(opts));
  CHECK(opts.nranks == 1 && opts.rank == 0 && opts.remove_replaced == 1);
  /* No collective: refused before anything is written. */
  CHECK(ferry_sharded_save_begin(index, &opts, &save, &err) == FERRY_INVALID_ARGUMENT);
  CHECK(contains(err.message, "all_reduce_max must not be NULL"));
  opts.all_reduce_max = fake_all_reduce;
  opts.all_reduce_user = &g_reduce_calls;
  opts.struct_size = 4;
  CHECK(ferry_sharded_save_begin(index, &opts, &save, &err) == FERRY_INVALID_ARGUMENT);
  CHECK(contains(err.message, "ferry_sharded_save_begin: options->struct_size is not set"));
  opts.struct_size = sizeof(opts);
  opts.rank = 1;
  CHECK(ferry_sharded_save_begin(index, &opts, &save, &err) == FERRY_INVALID_ARGUMENT);
  CHECK(contains(err.message, "c_api_save.ferry.index.json: bad SaveGroup (rank 1 of 1"));
  opts.rank = 0;
  ferry_writer_options_init(&wopts);
  wopts.durable = 0;
  wopts.encoding = 99;
  opts.writer = &wopts;
  CHECK(ferry_sharded_save_begin(index, &opts, &save, &err) == FERRY_INVALID_ARGUMENT);
  CHECK(contains(err.message, "unknown default encoding 99"));
  wopts.encoding = FERRY_ENCODING_ZSTD;
  opts.metadata_keys = keys;
  opts.metadata_values = NULL;
  opts.num_metadata = 1;
  CHECK(ferry_sharded_save_begin(index, &opts, &save, &err) == FERRY_INVALID_ARGUMENT);
  opts.metadata_values = values;

  CHECK_OK(ferry_sharded_save_begin(index, &opts, &save, &err));
  if (save == NULL) return;
  CHECK(g_reduce_calls == 2); /* the save id, then "every rank could start" */
  w = ferry_sharded_save_writer(save);
  CHECK(w != NULL);
  snprintf(first, sizeof(first), "%s", ferry_sharded_save_shard_path(save));
  CHECK(contains(first, "c_api_save-"));
  CHECK(contains(first, "-00001-of-00001.ferry"));
  CHECK_OK(ferry_writer_add_tensor(w, "v", FERRY_DTYPE_I64, NULL, 0, &v, 8, FERRY_ENCODING_DEFAULT,
                                   &err));
  CHECK_OK(ferry_writer_set_metadata(w, "step", "7", &err));
  /* The save commits its writer, not the caller. */
  CHECK(ferry_writer_commit(w, &err) == FERRY_INVALID_ARGUMENT);
  CHECK(contains(err.message, "belongs to a sharded save"));
  ferry_writer_free(w); /* a no-op: the save owns it */
  CHECK(ferry_sharded_save_shard_done(save) == 0);
  CHECK_OK(ferry_sharded_save_commit(save, &err));
  CHECK(ferry_sharded_save_shard_done(save) == 1);
  CHECK(ferry_sharded_save_commit(save, &err) == FERRY_INVALID_ARGUMENT);
  CHECK(contains(err.message, "save already committed"));
  ferry_sharded_save_free(save);
  CHECK(file_exists(first));
  CHECK_OK(ferry_sharded_open(index, NULL, &s, &err));
  if (s != NULL) {
    CHECK(ferry_sharded_find(s, "v", &where, &err) == FERRY_OK && where == 0);
    ferry_sharded_free(s);
  }

  /* Asynchronously, a second generation: the first one's shard goes after the commit. */
  save = NULL;
  CHECK_OK(ferry_sharded_save_begin(index, &opts, &save, &err));
  if (save == NULL) return;
  v = 12;
  CHECK_OK(ferry_writer_add_tensor(ferry_sharded_save_writer(save), "v", FERRY_DTYPE_I64, NULL, 0,
                                   &v, 8, FERRY_ENCODING_DEFAULT, &err));
  CHECK(ferry_sharded_save_finish(save, &err) == FERRY_INVALID_ARGUMENT);
  CHECK(contains(err.message, "Finish needs a CommitAsync first"));
  CHECK_OK(ferry_sharded_save_commit_async(save, &err));
  v = 0; /* snapshotted */
  CHECK_OK(ferry_sharded_save_finish(save, &err));
  CHECK(ferry_sharded_save_shard_done(save) == 1);
  ferry_sharded_save_free(save);
  CHECK(!file_exists(first));
  CHECK_OK(ferry_sharded_open(index, NULL, &s, &err));
  if (s != NULL) {
    CHECK_OK(ferry_sharded_shard(s, 0, &r, &err));
    if (r != NULL) {
      CHECK_OK(ferry_reader_read_into(r, "v", &back, 8, 0, &err));
      CHECK(back == 12);
      ferry_reader_free(r);
    }
    ferry_sharded_free(s);
  }

  /* A rank that gives up: the commit fails, its shard is gone, the index stays. */
  save = NULL;
  CHECK_OK(ferry_sharded_save_begin(index, &opts, &save, &err));
  if (save == NULL) return;
  snprintf(first, sizeof(first), "%s", ferry_sharded_save_shard_path(save));
  ferry_writer_abort(ferry_sharded_save_writer(save));
  CHECK(ferry_sharded_save_commit(save, &err) == FERRY_INVALID_ARGUMENT);
  CHECK(contains(err.message, "aborted"));
  ferry_sharded_save_free(save);
  CHECK(!file_exists(first));
  CHECK_OK(ferry_sharded_open(index, NULL, &s, &err));
  ferry_sharded_free(s);

  /* The collective failing fails the save, naming the callback. */
  save = NULL;
  g_reduce_rc = 3;
  CHECK(ferry_sharded_save_begin(index, &opts, &save, &err) == FERRY_INTERNAL);
  CHECK(contains(err.message, "the all_reduce_max callback failed (it returned 3)"));
  CHECK(save == NULL);

  /* NULL handles. */
  CHECK(ferry_sharded_save_writer(NULL) == NULL);
  CHECK(strcmp(ferry_sharded_save_shard_path(NULL), "") == 0);
  CHECK(ferry_sharded_save_shard_done(NULL) == 1);
  CHECK(ferry_sharded_save_commit(NULL, &err) == FERRY_INVALID_ARGUMENT);
  CHECK(contains(err.message, "ferry_sharded_save_commit: save must not be NULL"));
  CHECK(ferry_sharded_save_commit_async(NULL, &err) == FERRY_INVALID_ARGUMENT);
  CHECK(ferry_sharded_save_finish(NULL, &err) == FERRY_INVALID_ARGUMENT);
  CHECK(ferry_sharded_save_begin(NULL, &opts, &save, &err) == FERRY_INVALID_ARGUMENT);
  CHECK(ferry_sharded_save_begin(index, NULL, &save, &err) == FERRY_INVALID_ARGUMENT);
  ferry_sharded_save_free(NULL);
  ferry_sharded_save_options_init(NULL);
  CHECK(ferry_sharded_from_reader(NULL, &s, &err) == FERRY_INVALID_ARGUMENT);
  reset_group();

  remove(ferry_sharded_save_shard_path(NULL)); /* "" */
  {
    /* What the last good save left: its shard (found through the index) and the index. */
    ferry_sharded_t* last = NULL;
    if (ferry_sharded_open(index, NULL, &last, &err) == FERRY_OK) {
      ferry_reader_t* shard = NULL;
      if (ferry_sharded_shard(last, 0, &shard, &err) == FERRY_OK) {
        remove(ferry_reader_path(shard));
        ferry_reader_free(shard);
      }
      ferry_sharded_free(last);
    }
  }
  remove(index);
}

/* A distributed plan for two ranks, made one rank at a time: rank 0's check records its words,
 * rank 1 is checked against them. */
static void test_dist_plan(const char* ckpt) {
  ferry_error_t err = {0};
  ferry_reader_t* r = NULL;
  ferry_sharded_t* s = NULL;
  ferry_dist_plan_options_t opts;
  ferry_dist_plan_t* plan[2] = {NULL, NULL};
  ferry_dist_plan_view_t view;
  ferry_load_request_t req[2];
  const char* locals[1] = {"nope"};
  uint64_t covered[8];
  uint64_t hash0[2] = {0, 0};
  size_t i, k, total_reads = 0;
  int rank;

  CHECK_OK(ferry_reader_open(ckpt, NULL, &r, &err));
  if (r == NULL) return;
  CHECK_OK(ferry_sharded_from_reader(r, &s, &err));
  ferry_reader_free(r); /* the sharded handle keeps the file */
  if (s == NULL) return;
  CHECK(ferry_sharded_num_shards(s) == 1);

  reset_group();
  ferry_dist_plan_options_init(&opts);
  CHECK(opts.rounds == 4 && opts.check_plan == 1 && opts.own_min_bytes == FERRY_DIST_OWN_BUFFER);
  opts.nranks = 2;
  opts.rounds = 2;
  opts.own_min_bytes = 1024; /* bf16 (6000 bytes) alone, the small ones in the arena */
  CHECK(ferry_dist_plan_create(s, NULL, 0, &opts, &plan[0], &err) == FERRY_INVALID_ARGUMENT);
  CHECK(contains(err.message, "all_reduce_max (check_plan is set) must not be NULL"));
  opts.all_reduce_max = fake_all_reduce;
  opts.all_reduce_user = &g_reduce_calls;
  opts.rounds = 65;
  CHECK(ferry_dist_plan_create(s, NULL, 0, &opts, &plan[0], &err) == FERRY_INVALID_ARGUMENT);
  CHECK(contains(err.message, "1 <= rounds <= 64"));
  opts.rounds = 2;
  memset(covered, 0, sizeof(covered));
  for (rank = 0; rank < 2; ++rank) {
    opts.rank = rank;
    CHECK_OK(ferry_dist_plan_create(s, NULL, 0, &opts, &plan[rank], &err));
    if (plan[rank] == NULL) return;
    if (rank == 0) {
      CHECK(g_reduce_calls == 1);
      CHECK(g_given[0] == ~g_given[1]);
      hash0[0] = g_given[0];
      hash0[1] = g_given[1];
      g_others[0] = hash0[0];
      g_others[1] = hash0[1];
    } else {
      CHECK(g_given[0] == hash0[0] && g_given[1] == hash0[1]); /* the same plan */
    }
    view.struct_size = sizeof(view);
    CHECK_OK(ferry_dist_plan_view(plan[rank], &view, &err));
    CHECK(view.num_items == 5 && view.rounds == 2);
    for (i = 0; i < view.num_items; ++i) {
      const ferry_dist_item_t* it = &view.items[i];
      CHECK(it->shard == 0 && it->row_begin == 0 && it->row_end == -1);
      if (strcmp(it->name, "bf16") == 0) {
        CHECK(it->bytes == sizeof(g_bf16) && it->row_bytes == 2);
        CHECK(it->arena_offset == FERRY_DIST_OWN_BUFFER);
      } else if (strcmp(it->name, "matrix") == 0) {
        CHECK(it->bytes == sizeof(g_matrix) && it->row_bytes == 16);
        CHECK(it->arena_offset % 256 == 0 && it->arena_offset < view.arena_bytes);
      }
    }
    for (k = 0; k < view.num_reads; ++k) {
      const ferry_dist_read_t* rd = &view.reads[k];
      CHECK(rd->item < view.num_items && rd->round < 2);
      CHECK(rd->begin == covered[rd->item]); /* rank 0's pieces, then rank 1's, in order */
      covered[rd->item] += rd->bytes;
    }
    total_reads += view.num_reads;
    for (k = 0; k + 1 < view.num_broadcasts; ++k) {
      CHECK(view.broadcasts[k].round <= view.broadcasts[k + 1].round);
    }
  }
  CHECK(total_reads > 0);
  for (i = 0; i < view.num_items; ++i) CHECK(covered[i] == view.items[i].bytes);

  /* Conclusion: nobody failed; then another rank did; then this one. */
  memset(g_others, 0, sizeof(g_others));
  CHECK_OK(ferry_dist_plan_conclude(plan[1], 0, &err));
  g_others[0] = 1;
  CHECK(ferry_dist_plan_conclude(plan[1], 0, &err) == FERRY_INTERNAL);
  CHECK(contains(err.message, "c_api_test.ferry: rank 1: another rank failed"));
  CHECK(ferry_dist_plan_conclude(plan[1], 1, &err) == FERRY_INTERNAL);
  CHECK(contains(err.message, "rank 1: this rank failed"));
  ferry_dist_plan_free(plan[0]);
  ferry_dist_plan_free(plan[1]);

  /* A rank that asks for other tensors: both sides learn that the ranks disagree. */
  g_others[0] = hash0[0];
  g_others[1] = hash0[1];
  ferry_load_request_init(&req[0], "matrix");
  ferry_load_request_init(&req[1], "scalar");
  plan[0] = NULL;
  CHECK(ferry_dist_plan_create(s, req, 2, &opts, &plan[0], &err) == FERRY_INVALID_ARGUMENT);
  CHECK(contains(err.message, "rank 1: the ranks disagree on the replicated requests"));
  CHECK(plan[0] == NULL);
  /* A tensor that is not there fails this rank with NotFound, and tells the others. */
  ferry_load_request_init(&req[0], "nope");
  CHECK(ferry_dist_plan_create(s, req, 1, &opts, &plan[0], &err) == FERRY_NOT_FOUND);
  CHECK(contains(err.message, "'nope'"));
  CHECK(g_given[0] == UINT64_MAX && g_given[1] == UINT64_MAX);
  opts.local_names = locals;
  opts.num_local = 1;
  CHECK(ferry_dist_plan_create(s, NULL, 0, &opts, &plan[0], &err) == FERRY_NOT_FOUND);
  CHECK(contains(err.message, "'nope'"));
  opts.num_local = 0;
  /* Rows of one tensor, and a request with a destination (the plan places everything). */
  req[0].name = "matrix";
  req[0].row_begin = 2;
  req[0].row_end = 5;
  opts.check_plan = 0;
  opts.rank = 0;
  CHECK_OK(ferry_dist_plan_create(s, req, 1, &opts, &plan[0], &err));
  if (plan[0] != NULL) {
    view.struct_size = sizeof(view);
    CHECK_OK(ferry_dist_plan_view(plan[0], &view, &err));
    CHECK(view.num_items == 1 && view.items[0].bytes == 3 * 16);
    CHECK(view.items[0].row_begin == 2 && view.items[0].row_end == 5);
    memset(g_others, 0, sizeof(g_others));
    CHECK(ferry_dist_plan_conclude(plan[0], 0, &err) == FERRY_OK); /* it has a collective */
    ferry_dist_plan_free(plan[0]);
  }
  req[0].dst = &covered;
  CHECK(ferry_dist_plan_create(s, req, 1, &opts, &plan[0], &err) == FERRY_INVALID_ARGUMENT);
  CHECK(contains(err.message, "requests[0] needs a name and no dst"));
  view.struct_size = 0;
  CHECK(ferry_dist_plan_view(NULL, &view, &err) == FERRY_INVALID_ARGUMENT);
  CHECK(ferry_dist_plan_create(NULL, NULL, 0, &opts, &plan[0], &err) == FERRY_INVALID_ARGUMENT);
  CHECK(contains(err.message, "ferry_dist_plan_create: checkpoint must not be NULL"));
  CHECK(ferry_dist_plan_conclude(NULL, 0, &err) == FERRY_INVALID_ARGUMENT);
  ferry_dist_plan_free(NULL);
  ferry_dist_plan_options_init(NULL);
  ferry_sharded_free(s);
  reset_group();
}

/* Loads verify by default: a copy of the checkpoint with one byte of tensor "matrix"'s data
 * flipped fails a default load (and a packed one) with FERRY_DATA_LOSS naming the tensor and
 * the block; verify = 0 opts out. */
static void test_corrupt_load(const char* path) {
  char bad[600];
  ferry_reader_t* r = NULL;
  ferry_loader_t* l = NULL;
  ferry_loader_options_t lopts;
  ferry_tensor_info_t info;
  ferry_tensor_table_t table;
  ferry_error_t err;
  DLManagedTensorVersioned* all[5];
  FILE* in;
  FILE* out;
  char buf[4096];
  size_t n, i;
  void* packed = NULL;

  CHECK_OK(ferry_reader_open(path, NULL, &r, &err));
  if (r == NULL) return;
  info.struct_size = sizeof(info);
  CHECK_OK(ferry_reader_find_tensor(r, "matrix", &info, &err));
  ferry_reader_free(r);
  r = NULL;
  path_of(bad, sizeof(bad), "c_api_test_bad.ferry");
  in = fopen(path, "rb");
  out = fopen(bad, "wb");
  CHECK(in != NULL && out != NULL);
  if (in == NULL || out == NULL) {
    if (in) fclose(in);
    if (out) fclose(out);
    return;
  }
  while ((n = fread(buf, 1, sizeof(buf), in)) > 0) fwrite(buf, 1, n, out);
  fclose(in);
  fseek(out, (long)info.data_offset + 5, SEEK_SET);
  fputc(((const uint8_t*)g_matrix)[5] ^ 0x40, out);
  fclose(out);

  ferry_loader_options_init(&lopts);
  CHECK(lopts.verify == 1);
  CHECK_OK(ferry_reader_open(bad, NULL, &r, &err));
  CHECK_OK(ferry_loader_create(NULL, &l, &err));
  if (r != NULL && l != NULL) {
    memset(all, 0, sizeof(all));
    CHECK(ferry_loader_load_to_host(l, r, NULL, 0, all, &err) == FERRY_DATA_LOSS);
    CHECK(err.code == FERRY_DATA_LOSS);
    CHECK(contains(err.message, "tensor 'matrix': checksum mismatch in block 0"));
    for (i = 0; i < 5; ++i) CHECK(all[i] == NULL); /* nothing handed out */
    table.struct_size = sizeof(table);
    CHECK_OK(ferry_reader_tensor_table(r, &table, &err));
    packed = malloc(table.packed_bytes);
    CHECK(packed != NULL);
    if (packed != NULL) {
      CHECK(ferry_loader_load_to_host_packed(l, r, packed, table.packed_bytes, &err) ==
            FERRY_DATA_LOSS);
      CHECK(contains(err.message, "tensor 'matrix'"));
    }
    ferry_loader_free(l);
    l = NULL;
    lopts.verify = 0;
    CHECK_OK(ferry_loader_create(&lopts, &l, &err));
    if (l != NULL && packed != NULL) {
      CHECK_OK(ferry_loader_load_to_host_packed(l, r, packed, table.packed_bytes, &err));
    }
  }
  free(packed);
  ferry_loader_free(l);
  ferry_reader_free(r);
  remove(bad);
}

int main(int argc, char** argv) {
  char path[600];
  if (argc < 2) {
    fprintf(stderr, "usage: %s <scratch directory>\n", argv[0]);
    return 2;
  }
  snprintf(g_dir, sizeof(g_dir), "%s", argv[1]);
  path_of(path, sizeof(path), "c_api_test.ferry");
  make_fixtures();

  test_version_and_dtypes();
  test_null_handles();
  if (write_checkpoint(path) == FERRY_OK) {
    test_read(path);
    test_loader_host(path);
    test_corrupt_load(path);
    test_tensor_table(path);
    test_streaming_host(path);
    test_errors(path);
    test_convert(path);
    test_save_errors(path);
    test_view_file(path);
    test_sharded(path);
    test_dist_plan(path);
  }
  test_split_plan();
  remove(path);
  test_async_and_shards();
  test_sharded_save();

  printf("c_api_test: %d checks, %d failed\n", g_checks, g_failures);
  return g_failures == 0 ? 0 : 1;
}
