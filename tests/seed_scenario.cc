// The original report, as a program: a process with device 0 current writes a checkpoint from
// device memory (weights plus FP8 scaling state); a second process whose current device is 1
// loads it. Every tensor must land on device 1, bit-exact, and NVML must show nothing of the
// loading process on any other GPU.
//
//   seed_scenario all DIR [MiB]       runs both processes (exit 77: fewer than two GPUs)
//   seed_scenario write PATH MiB      (device 0)
//   seed_scenario load PATH DEVICE    (current device DEVICE)
#include <cuda_runtime.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "ferry/loader.hpp"
#include "nvml_probe.hpp"
#include "test_util.hpp"

namespace {

using namespace ferry;

constexpr int kSkip = 77;

struct Spec {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
};

std::vector<Spec> Specs(int mib) {
  std::vector<Spec> s;
  int layers = std::max(1, mib / 16);
  for (int l = 0; l < layers; ++l) {
    std::string p = "layers." + std::to_string(l) + ".";
    s.push_back({p + "attn.qkv.weight", DType::kBF16, {3 * 1024, 1024}});
    s.push_back({p + "mlp.fc1.weight", DType::kF8_E4M3FN, {4096, 1024}});
    s.push_back({p + "mlp.fc1.weight_scale_inv", DType::kF32, {1}});
    s.push_back({p + "mlp.fc1.weight_amax", DType::kF32, {1}});
    s.push_back({p + "norm.weight", DType::kF32, {1024}});
  }
  s.push_back({"step", DType::kI64, {}});
  return s;
}

std::vector<uint8_t> Pattern(const Spec& spec) {
  uint64_t n = *StorageBytes(spec.dtype, *NumElements(spec.shape));
  std::vector<uint8_t> out(n);
  std::mt19937_64 rng(std::hash<std::string>{}(spec.name));
  for (auto& b : out) b = static_cast<uint8_t>(rng());
  return out;
}

#define CHECK_CUDA(call)                                                     \
  do {                                                                       \
    cudaError_t e = (call);                                                  \
    if (e != cudaSuccess) {                                                  \
      std::fprintf(stderr, "%s failed: %s\n", #call, cudaGetErrorString(e)); \
      return 1;                                                              \
    }                                                                        \
  } while (0)

int Write(const std::string& path, int mib) {
  CHECK_CUDA(cudaSetDevice(0));
  auto w = Writer::Create(path);
  if (!w.ok()) return std::fprintf(stderr, "%s\n", w.status().ToString().c_str()), 1;
  std::vector<void*> device_buffers;
  for (const Spec& spec : Specs(mib)) {
    std::vector<uint8_t> bytes = Pattern(spec);
    void* dev = nullptr;
    CHECK_CUDA(cudaMalloc(&dev, bytes.size() ? bytes.size() : 1));
    CHECK_CUDA(cudaMemcpy(dev, bytes.data(), bytes.size(), cudaMemcpyHostToDevice));
    device_buffers.push_back(dev);
    // The source is device memory: pulled through the writer block by block.
    FillFn fill = [dev](uint64_t off, void* dst, size_t n) {
      cudaError_t e = cudaMemcpy(dst, static_cast<uint8_t*>(dev) + off, n, cudaMemcpyDeviceToHost);
      return e == cudaSuccess ? Status::Ok()
                              : Status(StatusCode::kCudaError, cudaGetErrorString(e));
    };
    Status st = w->AddTensorFrom(spec.name, spec.dtype, spec.shape, fill, Encoding::kRaw);
    if (!st.ok()) return std::fprintf(stderr, "%s\n", st.ToString().c_str()), 1;
  }
  QuantizedTensor q;
  q.name = "layers.0.mlp.fc1.weight";
  q.quantized_dtype = DType::kF8_E4M3FN;
  q.logical_dtype = DType::kBF16;
  q.shape = {4096, 1024};
  q.rowwise = QuantizedComponent{"layers.0.mlp.fc1.weight", "layers.0.mlp.fc1.weight_scale_inv",
                                 ScaleLayout::kRowMajor, "layers.0.mlp.fc1.weight_amax"};
  Status st = w->AddQuantized(q);
  ScalingState s;
  s.module = "layers.0.mlp.fc1";
  DelayedScaling rec;
  rec.margin = 1;
  rec.amax_history_len = 4;
  s.recipe = rec;
  DirectionState fwd;
  fwd.slot_roles = {SlotRole::kInput, SlotRole::kWeight, SlotRole::kOutput};
  fwd.scale = {1.0f, 2.0f, 4.0f};
  fwd.history_len = 4;
  for (int i = 0; i < 12; ++i) fwd.amax_history.push_back(0.5f * i);
  s.states.push_back(fwd);
  if (st.ok()) st = w->AddScalingState(s);
  if (st.ok()) st = w->SetMetadata("saved_on", "cuda device 0 (recorded only as text)");
  if (st.ok()) st = w->Commit();
  for (void* p : device_buffers) cudaFree(p);
  if (!st.ok()) return std::fprintf(stderr, "%s\n", st.ToString().c_str()), 1;
  std::printf("writer pid %d: wrote %s from device 0\n", getpid(), path.c_str());
  return 0;
}

int Load(const std::string& path, int device) {
  testing::NvmlProbe nvml;
  CHECK_CUDA(cudaSetDevice(device));
  auto reader = Reader::Open(path);
  if (!reader.ok()) return std::fprintf(stderr, "%s\n", reader.status().ToString().c_str()), 1;
  auto loader = Loader::Create();
  if (!loader.ok()) return std::fprintf(stderr, "%s\n", loader.status().ToString().c_str()), 1;
  auto t0 = std::chrono::steady_clock::now();
  auto out = (*loader)->Load(**reader, {});
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!out.ok()) return std::fprintf(stderr, "%s\n", out.status().ToString().c_str()), 1;
  int failures = 0;
  uint64_t bytes = 0;
  for (const LoadedTensor& t : *out) {
    cudaPointerAttributes attr{};
    int where = -1;
    if (t.nbytes > 0 && cudaPointerGetAttributes(&attr, t.data) == cudaSuccess) {
      where = attr.device;
    }
    std::vector<uint8_t> host(t.nbytes);
    CHECK_CUDA(cudaMemcpy(host.data(), t.data, t.nbytes, cudaMemcpyDeviceToHost));
    Spec spec{t.info.name, t.info.dtype, t.info.shape};
    bool exact = host == Pattern(spec);
    if (!exact || (t.nbytes > 0 && where != device)) {
      std::printf("FAIL %s: on device %d, bit-exact %d\n", t.info.name.c_str(), where, exact);
      ++failures;
    }
    bytes += t.nbytes;
  }
  auto states = (*reader)->scaling_states();
  bool state_ok = states.size() == 1 && states[0].states.size() == 1 &&
                  states[0].states[0].amax_history.size() == 12 &&
                  std::get<DelayedScaling>(states[0].recipe).margin == 1;
  if (!state_ok) {
    std::printf("FAIL: FP8 scaling state did not round-trip\n");
    ++failures;
  }
  int cur = -1;
  cudaGetDevice(&cur);
  std::printf(
      "loader pid %d: %zu tensors, %.1f MiB in %.3f s onto device %d (current device "
      "after load: %d)\n",
      getpid(), out->size(), bytes / 1048576.0, secs, device, cur);
  if (cur != device) ++failures;
  if (!nvml.ok()) {
    std::printf("FAIL: NVML unavailable\n");
    return 1;
  }
  char bus[32] = {};
  CHECK_CUDA(cudaDeviceGetPCIBusId(bus, sizeof(bus), device));
  int own = nvml.IndexOfBusId(bus);
  unsigned pid = static_cast<unsigned>(getpid());
  for (unsigned g = 0; g < nvml.DeviceCount(); ++g) {
    bool present = false;
    unsigned long long used = 0;
    for (const auto& p : nvml.Processes(g)) {
      if (p.pid == pid) {
        present = true;
        used = p.used_bytes;
      }
    }
    std::printf("  NVML GPU %u%s: loader process %s (%.1f MiB)\n", g,
                static_cast<int>(g) == own ? " (target)" : "", present ? "PRESENT" : "absent",
                used / 1048576.0);
    if (present != (static_cast<int>(g) == own)) ++failures;
  }
  std::printf(failures ? "SEED SCENARIO FAIL (%d problems)\n" : "SEED SCENARIO PASS\n", failures);
  return failures ? 1 : 0;
}

int RunChild(const std::vector<std::string>& args) {
  pid_t pid = testing::SpawnSelf(args);
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s all DIR [MiB] | write PATH MiB | load PATH DEVICE\n", argv[0]);
    return 2;
  }
  std::string mode = argv[1];
  if (mode == "write") return Write(argv[2], argc > 3 ? std::atoi(argv[3]) : 64);
  if (mode == "load") return Load(argv[2], argc > 3 ? std::atoi(argv[3]) : 1);
  if (mode != "all") return 2;
  // Counting devices creates no context.
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count < 2) {
    std::printf("seed scenario needs two GPUs (found %d); skipped\n", count);
    return kSkip;
  }
  std::string path = std::string(argv[2]) + "/seed.ferry";
  std::string mib = argc > 3 ? argv[3] : "64";
  if (int rc = RunChild({argv[0], "write", path, mib}); rc != 0) return rc;
  int rc = RunChild({argv[0], "load", path, "1"});
  std::remove(path.c_str());
  return rc;
}
