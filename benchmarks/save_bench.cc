// Saves from the GPU beside the ceilings measured in the same run (plain main: runs where
// Google Benchmark is not installed). Prints one table:
//
//   ceilings: the disk's sequential write rate (buffered + fsync, O_DIRECT + fsync), the pinned
//   device-to-host copy rate, memcpy into /dev/shm (write(2) from one thread and pwrite from 8);
//   TensorFerry: a checkpoint of --gib GiB of weights-like bf16 on the current device, saved
//   raw and shuffle+zstd to --disk-dir (ext4) and --shm-dir (tmpfs), synchronously (time of
//   Commit, fsync included) and asynchronously (time until CommitAsync returns, and until the
//   save is durable), with a reused pinned staging pool as large as the checkpoint.
//
//   save_bench [--gib=8] [--disk-dir=/var/tmp] [--shm-dir=/dev/shm] [--tensors=64]
//              [--repeat=1] [--csv=FILE]
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "ferry/ferry.hpp"
#include "ferry/loader.hpp"

#ifdef FERRY_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace {

using namespace ferry;

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

struct Row {
  std::string what;
  double gbps = 0;      // bytes of the checkpoint (uncompressed) per second
  std::string ceiling;  // name of the ceiling row it compares with
  std::string note;
};
std::vector<Row> rows;

const Row* Find(const std::string& what) {
  for (const Row& r : rows) {
    if (r.what == what) return &r;
  }
  return nullptr;
}

void Add(const std::string& what, double bytes, double secs, const std::string& ceiling = "",
         const std::string& note = "") {
  rows.push_back(Row{what, bytes / secs / 1e9, ceiling, note});
  std::printf("  %-52s %8.2f GB/s  (%.3f s)%s%s\n", what.c_str(), bytes / secs / 1e9, secs,
              note.empty() ? "" : "  ", note.c_str());
  std::fflush(stdout);
}

// Weights-like bf16: N(0, 0.02) rounded to bf16, from a per-thread xorshift.
void FillWeights(uint16_t* p, size_t n, uint64_t seed) {
  unsigned hw = std::max(1u, std::min(16u, std::thread::hardware_concurrency()));
  std::vector<std::thread> threads;
  const size_t step = (n + hw - 1) / hw;
  for (unsigned t = 0; t < hw; ++t) {
    threads.emplace_back([=] {
      uint64_t s = seed * 0x9E3779B97F4A7C15ull + t + 1;
      auto next = [&] {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        return s;
      };
      const size_t end = std::min(n, (t + 1) * step);
      for (size_t i = t * step; i < end; ++i) {
        uint64_t r = next();
        // Sum of four uniforms: close enough to a normal for the exponent distribution.
        float u = static_cast<float>((r & 0xffff) + ((r >> 16) & 0xffff) + ((r >> 32) & 0xffff) +
                                     (r >> 48)) /
                      65536.0f -
                  2.0f;
        float v = u * 0.02f * 1.7320508f;
        uint32_t bits;
        std::memcpy(&bits, &v, 4);
        bits += 0x7fff + ((bits >> 16) & 1);  // round to nearest even
        p[i] = static_cast<uint16_t>(bits >> 16);
      }
    });
  }
  for (auto& t : threads) t.join();
}

// Sequential write of `bytes` from `src` (4 MiB writes), then fsync. O_DIRECT needs `src`
// aligned.
double DiskWrite(const std::string& path, const uint8_t* src, uint64_t bytes, bool direct) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | (direct ? O_DIRECT : 0), 0644);
  if (fd < 0) return -1;
  const uint64_t chunk = 4 << 20;
  double t0 = Now();
  for (uint64_t off = 0; off < bytes; off += chunk) {
    uint64_t n = std::min(chunk, bytes - off);
    if (::write(fd, src + off % (uint64_t{1} << 30), n) != static_cast<ssize_t>(n)) {
      ::close(fd);
      return -1;
    }
  }
  ::fsync(fd);
  double secs = Now() - t0;
  ::close(fd);
  ::unlink(path.c_str());
  return secs;
}

// pwrite of `bytes` in 4 MiB pieces from `threads` threads into a fresh file (no fsync).
double ParallelWrite(const std::string& path, const uint8_t* src, uint64_t bytes, int threads) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) return -1;
  const uint64_t chunk = 4 << 20;
  double t0 = Now();
  std::vector<std::thread> ts;
  for (int t = 0; t < threads; ++t) {
    ts.emplace_back([=] {
      for (uint64_t off = t * chunk; off < bytes; off += threads * chunk) {
        uint64_t n = std::min(chunk, bytes - off);
        if (::pwrite(fd, src + off % (uint64_t{1} << 30), n, off) != static_cast<ssize_t>(n)) {
          std::perror("pwrite");
        }
      }
    });
  }
  for (auto& t : ts) t.join();
  double secs = Now() - t0;
  ::close(fd);
  ::unlink(path.c_str());
  return secs;
}

}  // namespace

int main(int argc, char** argv) {
  double gib = 8;
  int ntensors = 64;
  int repeat = 1;
  std::string disk_dir = "/var/tmp", shm_dir = "/dev/shm", csv;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto val = [&](const char* k) { return a.substr(std::strlen(k)); };
    if (a.rfind("--gib=", 0) == 0)
      gib = std::stod(val("--gib="));
    else if (a.rfind("--disk-dir=", 0) == 0)
      disk_dir = val("--disk-dir=");
    else if (a.rfind("--shm-dir=", 0) == 0)
      shm_dir = val("--shm-dir=");
    else if (a.rfind("--tensors=", 0) == 0)
      ntensors = std::stoi(val("--tensors="));
    else if (a.rfind("--repeat=", 0) == 0)
      repeat = std::stoi(val("--repeat="));
    else if (a.rfind("--csv=", 0) == 0)
      csv = val("--csv=");
    else {
      std::fprintf(stderr, "unknown argument %s\n", a.c_str());
      return 2;
    }
  }
#ifndef FERRY_HAVE_CUDA
  std::printf("save_bench needs a CUDA build\n");
  return 77;
#else
  if (!CudaAvailable()) {
    std::printf("save_bench needs a GPU; skipped\n");
    return 77;
  }
  const uint64_t total =
      static_cast<uint64_t>(gib * (uint64_t{1} << 30)) / (2 * ntensors) * (2 * ntensors);
  const uint64_t per = total / ntensors;  // bytes per large tensor
  // Small tensors (norms, biases) as a model has them: 4 per large one, 8 KiB each.
  const int nsmall = 4 * ntensors;
  const uint64_t small = 8192;
  const uint64_t all = total + nsmall * small;
  int dev = 0;
  cudaGetDevice(&dev);
  std::printf("save_bench: %.2f GiB bf16 in %d tensors of %.1f MiB + %d of 8 KiB, device %d\n",
              all / 1073741824.0, ntensors, per / 1048576.0, nsmall, dev);

  // ---- data --------------------------------------------------------------------------------
  std::vector<uint16_t> host(all / 2);
  double t0 = Now();
  FillWeights(host.data(), host.size(), 1);
  std::printf("  generated in %.1f s\n", Now() - t0);
  uint8_t* d = nullptr;
  if (cudaMalloc(&d, all) != cudaSuccess) {
    std::printf("cudaMalloc of %llu bytes failed\n", static_cast<unsigned long long>(all));
    return 1;
  }
  cudaMemcpy(d, host.data(), all, cudaMemcpyHostToDevice);
  const uint8_t* src = reinterpret_cast<const uint8_t*>(host.data());
  struct T {
    std::string name;
    const uint8_t* ptr;
    uint64_t bytes;
  };
  std::vector<T> tensors;
  for (int i = 0; i < ntensors; ++i) {
    tensors.push_back(T{"layers." + std::to_string(i) + ".weight", d + i * per, per});
  }
  for (int i = 0; i < nsmall; ++i) {
    tensors.push_back(T{"layers." + std::to_string(i / 4) + ".norm" + std::to_string(i % 4),
                        d + total + i * small, small});
  }
  cudaStream_t stream;
  cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);

  // ---- ceilings ----------------------------------------------------------------------------
  std::printf("ceilings\n");
  void* aligned = nullptr;
  const uint64_t window = std::min<uint64_t>(all, uint64_t{1} << 30);
  if (posix_memalign(&aligned, 4096, window) != 0) return 1;
  std::memcpy(aligned, src, window);
  const auto* abuf = static_cast<const uint8_t*>(aligned);
  double s;
  if ((s = DiskWrite(disk_dir + "/save_bench.seq", abuf, all, false)) > 0) {
    Add("disk: sequential write, buffered + fsync", all, s);
  }
  if ((s = DiskWrite(disk_dir + "/save_bench.seq", abuf, all, true)) > 0) {
    Add("disk: sequential write, O_DIRECT + fsync", all, s);
  }
  {
    void* pinned = nullptr;
    const uint64_t ring = uint64_t{256} << 20;
    cudaHostAlloc(&pinned, ring, cudaHostAllocPortable);
    for (uint64_t chunk : {uint64_t{4} << 20, uint64_t{64} << 20}) {
      cudaStreamSynchronize(stream);
      t0 = Now();
      for (uint64_t off = 0; off < total; off += chunk) {
        cudaMemcpyAsync(static_cast<uint8_t*>(pinned) + off % ring, d + off, chunk,
                        cudaMemcpyDeviceToHost, stream);
      }
      cudaStreamSynchronize(stream);
      Add("pinned device-to-host copy, " + std::to_string(chunk >> 20) + " MiB chunks", total,
          Now() - t0);
    }
    cudaFreeHost(pinned);
  }
  if ((s = DiskWrite(shm_dir + "/save_bench.seq", abuf, all, false)) > 0) {
    Add("memcpy into /dev/shm: write(2), 1 thread", all, s);
  }
  if ((s = ParallelWrite(shm_dir + "/save_bench.seq", abuf, all, 8)) > 0) {
    Add("memcpy into /dev/shm: pwrite, 8 threads", all, s);
  }

  // The ceilings the saves are held to: the faster way of each.
  auto best = [](const std::string& name, const char* a, const char* b) {
    const Row* x = Find(a);
    const Row* y = Find(b);
    if (x == nullptr && y == nullptr) return;
    double g = std::max(x ? x->gbps : 0.0, y ? y->gbps : 0.0);
    rows.push_back(Row{name, g, "", "best of the two above"});
  };
  best("disk: sequential write rate", "disk: sequential write, buffered + fsync",
       "disk: sequential write, O_DIRECT + fsync");
  best("memcpy into /dev/shm", "memcpy into /dev/shm: write(2), 1 thread",
       "memcpy into /dev/shm: pwrite, 8 threads");

  // ---- TensorFerry ---------------------------------------------------------------------------
  std::printf("TensorFerry save from the GPU (device bytes / s)\n");
  t0 = Now();
  auto pool = StagingPool::Create(all + (uint64_t{64} << 20), true);
  if (!pool.ok()) {
    std::printf("staging pool: %s\n", pool.status().ToString().c_str());
    return 1;
  }
  std::printf("  pinned staging pool of %.2f GiB: %.2f s (once, reused by every async save)\n",
              (*pool)->bytes() / 1073741824.0, Now() - t0);
  struct Target {
    std::string label, dir, ceiling;
  };
  for (const Target& target : {Target{"ext4", disk_dir, "disk: sequential write rate"},
                               Target{"/dev/shm", shm_dir, "memcpy into /dev/shm"}}) {
    for (Encoding enc : {Encoding::kRaw, Encoding::kShuffleZstd}) {
      for (bool async : {false, true}) {
        for (int rep = 0; rep < repeat; ++rep) {
          const std::string path = target.dir + "/save_bench.ferry";
          WriterOptions o;
          o.encoding = enc;
          if (async) o.staging = *pool;
          cudaStreamSynchronize(stream);
          double start = Now();
          auto w = Writer::Create(path, o);
          Status st = w.status();
          for (size_t i = 0; st.ok() && i < tensors.size(); ++i) {
            st = w->AddDeviceTensor(tensors[i].name, DType::kBF16,
                                    {static_cast<int64_t>(tensors[i].bytes / 2)}, tensors[i].ptr,
                                    tensors[i].bytes, reinterpret_cast<Stream>(stream));
          }
          double returned = 0;
          if (st.ok() && async) {
            auto h = w->CommitAsync();
            returned = Now() - start;
            st = h.ok() ? h->Wait() : h.status();
          } else if (st.ok()) {
            st = w->Commit();
          }
          double secs = Now() - start;
          if (!st.ok()) {
            std::printf("  FAILED: %s\n", st.ToString().c_str());
            continue;
          }
          double ratio = 0;
          if (auto r = Reader::Open(path); r.ok()) ratio = double(all) / (*r)->file_size();
          char note[96];
          std::snprintf(note, sizeof(note), "ratio %.2f", ratio);
          std::string base = std::string("TF GPU->") + target.label + " " +
                             (enc == Encoding::kRaw ? "raw" : "shuffle+zstd");
          if (async) {
            Add(base + " async: call returns (snapshot)", all, returned,
                "pinned device-to-host copy, 4 MiB chunks", note);
            Add(base + " async: durable", all, secs, target.ceiling, note);
          } else {
            Add(base + " sync (durable)", all, secs, target.ceiling, note);
          }
          ::unlink(path.c_str());
        }
      }
    }
  }

  // ---- table ---------------------------------------------------------------------------------
  std::printf("\n%-58s %9s %9s  %s\n", "path", "GB/s", "ceiling", "of ceiling");
  FILE* out = csv.empty() ? nullptr : std::fopen(csv.c_str(), "w");
  if (out) std::fprintf(out, "path,gbps,ceiling_gbps,fraction,note\n");
  for (const Row& r : rows) {
    const Row* c = r.ceiling.empty() ? nullptr : Find(r.ceiling);
    if (c) {
      std::printf("%-58s %9.2f %9.2f  %.2fx %s\n", r.what.c_str(), r.gbps, c->gbps,
                  r.gbps / c->gbps, r.note.c_str());
    } else {
      std::printf("%-58s %9.2f %9s  %s\n", r.what.c_str(), r.gbps, "-", r.note.c_str());
    }
    if (out) {
      std::fprintf(out, "\"%s\",%.3f,%.3f,%.3f,\"%s\"\n", r.what.c_str(), r.gbps, c ? c->gbps : 0.0,
                   c ? r.gbps / c->gbps : 0.0, r.note.c_str());
    }
  }
  if (out) std::fclose(out);
  std::free(aligned);
  cudaFree(d);
  cudaStreamDestroy(stream);
  return 0;
#endif
}
