/* ferry_load: loads every tensor of a TensorFerry checkpoint through the C API, for the
 * comparison harness (run_compare.py builds and drives it; see README.md).
 *
 *   ferry_load FILE DEVICE [SAMPLES]
 *
 * DEVICE: a CUDA ordinal, made current before the load through the driver API (the loader
 * targets the current device), or -1 for a host load. SAMPLES: a file of tensor names, one a
 * line, whose loaded bytes are checksummed (the position-weighted sum of ckpt.wsum) so the
 * harness can check them against the source.
 *
 * Protocol on stdin/stdout, so the harness can sample memory around the timed part and ask
 * NVML about this process while its tensors are still alive:
 *   "@@READY"            setup done (context created on DEVICE); waits for a line
 *   "@@RESULT {json}"    the timed load: open, load every tensor, wait for the stream
 *   "@@HOLD"             tensors still allocated; waits for a line, then frees and exits
 */
#define _POSIX_C_SOURCE 200809L
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ferry/ferry.h"

typedef int CUresult;
typedef int CUdevice;
typedef void* CUcontext;
typedef unsigned long long CUdeviceptr;

static struct {
  CUresult (*init)(unsigned);
  CUresult (*device_get)(CUdevice*, int);
  CUresult (*primary_retain)(CUcontext*, CUdevice);
  CUresult (*ctx_set_current)(CUcontext);
  CUresult (*memcpy_dtoh)(void*, CUdeviceptr, size_t);
} cu;

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void json_string(const char* s) {
  putchar('"');
  for (; *s; ++s) {
    unsigned char c = (unsigned char)*s;
    if (c == '"' || c == '\\') {
      putchar('\\');
      putchar(c);
    } else if (c < 0x20) {
      printf("\\u%04x", c);
    } else {
      putchar(c);
    }
  }
  putchar('"');
}

static void fail(const char* what, const char* message) {
  printf("@@RESULT {\"error\": ");
  char buf[1400];
  snprintf(buf, sizeof buf, "%s: %s", what, message);
  json_string(buf);
  printf("}\n");
  fflush(stdout);
  exit(1);
}

static void wait_line(void) {
  char line[64];
  fflush(stdout);
  if (!fgets(line, sizeof line, stdin)) exit(0);
}

static int use_cuda(int device) {
  void* h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
  if (!h) h = dlopen("libcuda.so", RTLD_NOW | RTLD_GLOBAL);
  if (!h) fail("dlopen libcuda", dlerror());
#define SYM(field, name)                 \
  *(void**)(&cu.field) = dlsym(h, name); \
  if (!cu.field) fail("dlsym", name);
  SYM(init, "cuInit");
  SYM(device_get, "cuDeviceGet");
  SYM(primary_retain, "cuDevicePrimaryCtxRetain");
  SYM(ctx_set_current, "cuCtxSetCurrent");
  SYM(memcpy_dtoh, "cuMemcpyDtoH_v2");
#undef SYM
  CUdevice dev;
  CUcontext ctx;
  char msg[64];
  CUresult r = cu.init(0);
  if (r == 0) r = cu.device_get(&dev, device);
  if (r == 0) r = cu.primary_retain(&ctx, dev);
  if (r == 0) r = cu.ctx_set_current(ctx);
  if (r != 0) {
    snprintf(msg, sizeof msg, "CUresult %d for device %d", r, device);
    fail("cuda setup", msg);
  }
  return 1;
}

/* Same sum as ckpt.wsum: little-endian 64-bit words, zero-padded, weights 2i + 1. */
static unsigned long long wsum(const unsigned char* p, size_t n) {
  unsigned long long total = 0, i = 0;
  size_t full = n / 8;
  for (; i < full; ++i) {
    unsigned long long w;
    memcpy(&w, p + 8 * i, 8);
    total += w * (2 * i + 1);
  }
  if (n % 8) {
    unsigned long long w = 0;
    memcpy(&w, p + 8 * full, n % 8);
    total += w * (2 * i + 1);
  }
  return total;
}

int main(int argc, char** argv) {
  if (argc < 3) {
    fprintf(stderr, "usage: ferry_load FILE DEVICE [SAMPLES]\n");
    return 2;
  }
  const char* path = argv[1];
  int device = atoi(argv[2]);
  int host = device < 0;
  if (!host) use_cuda(device);

  char* samples[256];
  size_t num_samples = 0;
  if (argc > 3) {
    FILE* f = fopen(argv[3], "r");
    if (!f) fail("samples", argv[3]);
    char line[4096];
    while (num_samples < 256 && fgets(line, sizeof line, f)) {
      line[strcspn(line, "\r\n")] = 0;
      if (line[0]) samples[num_samples++] = strdup(line);
    }
    fclose(f);
  }

  ferry_loader_options_t options;
  ferry_loader_options_init(&options);
  printf("@@READY\n");
  wait_line();

  ferry_error_t error;
  double t0 = now();
  ferry_reader_t* reader = NULL;
  if (ferry_reader_open(path, NULL, &reader, &error) != FERRY_OK) fail("open", error.message);
  ferry_loader_t* loader = NULL;
  if (ferry_loader_create(&options, &loader, &error) != FERRY_OK) fail("loader", error.message);
  size_t n = ferry_reader_num_tensors(reader);
  DLManagedTensorVersioned** out = calloc(n ? n : 1, sizeof *out);
  int rc = host ? ferry_loader_load_to_host(loader, reader, NULL, 0, out, &error)
                : ferry_loader_load(loader, reader, NULL, 0, NULL, out, NULL, &error);
  if (rc != FERRY_OK) fail("load", error.message);
  double seconds = now() - t0;

  unsigned long long bytes = 0;
  printf(
      "@@RESULT {\"seconds\": %.9f, \"tensors\": %zu, \"device\": %d, "
      "\"staging_bytes\": %llu, \"threads\": %d, \"checksums\": {",
      seconds, n, device, (unsigned long long)options.staging_bytes, options.threads);
  int first = 1;
  int on_device = 1;
  for (size_t i = 0; i < n; ++i) {
    ferry_tensor_info_t info;
    info.struct_size = sizeof info;
    if (ferry_reader_tensor_info(reader, i, &info, &error) != FERRY_OK) fail("info", error.message);
    bytes += info.nbytes;
    const DLTensor* t = &out[i]->dl_tensor;
    if (!host && !(t->device.device_type == kDLCUDA && t->device.device_id == device))
      on_device = 0;
    for (size_t s = 0; s < num_samples; ++s) {
      if (strcmp(samples[s], info.name) != 0) continue;
      const unsigned char* data = (const unsigned char*)t->data + t->byte_offset;
      unsigned char* copy = NULL;
      if (!host && info.nbytes) {
        copy = malloc(info.nbytes);
        if (!copy) fail("checksum", "out of host memory");
        CUresult r = cu.memcpy_dtoh(copy, (CUdeviceptr)(size_t)data, info.nbytes);
        if (r != 0) fail("checksum", "cuMemcpyDtoH failed");
        data = copy;
      }
      printf("%s", first ? "" : ", ");
      first = 0;
      json_string(info.name);
      printf(": \"%llu\"", info.nbytes ? wsum(data, info.nbytes) : 0ULL);
      free(copy);
    }
  }
  printf("}, \"bytes\": %llu, \"on_device\": %s}\n", bytes, on_device ? "true" : "false");
  printf("@@HOLD\n");
  wait_line();
  for (size_t i = 0; i < n; ++i) ferry_dlpack_free(out[i]);
  free(out);
  ferry_loader_free(loader);
  ferry_reader_free(reader);
  return 0;
}
