// Saves from the GPU, checked on real devices (exit 77: not enough GPUs or no NCCL):
//
//   save_check nvml DIR       a fresh process with device 1 current saves from device 1 (sync
//                             raw, async shuffle+zstd through a pinned pool); every tensor must
//                             round-trip bit-exact and NVML must show the process on GPU 1 only
//   save_check sharded DIR    two processes, one GPU each, save one sharded checkpoint over an
//                             NCCL communicator (ShardedSave over NcclSaveGroup) from device
//                             memory, twice (Commit, then CommitAsync + Finish), and load it back
//                             with DistributedLoader on both ranks, bit-exact
#include <cuda_runtime.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "ferry/distributed.hpp"
#include "ferry/ferry.hpp"
#include "ferry/sharded.hpp"
#include "nccl_probe.hpp"
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

std::vector<Spec> Specs(const std::string& prefix) {
  return {
      {prefix + "embed", DType::kBF16, {4096, 1024}},
      {prefix + "fc1", DType::kF8_E4M3FN, {3000, 1027}},
      {prefix + "norm", DType::kF32, {1024}},
      {prefix + "scale", DType::kF32, {1}},
      {prefix + "empty", DType::kBF16, {0}},
      {prefix + "step", DType::kI64, {}},
  };
}

std::vector<uint8_t> Pattern(const Spec& s, uint64_t generation) {
  uint64_t n = *StorageBytes(s.dtype, *NumElements(s.shape));
  auto bytes = testing::RandomBytes(n, std::hash<std::string>{}(s.name) ^ generation);
  for (size_t i = 1; i < bytes.size(); i += 2) bytes[i] &= 0x3f;  // compressible, like weights
  return bytes;
}

#define CHECK(cond, ...)                 \
  do {                                   \
    if (!(cond)) {                       \
      std::printf("FAIL: " __VA_ARGS__); \
      std::printf("\n");                 \
      std::fflush(stdout);               \
      return 1;                          \
    }                                    \
  } while (0)

struct DeviceTensors {
  std::vector<Spec> specs;
  std::vector<void*> ptrs;
  ~DeviceTensors() {
    for (void* p : ptrs) cudaFree(p);
  }
  bool Upload(uint64_t generation) {
    for (size_t k = 0; k < specs.size(); ++k) {
      auto bytes = Pattern(specs[k], generation);
      if (ptrs.size() <= k) {
        void* p = nullptr;
        if (cudaMalloc(&p, std::max<size_t>(bytes.size(), 1)) != cudaSuccess) return false;
        ptrs.push_back(p);
      }
      if (cudaMemcpy(ptrs[k], bytes.data(), bytes.size(), cudaMemcpyHostToDevice) != cudaSuccess) {
        return false;
      }
    }
    return true;
  }
  Status AddAll(Writer& w, cudaStream_t stream, Encoding enc) {
    for (size_t k = 0; k < specs.size(); ++k) {
      uint64_t n = *StorageBytes(specs[k].dtype, *NumElements(specs[k].shape));
      Status st = w.AddDeviceTensor(specs[k].name, specs[k].dtype, specs[k].shape, ptrs[k], n,
                                    reinterpret_cast<Stream>(stream), enc);
      if (!st.ok()) return st;
    }
    return Status::Ok();
  }
};

// Every tensor of `specs` in `path` equals Pattern(generation); returns the number that differ.
int CompareFile(const std::string& path, const std::vector<Spec>& specs, uint64_t generation) {
  auto r = Reader::Open(path, {true});
  if (!r.ok()) {
    std::printf("FAIL: %s\n", r.status().ToString().c_str());
    return 1;
  }
  int bad = 0;
  for (const Spec& s : specs) {
    auto want = Pattern(s, generation);
    std::vector<uint8_t> got(want.size());
    Status st = (*r)->ReadInto(s.name, got.data(), got.size(), {true});
    if (!st.ok() || got != want) {
      std::printf("FAIL: %s: %s differs (%s)\n", path.c_str(), s.name.c_str(),
                  st.ToString().c_str());
      ++bad;
    }
  }
  return bad;
}

int NvmlChild(const std::string& dir, int device) {
  testing::NvmlProbe nvml;
  CHECK(nvml.ok(), "NVML unavailable");
  CHECK(cudaSetDevice(device) == cudaSuccess, "cudaSetDevice(%d)", device);
  DeviceTensors t;
  t.specs = Specs("layer.");
  CHECK(t.Upload(1), "upload");
  cudaStream_t stream;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) == cudaSuccess, "stream");
  int failures = 0;
  const std::string path = dir + "/nvml.ferry";
  {
    auto w = Writer::Create(path);
    CHECK(w.ok(), "%s", w.status().ToString().c_str());
    Status st = t.AddAll(*w, stream, Encoding::kRaw);
    if (st.ok()) st = w->Commit();
    CHECK(st.ok(), "sync save: %s", st.ToString().c_str());
    failures += CompareFile(path, t.specs, 1);
  }
  {
    auto pool = StagingPool::Create(64 << 20, true);
    CHECK(pool.ok(), "%s", pool.status().ToString().c_str());
    WriterOptions o;
    o.staging = *pool;
    auto w = Writer::Create(path, o);
    CHECK(w.ok(), "%s", w.status().ToString().c_str());
    Status st = t.AddAll(*w, stream, Encoding::kShuffleZstd);
    CHECK(st.ok(), "async save: %s", st.ToString().c_str());
    auto h = w->CommitAsync();
    CHECK(h.ok(), "async save: %s", h.status().ToString().c_str());
    CHECK(t.Upload(2), "overwrite");  // the snapshot is taken: the file keeps generation 1
    st = h->Wait();
    CHECK(st.ok(), "async save: %s", st.ToString().c_str());
    failures += CompareFile(path, t.specs, 1);
  }
  int cur = -1;
  cudaGetDevice(&cur);
  if (cur != device) {
    std::printf("FAIL: current device changed to %d\n", cur);
    ++failures;
  }
  char bus[32] = {};
  CHECK(cudaDeviceGetPCIBusId(bus, sizeof(bus), device) == cudaSuccess, "bus id");
  int own = nvml.IndexOfBusId(bus);
  unsigned pid = static_cast<unsigned>(getpid());
  for (unsigned g = 0; g < nvml.DeviceCount(); ++g) {
    bool present = nvml.HasProcess(g, pid);
    std::printf("  NVML GPU %u%s: saving process %s\n", g,
                static_cast<int>(g) == own ? " (current device)" : "",
                present ? "PRESENT" : "absent");
    if (present != (static_cast<int>(g) == own)) ++failures;
  }
  cudaStreamDestroy(stream);
  std::printf(failures ? "SAVE NVML CHECK FAIL (%d problems)\n" : "SAVE NVML CHECK PASS\n",
              failures);
  return failures ? 1 : 0;
}

int RankChild(const std::string& dir, int rank, int nranks, const std::string& id_file) {
  testing::NcclProbe nccl;
  CHECK(nccl.ok(), "no NCCL");
  CHECK(cudaSetDevice(rank) == cudaSuccess, "cudaSetDevice");
  testing::NcclProbe::UniqueId id{};
  if (rank == 0) {
    CHECK(nccl.get_unique_id(&id) == 0, "ncclGetUniqueId");
    std::string tmp = id_file + ".tmp";
    FILE* f = std::fopen(tmp.c_str(), "wb");
    CHECK(f && std::fwrite(&id, sizeof(id), 1, f) == 1, "writing the NCCL id");
    std::fclose(f);
    std::rename(tmp.c_str(), id_file.c_str());
  } else {
    for (int i = 0; i < 3000 && !std::filesystem::exists(id_file); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    FILE* f = std::fopen(id_file.c_str(), "rb");
    CHECK(f && std::fread(&id, sizeof(id), 1, f) == 1, "reading the NCCL id");
    std::fclose(f);
  }
  ncclComm* comm = nullptr;
  int rc = nccl.comm_init_rank(&comm, nranks, id, rank);
  CHECK(rc == 0, "ncclCommInitRank: %s", nccl.error_string(rc));
  auto group = NcclSaveGroup(comm);
  CHECK(group.ok(), "%s", group.status().ToString().c_str());
  CHECK(group->rank == rank && group->nranks == nranks, "group rank");
  DeviceTensors t;
  t.specs = Specs("rank" + std::to_string(rank) + ".");
  cudaStream_t stream;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) == cudaSuccess, "stream");
  const std::string index = dir + "/model.ferry.index.json";
  auto pool = StagingPool::Create(64 << 20, true);
  CHECK(pool.ok(), "%s", pool.status().ToString().c_str());
  int failures = 0;
  for (uint64_t generation : {1, 2}) {
    CHECK(t.Upload(generation), "upload");
    ShardedSaveOptions o;
    o.metadata = {{"generation", std::to_string(generation)}};
    if (generation == 2) o.writer.staging = *pool;
    o.writer.encoding = generation == 2 ? Encoding::kShuffleZstd : Encoding::kRaw;
    auto save = ShardedSave::Begin(index, *group, o);
    CHECK(save.ok(), "%s", save.status().ToString().c_str());
    Status st = t.AddAll((*save)->writer(), stream, o.writer.encoding);
    CHECK(st.ok(), "%s", st.ToString().c_str());
    if (generation == 2) {
      st = (*save)->CommitAsync();
      CHECK(st.ok(), "%s", st.ToString().c_str());
      CHECK(t.Upload(3), "overwrite after the snapshot");
      st = (*save)->Finish();
    } else {
      st = (*save)->Commit();
    }
    CHECK(st.ok(), "generation %d: %s", static_cast<int>(generation), st.ToString().c_str());
    auto ck = ShardedCheckpoint::Open(index, {true});
    CHECK(ck.ok(), "%s", ck.status().ToString().c_str());
    CHECK((*ck)->num_shards() == static_cast<size_t>(nranks), "shards");
    auto loader = DistributedLoader::Create(comm);
    CHECK(loader.ok(), "%s", loader.status().ToString().c_str());
    auto out = (*loader)->Load(**ck, {}, reinterpret_cast<Stream>(stream));
    CHECK(out.ok(), "%s", out.status().ToString().c_str());
    size_t seen = 0;
    for (const LoadedTensor& lt : *out) {
      for (int r = 0; r < nranks; ++r) {
        for (const Spec& s : Specs("rank" + std::to_string(r) + ".")) {
          if (s.name != lt.info.name) continue;
          ++seen;
          std::vector<uint8_t> got(lt.nbytes);
          if (lt.nbytes) cudaMemcpy(got.data(), lt.data, lt.nbytes, cudaMemcpyDeviceToHost);
          if (got != Pattern(s, generation)) {
            std::printf("FAIL: rank %d generation %d: %s differs\n", rank,
                        static_cast<int>(generation), s.name.c_str());
            ++failures;
          }
        }
      }
    }
    if (seen != Specs("").size() * nranks) {
      std::printf("FAIL: rank %d loaded %zu of %zu tensors\n", rank, seen,
                  Specs("").size() * nranks);
      ++failures;
    }
    // Only this generation's files remain.
    size_t files = 0;
    for (const auto& e : std::filesystem::directory_iterator(dir)) {
      files += e.path().extension() == ".ferry";
    }
    if (files != static_cast<size_t>(nranks) && rank == 0) {
      std::printf("FAIL: %zu shard files after generation %d\n", files,
                  static_cast<int>(generation));
      ++failures;
    }
    std::printf("rank %d: generation %d saved (%s) and loaded back on both ranks\n", rank,
                static_cast<int>(generation), generation == 2 ? "async" : "sync");
    std::fflush(stdout);
    uint64_t sync = 0;
    CHECK(group->all_reduce_max(&sync, 1).ok(), "barrier");
  }
  cudaStreamDestroy(stream);
  nccl.comm_destroy(comm);
  std::printf(failures ? "rank %d: SHARDED SAVE FAIL\n" : "rank %d: SHARDED SAVE PASS\n", rank);
  return failures ? 1 : 0;
}

int Wait(const std::vector<pid_t>& pids, int deadline_s) {
  int result = 0;
  auto kill_at = std::chrono::steady_clock::now() + std::chrono::seconds(deadline_s);
  std::vector<pid_t> left = pids;
  while (!left.empty()) {
    int status = 0;
    pid_t done = waitpid(-1, &status, WNOHANG);
    if (done > 0) {
      left.erase(std::remove(left.begin(), left.end(), done), left.end());
      int rc = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      if (rc != 0 && result == 0) result = rc;
      if (rc != 0)
        kill_at = std::min(kill_at, std::chrono::steady_clock::now() + std::chrono::seconds(10));
      continue;
    }
    if (std::chrono::steady_clock::now() > kill_at) {
      for (pid_t p : left) kill(p, SIGKILL);
      if (result == 0) result = 1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return result;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s nvml DIR | sharded DIR\n", argv[0]);
    return 2;
  }
  const std::string mode = argv[1], dir = argv[2];
  if (mode == "nvml-child") return NvmlChild(dir, std::atoi(argv[3]));
  if (mode == "rank") return RankChild(dir, std::atoi(argv[3]), std::atoi(argv[4]), argv[5]);
  // Counting devices creates no context; children are fresh processes.
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count < 2) {
    std::printf("%s needs two GPUs (found %d); skipped\n", mode.c_str(), count);
    return kSkip;
  }
  std::filesystem::create_directories(dir);
  if (mode == "nvml") {
    return Wait({testing::SpawnSelf({argv[0], "nvml-child", dir, "1"})}, 120);
  }
  if (mode == "sharded") {
    if (!testing::NcclProbe().ok()) {
      std::printf("no NCCL library found; skipped\n");
      return kSkip;
    }
    setenv("NCCL_NVLS_ENABLE", "0", 1);
    const std::string sdir = dir + "/sharded";
    std::filesystem::remove_all(sdir);
    std::filesystem::create_directories(sdir);
    const std::string id_file = dir + "/nccl.id";
    std::filesystem::remove(id_file);
    std::vector<pid_t> pids;
    for (int r = 0; r < 2; ++r) {
      pids.push_back(testing::SpawnSelf({argv[0], "rank", sdir, std::to_string(r), "2", id_file}));
    }
    int rc = Wait(pids, 180);
    std::filesystem::remove(id_file);
    return rc;
  }
  return 2;
}
