// Minimal NCCL access for tests through dlopen, with our own declarations, so that test
// programs build without nccl.h and run wherever some libnccl.so.2 exists (the CUDA toolkit's,
// a system package's, or the one in a Python environment's nvidia-nccl wheel). The library is
// loaded RTLD_GLOBAL, so the TensorFerry library finds this same NCCL for the communicators
// made here.
#ifndef FERRY_TESTS_NCCL_PROBE_HPP_
#define FERRY_TESTS_NCCL_PROBE_HPP_

#include <dlfcn.h>
#include <glob.h>

#include <cstddef>
#include <string>
#include <vector>

struct ncclComm;
struct CUstream_st;

namespace ferry::testing {

class NcclProbe {
 public:
  struct UniqueId {
    char internal[128];
  };
  static constexpr int kFloat32 = 7;
  static constexpr int kSum = 0;

  // `preferred`: a path to try first (empty: none).
  explicit NcclProbe(const std::string& preferred = "") {
    std::vector<std::string> candidates;
    if (!preferred.empty()) candidates.push_back(preferred);
    candidates.push_back("libnccl.so.2");
    candidates.push_back("/usr/local/cuda/lib64/libnccl.so.2");
    candidates.push_back("/usr/lib/x86_64-linux-gnu/libnccl.so.2");
    for (const char* pattern :
         {"/usr/local/lib/python3*/dist-packages/nvidia/nccl/lib/libnccl.so.2",
          "/usr/local/lib/python3*/site-packages/nvidia/nccl/lib/libnccl.so.2",
          "/usr/lib/python3*/dist-packages/nvidia/nccl/lib/libnccl.so.2",
          "/usr/lib/python3/dist-packages/nvidia/nccl/lib/libnccl.so.2",
          "/opt/conda/lib/python3*/site-packages/nvidia/nccl/lib/libnccl.so.2",
          "/opt/*/lib/python3*/site-packages/nvidia/nccl/lib/libnccl.so.2",
          "/root/.local/lib/python3*/site-packages/nvidia/nccl/lib/libnccl.so.2",
          "/root/*/lib/python3*/site-packages/nvidia/nccl/lib/libnccl.so.2"}) {
      glob_t g{};
      if (glob(pattern, 0, nullptr, &g) == 0) {
        for (size_t i = 0; i < g.gl_pathc; ++i) candidates.push_back(g.gl_pathv[i]);
      }
      globfree(&g);
    }
    for (const std::string& c : candidates) {
      lib_ = dlopen(c.c_str(), RTLD_NOW | RTLD_GLOBAL);
      if (lib_ != nullptr) {
        path_ = c;
        break;
      }
    }
    if (lib_ == nullptr) return;
    get_unique_id = reinterpret_cast<int (*)(UniqueId*)>(dlsym(lib_, "ncclGetUniqueId"));
    comm_init_rank =
        reinterpret_cast<int (*)(ncclComm**, int, UniqueId, int)>(dlsym(lib_, "ncclCommInitRank"));
    comm_destroy = reinterpret_cast<int (*)(ncclComm*)>(dlsym(lib_, "ncclCommDestroy"));
    all_reduce =
        reinterpret_cast<int (*)(const void*, void*, size_t, int, int, ncclComm*, CUstream_st*)>(
            dlsym(lib_, "ncclAllReduce"));
    error_string = reinterpret_cast<const char* (*)(int)>(dlsym(lib_, "ncclGetErrorString"));
    get_version = reinterpret_cast<int (*)(int*)>(dlsym(lib_, "ncclGetVersion"));
    ok_ = get_unique_id && comm_init_rank && comm_destroy && all_reduce && error_string &&
          get_version;
  }
  // Never dlclose: NCCL keeps threads.
  bool ok() const { return ok_; }
  const std::string& path() const { return path_; }
  int version() const {
    int v = 0;
    if (ok_) get_version(&v);
    return v;
  }

  int (*get_unique_id)(UniqueId*) = nullptr;
  int (*comm_init_rank)(ncclComm**, int, UniqueId, int) = nullptr;
  int (*comm_destroy)(ncclComm*) = nullptr;
  int (*all_reduce)(const void*, void*, size_t, int, int, ncclComm*, CUstream_st*) = nullptr;
  const char* (*error_string)(int) = nullptr;
  int (*get_version)(int*) = nullptr;

 private:
  void* lib_ = nullptr;
  bool ok_ = false;
  std::string path_;
};

}  // namespace ferry::testing

#endif  // FERRY_TESTS_NCCL_PROBE_HPP_
