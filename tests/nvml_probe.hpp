// Minimal NVML access through dlopen, with our own declarations (the toolkit here ships no
// nvml.h). Used to prove which GPUs a process touched.
#ifndef FERRY_TESTS_NVML_PROBE_HPP_
#define FERRY_TESTS_NVML_PROBE_HPP_

#include <dlfcn.h>

#include <string>
#include <vector>

namespace ferry::testing {

class NvmlProbe {
 public:
  struct Proc {
    unsigned pid;
    unsigned long long used_bytes;
  };

  NvmlProbe() {
    lib_ = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib_ == nullptr) return;
    init_ = reinterpret_cast<int (*)()>(dlsym(lib_, "nvmlInit_v2"));
    shutdown_ = reinterpret_cast<int (*)()>(dlsym(lib_, "nvmlShutdown"));
    count_ = reinterpret_cast<int (*)(unsigned*)>(dlsym(lib_, "nvmlDeviceGetCount_v2"));
    handle_ =
        reinterpret_cast<int (*)(unsigned, void**)>(dlsym(lib_, "nvmlDeviceGetHandleByIndex_v2"));
    procs_ = reinterpret_cast<int (*)(void*, unsigned*, RawProc*)>(
        dlsym(lib_, "nvmlDeviceGetComputeRunningProcesses_v3"));
    by_bus_ = reinterpret_cast<int (*)(const char*, void**)>(
        dlsym(lib_, "nvmlDeviceGetHandleByPciBusId_v2"));
    index_ = reinterpret_cast<int (*)(void*, unsigned*)>(dlsym(lib_, "nvmlDeviceGetIndex"));
    ok_ = by_bus_ && index_ && init_ && shutdown_ && count_ && handle_ && procs_ && init_() == 0;
  }
  ~NvmlProbe() {
    if (ok_) shutdown_();
    if (lib_) dlclose(lib_);
  }
  bool ok() const { return ok_; }

  unsigned DeviceCount() const {
    unsigned n = 0;
    return ok_ && count_(&n) == 0 ? n : 0;
  }

  // Compute processes holding a context on NVML device `index`.
  std::vector<Proc> Processes(unsigned index) const {
    std::vector<Proc> out;
    void* dev = nullptr;
    if (!ok_ || handle_(index, &dev) != 0) return out;
    std::vector<RawProc> raw(256);
    unsigned n = static_cast<unsigned>(raw.size());
    if (procs_(dev, &n, raw.data()) != 0) return out;
    for (unsigned i = 0; i < n; ++i) out.push_back(Proc{raw[i].pid, raw[i].used});
    return out;
  }

  // NVML index of the GPU with this PCI bus id ("0000:19:00.0"), or -1. CUDA and NVML may
  // number GPUs differently; the bus id is the same in both.
  int IndexOfBusId(const std::string& bus_id) const {
    void* dev = nullptr;
    unsigned index = 0;
    if (!ok_ || by_bus_(bus_id.c_str(), &dev) != 0 || index_(dev, &index) != 0) return -1;
    return static_cast<int>(index);
  }

  bool HasProcess(unsigned index, unsigned pid) const {
    for (const Proc& p : Processes(index)) {
      if (p.pid == pid) return true;
    }
    return false;
  }

 private:
  // nvmlProcessInfo_t (v2/v3 layout).
  struct RawProc {
    unsigned pid;
    unsigned long long used;
    unsigned gpu_instance;
    unsigned compute_instance;
  };
  void* lib_ = nullptr;
  bool ok_ = false;
  int (*init_)() = nullptr;
  int (*shutdown_)() = nullptr;
  int (*count_)(unsigned*) = nullptr;
  int (*handle_)(unsigned, void**) = nullptr;
  int (*procs_)(void*, unsigned*, RawProc*) = nullptr;
  int (*by_bus_)(const char*, void**) = nullptr;
  int (*index_)(void*, unsigned*) = nullptr;
};

}  // namespace ferry::testing

#endif  // FERRY_TESTS_NVML_PROBE_HPP_
