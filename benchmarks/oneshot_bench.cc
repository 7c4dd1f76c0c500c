// One-shot loads, each in a fresh process: what a program that opens a checkpoint and loads it
// once pays (new mapping and page tables, new CUDA context, first pinned ring, fresh device
// memory), beside the pinned host-to-device ceiling measured in the same run.
//
//   oneshot_bench [--gib=8] [--dirs=/dev/shm,/var/tmp] [--reps=3] [--cases='SPEC;SPEC']
//                 [--host_only] [--no_host] [--host_all_dirs] [--keep]
//
// The parent writes an 8 GiB llama-like bf16 checkpoint once into the first directory, copies
// it into the others (fsync'd, then read once so it sits in the page cache), and runs every
// case in a child it forks and re-executes (`oneshot_bench --child SPEC PATH FORK_TIME`), so
// nothing is inherited. A child prints one RESULT line; the parent prints a table per
// directory (host-memory cases run in the first directory only, unless --host_all_dirs):
// the median load GB/s over the repetitions, its fraction of the ceiling, time to
// the first tensor and where the time went.
//
// Cases are specs "name:key=value,...":
//   kind=ceiling      pinned cudaMemcpyAsync of the checkpoint's byte count, 256 MiB copies
//   kind=loader       Reader::Open + Loader::Create + Loader::Load (the library as it is);
//                     alloc=one gives the loader caller buffers carved from one cudaMalloc;
//                     stream=1 takes Loader::LoadStreaming (time to first tensor)
//   kind=pipe         a stand-alone ring pipeline with the candidate knobs:
//     src=mmap|populate|mappopulate|pread   memcpy from a new mapping; the same after
//                     MADV_POPULATE_READ of each chunk's range by its worker; a MAP_POPULATE
//                     mapping; pread() from the file into the pinned slot
//     maphuge=1       madvise(MADV_HUGEPAGE) on the mapping
//     ring=register|hostalloc, ringhuge=1    malloc + prefault + cudaHostRegister (optionally
//                     2 MiB aligned with MADV_HUGEPAGE) or cudaHostAlloc, 64 MiB in 4 MiB slots
//     alloc=one|async|malloc    one cudaMalloc for all tensors, cudaMallocAsync per tensor,
//                     cudaMalloc per tensor
//     threads=N       copy workers
//     overlap=0|1|2   1: ring set-up on a thread while the file is opened and validated and
//                     device memory allocated; 2: CUDA context creation on that thread too
//   kind=host_memcpy  the host ceiling: N threads memcpy from populated anonymous memory into
//                     freshly allocated per-tensor buffers (allocation included)
//   kind=host_loader  Reader::Open + Loader::Create + LoadToHost
//   kind=host_pipe    src=mmap|populate|pread into fresh per-tensor buffers; dsthuge=1
//                     madvises them MADV_HUGEPAGE
// Load GB/s counts from the end of CUDA context creation (all but overlap=2) to the data on
// the device; "all" counts from the child's main() and includes the context.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "ferry/loader.hpp"
#include "load/loader_tuning.hpp"

#ifdef FERRY_HAVE_CUDA
#include <cuda_runtime.h>
#endif

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22
#endif

namespace {

using namespace ferry;

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

[[noreturn]] void Die(const std::string& msg) {
  std::fprintf(stderr, "oneshot_bench: %s\n", msg.c_str());
  std::fflush(stderr);
  std::_Exit(1);
}

constexpr uint64_t kChunk = uint64_t{4} << 20;
constexpr uint64_t kRing = uint64_t{64} << 20;
constexpr uint64_t kHuge = uint64_t{2} << 20;

struct Spec {
  std::string name;
  std::map<std::string, std::string> kv;
  std::string Get(const std::string& k, const std::string& def) const {
    auto it = kv.find(k);
    return it == kv.end() ? def : it->second;
  }
  int Int(const std::string& k, int def) const {
    auto it = kv.find(k);
    return it == kv.end() ? def : std::atoi(it->second.c_str());
  }
};

Spec ParseSpec(const std::string& s) {
  Spec spec;
  size_t colon = s.find(':');
  spec.name = s.substr(0, colon);
  if (colon == std::string::npos) return spec;
  std::stringstream ss(s.substr(colon + 1));
  std::string item;
  while (std::getline(ss, item, ',')) {
    size_t eq = item.find('=');
    if (eq == std::string::npos) Die("bad spec item '" + item + "' in " + s);
    spec.kv[item.substr(0, eq)] = item.substr(eq + 1);
  }
  return spec;
}

// Tensors in file order.
struct Extent {
  uint64_t offset, bytes;
};

std::vector<Extent> Extents(const Reader& r, uint64_t* total, bool any_encoding = false) {
  std::vector<Extent> out;
  *total = 0;
  for (size_t i = 0; i < r.num_tensors(); ++i) {
    TensorInfo t = r.tensor(i);
    if (t.encoding != Encoding::kRaw && !any_encoding) {
      Die("the probe handles raw tensors only");
    }
    out.push_back(Extent{t.data_offset, t.nbytes});
    *total += t.nbytes;
  }
  std::sort(out.begin(), out.end(),
            [](const Extent& a, const Extent& b) { return a.offset < b.offset; });
  return out;
}

// One 4 MiB (or smaller) piece of one tensor.
struct Piece {
  uint32_t tensor;
  uint64_t file_off, dst_off, len;
};

std::vector<Piece> Pieces(const std::vector<Extent>& ext) {
  std::vector<Piece> out;
  for (uint32_t t = 0; t < ext.size(); ++t) {
    for (uint64_t pos = 0; pos < ext[t].bytes; pos += kChunk) {
      out.push_back(Piece{t, ext[t].offset + pos, pos, std::min(kChunk, ext[t].bytes - pos)});
    }
  }
  return out;
}

void PReadAll(int fd, uint8_t* dst, uint64_t len, uint64_t off) {
  uint64_t done = 0;
  while (done < len) {
    ssize_t n = ::pread(fd, dst + done, len - done, static_cast<off_t>(off + done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) Die("pread failed");
    done += static_cast<uint64_t>(n);
  }
}

// The source of a pipeline: a new mapping or a descriptor.
struct Source {
  std::string mode;
  const uint8_t* map = nullptr;
  uint64_t size = 0;
  int fd = -1;
  std::atomic<uint64_t> populate_errors{0};

  void Open(const std::string& path, const std::string& src, bool huge) {
    mode = src;
    fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) Die("open " + path);
    struct stat st;
    ::fstat(fd, &st);
    size = static_cast<uint64_t>(st.st_size);
    if (src == "pread") return;
    int flags = MAP_SHARED | (src == "mappopulate" ? MAP_POPULATE : 0);
    void* p = ::mmap(nullptr, size, PROT_READ, flags, fd, 0);
    if (p == MAP_FAILED) Die("mmap " + path);
    if (huge) ::madvise(p, size, MADV_HUGEPAGE);
    map = static_cast<const uint8_t*>(p);
  }
  void Fill(uint8_t* dst, uint64_t off, uint64_t len) {
    if (mode == "pread") {
      PReadAll(fd, dst, len, off);
      return;
    }
    std::memcpy(dst, map + off, len);
  }
  // src=populate: map the range's pages in one call (MADV_POPULATE_READ) instead of one
  // fault per page (or fault-around block) inside memcpy. Repeating it is cheap.
  void Prefault(uint64_t off, uint64_t len) {
    if (mode != "populate") return;
    uint64_t b = off / 4096 * 4096;
    if (::madvise(const_cast<uint8_t*>(map) + b, off + len - b, MADV_POPULATE_READ) != 0) {
      populate_errors.fetch_add(1);
    }
  }
};

double g_exec = 0;  // fork in the parent to main() in the child

struct Result_ {
  std::map<std::string, double> t;  // seconds, by phase
  std::string note;
  void Print(const Spec& spec, uint64_t bytes) const {
    std::printf("RESULT name=%s bytes=%llu", spec.name.c_str(),
                static_cast<unsigned long long>(bytes));
    std::printf(" exec=%.6f", g_exec);
    for (const auto& [k, v] : t) std::printf(" %s=%.6f", k.c_str(), v);
    std::printf(" note=%s\n", note.empty() ? "-" : note.c_str());
    std::fflush(stdout);
  }
};

#ifdef FERRY_HAVE_CUDA

void Cuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess) Die(std::string(what) + ": " + cudaGetErrorString(err));
}

struct Ring {
  uint8_t* data = nullptr;
  bool registered = false;
  struct Slot {
    uint8_t* data;
    cudaEvent_t event;
    bool used = false;
    uint64_t turn = 0;
  };
  std::vector<Slot> slots;

  void Create(const std::string& kind, bool huge) {
    if (kind == "hostalloc") {
      void* p = nullptr;
      Cuda(cudaHostAlloc(&p, kRing, cudaHostAllocPortable), "cudaHostAlloc");
      data = static_cast<uint8_t*>(p);
    } else {
      void* p = std::aligned_alloc(huge ? kHuge : 4096, kRing);
      if (huge) ::madvise(p, kRing, MADV_HUGEPAGE);
      std::memset(p, 0, kRing);
      Cuda(cudaHostRegister(p, kRing, cudaHostRegisterPortable), "cudaHostRegister");
      data = static_cast<uint8_t*>(p);
      registered = true;
    }
    slots.resize(kRing / kChunk);
    for (size_t i = 0; i < slots.size(); ++i) {
      slots[i].data = data + i * kChunk;
      Cuda(cudaEventCreateWithFlags(&slots[i].event, cudaEventDisableTiming), "event");
      slots[i].turn = i;
    }
  }
};

// Device destinations, one pointer per tensor.
std::vector<uint8_t*> AllocateDevice(const std::vector<Extent>& ext, const std::string& how) {
  std::vector<uint8_t*> dst(ext.size());
  if (how == "one") {
    uint64_t total = 0;
    for (const Extent& e : ext) total += (e.bytes + 255) / 256 * 256;
    void* p = nullptr;
    Cuda(cudaMalloc(&p, total), "cudaMalloc (one)");
    uint64_t off = 0;
    for (size_t i = 0; i < ext.size(); ++i) {
      dst[i] = static_cast<uint8_t*>(p) + off;
      off += (ext[i].bytes + 255) / 256 * 256;
    }
  } else {
    for (size_t i = 0; i < ext.size(); ++i) {
      void* p = nullptr;
      if (how == "async") {
        Cuda(cudaMallocAsync(&p, ext[i].bytes, nullptr), "cudaMallocAsync");
      } else {
        Cuda(cudaMalloc(&p, ext[i].bytes), "cudaMalloc");
      }
      dst[i] = static_cast<uint8_t*>(p);
    }
  }
  return dst;
}

// Compares a few device ranges with the file, so a fast but wrong candidate shows.
std::string Check(const std::string& path, const std::vector<Extent>& ext,
                  const std::vector<uint8_t*>& dst) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  const uint64_t n = 65536;
  std::vector<uint8_t> a(n), b(n);
  bool ok = true;
  for (size_t i = 0; i < ext.size(); i += std::max<size_t>(1, ext.size() / 8)) {
    uint64_t len = std::min(n, ext[i].bytes);
    uint64_t at = ext[i].bytes - len;  // the tail: the last piece of the tensor
    PReadAll(fd, a.data(), len, ext[i].offset + at);
    Cuda(cudaMemcpy(b.data(), dst[i] + at, len, cudaMemcpyDeviceToHost), "check copy");
    ok = ok && std::memcmp(a.data(), b.data(), len) == 0;
  }
  ::close(fd);
  return ok ? "ok" : "MISMATCH";
}

void ChildCeiling(const Spec& spec, const std::string& path) {
  Result_ res;
  auto reader = Reader::Open(path);
  if (!reader.ok()) Die(reader.status().ToString());
  uint64_t bytes = 0;
  Extents(**reader, &bytes, true);
  double t0 = Now();
  Cuda(cudaFree(nullptr), "context");
  res.t["ctx"] = Now() - t0;
  const uint64_t chunk = uint64_t{256} << 20;
  void *host = nullptr, *dev = nullptr;
  Cuda(cudaHostAlloc(&host, chunk, cudaHostAllocDefault), "cudaHostAlloc");
  std::memset(host, 1, chunk);
  Cuda(cudaMalloc(&dev, chunk), "cudaMalloc");
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  double best = 1e9;
  for (int r = 0; r < 3; ++r) {
    cudaEventRecord(a);
    for (uint64_t done = 0; done < bytes; done += chunk) {
      cudaMemcpyAsync(dev, host, std::min(chunk, bytes - done), cudaMemcpyHostToDevice);
    }
    cudaEventRecord(b);
    Cuda(cudaEventSynchronize(b), "ceiling copy");
    float ms = 0;
    cudaEventElapsedTime(&ms, a, b);
    best = std::min(best, ms / 1e3);
  }
  res.t["load"] = best;
  int dev_id = 0;
  cudaGetDevice(&dev_id);
  cudaDeviceProp prop;
  cudaGetDeviceProperties(&prop, dev_id);
  res.note = "device" + std::to_string(dev_id) + "_" + std::string(prop.name);
  for (char& c : res.note) {
    if (c == ' ') c = '_';
  }
  res.Print(spec, bytes);
}

// The last row of every eighth tensor on the device against the reader's (decoding) read of
// it: catches a misplaced or corrupt copy of any encoding without a full host decode.
std::string CheckRows(const Reader& r, const std::vector<LoadedTensor>& out) {
  bool ok = true;
  for (size_t i = 0; i < out.size(); i += std::max<size_t>(1, out.size() / 8)) {
    const LoadedTensor& t = out[i];
    if (t.nbytes == 0) continue;
    const int64_t rows = t.info.shape.empty() ? 1 : t.info.shape[0];
    const uint64_t row_bytes = t.nbytes / static_cast<uint64_t>(rows);
    std::vector<uint8_t> want(row_bytes), got(row_bytes);
    Status st = t.info.shape.empty()
                    ? r.ReadInto(t.info.name, want.data(), want.size())
                    : r.ReadRowsInto(t.info.name, rows - 1, rows, want.data(), want.size());
    if (!st.ok()) Die(st.ToString());
    Cuda(cudaMemcpy(got.data(), static_cast<const uint8_t*>(t.data) + t.nbytes - row_bytes,
                    row_bytes, cudaMemcpyDeviceToHost),
         "check copy");
    ok = ok && want == got;
  }
  return ok ? "ok" : "MISMATCH";
}

// Keeps the GPU busy for `ms` milliseconds (memsets of a 256 MiB buffer), so that its clocks
// are up when the load starts: what a load finds in a process that has used the GPU already.
void SpinGpu(int ms) {
  if (ms <= 0) return;
  void* p = nullptr;
  Cuda(cudaMalloc(&p, uint64_t{256} << 20), "spin buffer");
  const double until = Now() + ms / 1e3;
  while (Now() < until) {
    for (int i = 0; i < 8; ++i) cudaMemsetAsync(p, i, uint64_t{256} << 20, nullptr);
    Cuda(cudaStreamSynchronize(nullptr), "spin");
  }
  cudaFree(p);
}

// Internal knobs of the loader from the spec (planes_*: src/load/loader_tuning.hpp).
LoaderTuning TuningOf(const Spec& spec) {
  LoaderTuning t;
  t.planes_group = spec.Int("group", t.planes_group);
  t.planes_twin_factor = spec.Int("twins", t.planes_twin_factor);
  t.planes_prewarm = spec.Int("prewarm", t.planes_prewarm ? 1 : 0) != 0;
  t.planes_verify_each_group = spec.Int("verifygroup", 0) != 0;
  t.planes_on_host = spec.Int("host", 0) != 0;
  const std::string read = spec.Get("read", "auto");
  t.planes_read = read == "pread" ? LoaderTuning::PlanesRead::kRead
                  : read == "map" ? LoaderTuning::PlanesRead::kMapping
                                  : LoaderTuning::PlanesRead::kAuto;
  return t;
}

void ChildLoader(const Spec& spec, const std::string& path, double t_main) {
  Result_ res;
  Cuda(cudaFree(nullptr), "context");
  SpinGpu(spec.Int("spin", 0));
  double t_ctx = Now();
  res.t["ctx"] = t_ctx - t_main;
  auto reader = Reader::Open(path);
  if (!reader.ok()) Die(reader.status().ToString());
  double t_open = Now();
  res.t["open"] = t_open - t_ctx;
  LoaderOptions o;
  o.threads = spec.Int("threads", 0);
  o.verify = spec.Int("verify", 0) != 0;
  if (spec.Get("ring", "register") == "hostalloc") o.pinned_alloc = PinnedAlloc::kHostAlloc;
  auto loader = Loader::Create(o);
  if (!loader.ok()) Die(loader.status().ToString());
  LoaderInternals::SetTuning(**loader, TuningOf(spec));
  std::vector<LoadRequest> reqs;
  uint64_t bytes = 0;
  std::vector<Extent> ext = Extents(**reader, &bytes, true);
  double t_alloc = Now();
  if (spec.Get("alloc", "default") == "one") {
    // Same layout as AllocateDevice(one), in name order.
    uint64_t total = 0;
    for (size_t i = 0; i < (*reader)->num_tensors(); ++i) {
      total += ((*reader)->tensor(i).nbytes + 255) / 256 * 256;
    }
    void* p = nullptr;
    Cuda(cudaMalloc(&p, total), "cudaMalloc (one)");
    uint64_t off = 0;
    for (size_t i = 0; i < (*reader)->num_tensors(); ++i) {
      TensorInfo t = (*reader)->tensor(i);
      LoadRequest q;
      q.name = t.name;
      q.dst = static_cast<uint8_t*>(p) + off;
      q.dst_bytes = t.nbytes;
      reqs.push_back(q);
      off += (t.nbytes + 255) / 256 * 256;
    }
  }
  res.t["alloc"] = Now() - t_alloc;
  double t_copy = Now();
  // stream=1: the streaming form; the first non-empty tensor handed over complete is the
  // time to first tensor.
  double t_first = 0;
  auto on_ready = [&](const ReadyTensor& t) {
    if (t_first == 0 && t.tensor->nbytes > 0) t_first = Now();
  };
  const bool streaming = spec.Int("stream", 0) != 0;
  auto load = [&] {
    return streaming ? (*loader)->LoadStreaming(**reader, reqs, on_ready)
                     : (*loader)->Load(**reader, reqs);
  };
  auto out = load();
  if (!out.ok()) Die(out.status().ToString());
  double t_end = Now();
  if (t_first > 0) res.t["first"] = t_first - t_ctx;
  res.t["copy"] = t_end - t_copy;  // ring set-up, default allocation and copies
  res.t["load"] = t_end - t_ctx;
  res.t["all"] = t_end - t_main;
  // Where the first load's time went (seconds from the start of the call).
  const LoadPhases ph = LoaderInternals::LastPhases(**loader);
  res.t["p_prepared"] = ph.prepared;
  res.t["p_planned"] = ph.planned;
  res.t["p_planes"] = ph.planes_ready;
  res.t["p_fill"] = ph.first_fill;
  res.t["p_decode"] = ph.first_decode;
  res.t["p_enqueued"] = ph.enqueued;
  res.t["p_checked"] = ph.checked;
  res.note = "check_" + CheckRows(**reader, *out);
  // steady=N: N more loads by the same loader (its ring, device slots and the faulted-in
  // mapping reused): the median is the steady state beside this process's first load.
  std::vector<double> steady;
  for (int r = 0; r < spec.Int("steady", 0); ++r) {
    out = Result<std::vector<LoadedTensor>>(std::vector<LoadedTensor>{});  // frees the last
    double a = Now();
    out = load();
    if (!out.ok()) Die(out.status().ToString());
    steady.push_back(Now() - a);
  }
  if (!steady.empty()) {
    std::sort(steady.begin(), steady.end());
    res.t["steady"] = steady[steady.size() / 2];
  }
  res.Print(spec, bytes);
}

void ChildPipe(const Spec& spec, const std::string& path, double t_main) {
  Result_ res;
  const int overlap = spec.Int("overlap", 0);
  const int threads = spec.Int("threads", 8);
  const std::string src = spec.Get("src", "mmap");
  double t_start = t_main;
  if (overlap < 2) {
    Cuda(cudaFree(nullptr), "context");
    t_start = Now();
    res.t["ctx"] = t_start - t_main;
  }
  Ring ring;
  double ring_secs = 0, ctx_secs = 0;
  int dev = 0;
  Cuda(cudaGetDevice(&dev), "cudaGetDevice");
  auto setup = [&] {
    Cuda(cudaSetDevice(dev), "cudaSetDevice");
    double a = Now();
    if (overlap == 2) {
      Cuda(cudaFree(nullptr), "context");
      ctx_secs = Now() - a;
      a = Now();
    }
    ring.Create(spec.Get("ring", "register"), spec.Int("ringhuge", 0) != 0);
    ring_secs = Now() - a;
  };
  std::thread setup_thread;
  if (overlap > 0) {
    setup_thread = std::thread(setup);
  } else {
    setup();
  }
  double t0 = Now();
  auto reader = Reader::Open(path);
  if (!reader.ok()) Die(reader.status().ToString());
  uint64_t bytes = 0;
  std::vector<Extent> ext = Extents(**reader, &bytes);
  Source source;
  source.Open(path, src, spec.Int("maphuge", 0) != 0);
  res.t["open"] = Now() - t0;
  if (overlap == 2) setup_thread.join();
  t0 = Now();
  std::vector<uint8_t*> dst = AllocateDevice(ext, spec.Get("alloc", "one"));
  res.t["alloc"] = Now() - t0;
  if (overlap == 1) setup_thread.join();
  res.t["ring"] = ring_secs;
  if (overlap == 2) res.t["ctx"] = ctx_secs;

  std::vector<Piece> pieces = Pieces(ext);
  std::vector<std::atomic<uint32_t>> remaining(ext.size());
  for (const Piece& p : pieces) remaining[p.tensor].fetch_add(1, std::memory_order_relaxed);
  cudaEvent_t first_event;
  Cuda(cudaEventCreate(&first_event), "first event");
  std::atomic<bool> first_recorded{false};
  std::atomic<uint64_t> next{0};
  std::mutex mu;
  std::condition_variable cv;
  const uint64_t nslots = ring.slots.size();
  double t_copy = Now();
  auto worker = [&] {
    Cuda(cudaSetDevice(dev), "cudaSetDevice");
    for (;;) {
      uint64_t k = next.fetch_add(1);
      if (k >= pieces.size()) return;
      Ring::Slot& slot = ring.slots[k % nslots];
      const Piece& p = pieces[k];
      // Page tables first, while earlier copies may still hold the slot.
      source.Prefault(p.file_off, p.len);
      {
        std::unique_lock<std::mutex> lock(mu);
        cv.wait(lock, [&] { return slot.turn == k; });
      }
      if (slot.used) Cuda(cudaEventSynchronize(slot.event), "slot wait");
      source.Fill(slot.data, p.file_off, p.len);
      Cuda(cudaMemcpyAsync(dst[p.tensor] + p.dst_off, slot.data, p.len, cudaMemcpyHostToDevice,
                           nullptr),
           "cudaMemcpyAsync");
      Cuda(cudaEventRecord(slot.event, nullptr), "cudaEventRecord");
      slot.used = true;
      // Every earlier piece of this tensor is already on the stream: the event after the
      // last one marks the whole tensor.
      if (remaining[p.tensor].fetch_sub(1) == 1 && p.tensor == 0) {
        Cuda(cudaEventRecord(first_event, nullptr), "first event");
        first_recorded.store(true);
      }
      {
        std::lock_guard<std::mutex> lock(mu);
        slot.turn = k + nslots;
      }
      cv.notify_all();
    }
  };
  std::vector<std::thread> pool;
  for (int i = 0; i < threads; ++i) pool.emplace_back(worker);
  while (!first_recorded.load()) std::this_thread::sleep_for(std::chrono::microseconds(20));
  Cuda(cudaEventSynchronize(first_event), "first tensor");
  double t_first = Now();
  for (std::thread& t : pool) t.join();
  Cuda(cudaStreamSynchronize(nullptr), "cudaStreamSynchronize");
  double t_end = Now();
  res.t["copy"] = t_end - t_copy;
  res.t["first"] = t_first - t_start;
  res.t["load"] = t_end - t_start;
  res.t["all"] = t_end - t_main;
  res.note = "check_" + Check(path, ext, dst);
  if (source.populate_errors.load() > 0) res.note += "_populate_failed";
  res.Print(spec, bytes);
}

#endif  // FERRY_HAVE_CUDA

// Fresh per-tensor host buffers, as LoadToHost allocates them.
std::vector<uint8_t*> AllocateHost(const std::vector<Extent>& ext, bool huge) {
  std::vector<uint8_t*> dst(ext.size());
  for (size_t i = 0; i < ext.size(); ++i) {
    uint64_t n = (ext[i].bytes + 63) / 64 * 64;
    dst[i] = static_cast<uint8_t*>(
        std::aligned_alloc(huge ? kHuge : 64, huge ? (n + kHuge - 1) / kHuge * kHuge : n));
    if (dst[i] == nullptr) Die("host allocation");
    if (huge) ::madvise(dst[i], n, MADV_HUGEPAGE);
  }
  return dst;
}

void RunParallel(int threads, const std::function<void()>& fn) {
  std::vector<std::thread> pool;
  for (int i = 0; i < threads; ++i) pool.emplace_back(fn);
  for (std::thread& t : pool) t.join();
}

void ChildHost(const Spec& spec, const std::string& path, double t_main) {
  Result_ res;
  const std::string kind = spec.Get("kind", "");
  const int threads = spec.Int("threads", 8);
  auto reader0 = Reader::Open(path);
  if (!reader0.ok()) Die(reader0.status().ToString());
  uint64_t bytes = 0;
  std::vector<Extent> ext = Extents(**reader0, &bytes);
  std::vector<Piece> pieces = Pieces(ext);
  if (kind == "host_memcpy") {
    // A populated anonymous source (untimed), then fresh destinations (timed).
    const uint64_t span = ext.back().offset + ext.back().bytes - ext[0].offset;
    uint8_t* srcmem =
        static_cast<uint8_t*>(std::aligned_alloc(kHuge, (span + kHuge) / kHuge * kHuge));
    std::atomic<uint64_t> next{0};
    RunParallel(threads, [&] {
      for (uint64_t k; (k = next.fetch_add(1)) < pieces.size();) {
        std::memset(srcmem + pieces[k].file_off - ext[0].offset, 1, pieces[k].len);
      }
    });
    double t0 = Now();
    std::vector<uint8_t*> dst = AllocateHost(ext, spec.Int("dsthuge", 0) != 0);
    res.t["alloc"] = Now() - t0;
    double t1 = Now();
    next = 0;
    RunParallel(threads, [&] {
      for (uint64_t k; (k = next.fetch_add(1)) < pieces.size();) {
        const Piece& p = pieces[k];
        std::memcpy(dst[p.tensor] + p.dst_off, srcmem + p.file_off - ext[0].offset, p.len);
      }
    });
    double t_end = Now();
    res.t["copy"] = t_end - t1;
    res.t["load"] = t_end - t0;
    res.Print(spec, bytes);
    return;
  }
  reader0->reset();
  double t0 = Now();
  if (kind == "host_loader") {
    auto reader = Reader::Open(path);
    if (!reader.ok()) Die(reader.status().ToString());
    res.t["open"] = Now() - t0;
    LoaderOptions o;
    o.threads = spec.Int("threads", 0);
    auto loader = Loader::Create(o);
    if (!loader.ok()) Die(loader.status().ToString());
    double t1 = Now();
    auto out = (*loader)->LoadToHost(**reader, {});
    if (!out.ok()) Die(out.status().ToString());
    double t_end = Now();
    res.t["copy"] = t_end - t1;
    res.t["load"] = t_end - t0;
    res.t["all"] = t_end - t_main;
    res.Print(spec, bytes);
    return;
  }
  auto reader = Reader::Open(path);
  if (!reader.ok()) Die(reader.status().ToString());
  Source source;
  source.Open(path, spec.Get("src", "mmap"), spec.Int("maphuge", 0) != 0);
  res.t["open"] = Now() - t0;
  double t1 = Now();
  std::vector<uint8_t*> dst = AllocateHost(ext, spec.Int("dsthuge", 0) != 0);
  res.t["alloc"] = Now() - t1;
  t1 = Now();
  std::atomic<uint64_t> next{0};
  RunParallel(threads, [&] {
    for (uint64_t k; (k = next.fetch_add(1)) < pieces.size();) {
      const Piece& p = pieces[k];
      source.Prefault(p.file_off, p.len);
      source.Fill(dst[p.tensor] + p.dst_off, p.file_off, p.len);
    }
  });
  double t_end = Now();
  res.t["copy"] = t_end - t1;
  res.t["load"] = t_end - t0;
  res.t["all"] = t_end - t_main;
  // Spot check against the file.
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  std::vector<uint8_t> a(4096);
  bool ok = true;
  for (size_t i = 0; i < ext.size(); i += 7) {
    uint64_t len = std::min<uint64_t>(4096, ext[i].bytes);
    PReadAll(fd, a.data(), len, ext[i].offset + ext[i].bytes - len);
    ok = ok && std::memcmp(a.data(), dst[i] + ext[i].bytes - len, len) == 0;
  }
  ::close(fd);
  res.note = ok ? "check_ok" : "check_MISMATCH";
  res.Print(spec, bytes);
}

int Child(const std::string& spec_text, const std::string& path, double t_fork) {
  double t_main = Now();
  Spec spec = ParseSpec(spec_text);
  const std::string kind = spec.Get("kind", "");
  g_exec = t_main - t_fork;
  if (kind.rfind("host_", 0) == 0) {
    ChildHost(spec, path, t_main);
    return 0;
  }
#ifdef FERRY_HAVE_CUDA
  if (kind == "ceiling") {
    ChildCeiling(spec, path);
  } else if (kind == "loader") {
    ChildLoader(spec, path, t_main);
  } else if (kind == "pipe") {
    ChildPipe(spec, path, t_main);
  } else {
    Die("unknown kind " + kind);
  }
#else
  std::printf("RESULT name=%s bytes=0 note=no_cuda_build\n", spec.name.c_str());
#endif
  return 0;
}

// ---- parent ---------------------------------------------------------------------------------

const char* kGpuCases[] = {
    "ceiling:kind=ceiling",
    "loader:kind=loader",
    "loader_one:kind=loader,alloc=one",
    "loader_stream:kind=loader,stream=1",
    "mmap_async:kind=pipe,src=mmap,alloc=async",
    "mmap_one:kind=pipe,src=mmap,alloc=one",
    "mmap_huge:kind=pipe,src=mmap,maphuge=1,alloc=one",
    "populate:kind=pipe,src=populate,alloc=one",
    "mappopulate:kind=pipe,src=mappopulate,alloc=one",
    "pread:kind=pipe,src=pread,alloc=one",
    "pread_async:kind=pipe,src=pread,alloc=async",
    "pread_t12:kind=pipe,src=pread,alloc=one,threads=12",
    "pread_t16:kind=pipe,src=pread,alloc=one,threads=16",
    "pread_hostalloc:kind=pipe,src=pread,alloc=one,ring=hostalloc",
    "pread_ringhuge:kind=pipe,src=pread,alloc=one,ringhuge=1",
    "pread_overlap:kind=pipe,src=pread,alloc=one,ringhuge=1,overlap=1",
    "pread_overlap_ctx:kind=pipe,src=pread,alloc=one,ringhuge=1,overlap=2",
};

const char* kHostCases[] = {
    "host_memcpy:kind=host_memcpy,threads=8",
    "host_memcpy_huge:kind=host_memcpy,threads=8,dsthuge=1",
    "host_loader:kind=host_loader",
    "host_mmap:kind=host_pipe,src=mmap,threads=8",
    "host_pread:kind=host_pipe,src=pread,threads=8",
    "host_pread_huge:kind=host_pipe,src=pread,threads=8,dsthuge=1",
    "host_populate_huge:kind=host_pipe,src=populate,threads=8,dsthuge=1",
};

struct Row {
  std::string name;
  uint64_t bytes = 0;
  std::vector<std::map<std::string, double>> runs;
  std::string note;
};

std::string SelfExe() {
  char buf[4096];
  ssize_t n = ::readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0) Die("readlink /proc/self/exe");
  return std::string(buf, static_cast<size_t>(n));
}

// Runs one case in a new process; returns its RESULT line.
std::string Spawn(const std::string& spec, const std::string& path) {
  int fds[2];
  if (::pipe(fds) != 0) Die("pipe");
  char fork_time[64];
  std::snprintf(fork_time, sizeof(fork_time), "%.9f", Now());
  pid_t pid = ::fork();
  if (pid < 0) Die("fork");
  if (pid == 0) {
    ::dup2(fds[1], 1);
    ::close(fds[0]);
    ::close(fds[1]);
    std::string exe = SelfExe();
    ::execl(exe.c_str(), exe.c_str(), "--child", spec.c_str(), path.c_str(), fork_time,
            static_cast<char*>(nullptr));
    std::_Exit(127);
  }
  ::close(fds[1]);
  std::string out;
  char buf[4096];
  for (ssize_t n; (n = ::read(fds[0], buf, sizeof(buf))) != 0;) {
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  ::close(fds[0]);
  int status = 0;
  ::waitpid(pid, &status, 0);
  size_t at = out.find("RESULT ");
  if (at == std::string::npos) {
    return "RESULT name=" + ParseSpec(spec).name + " bytes=0 note=child_failed_status_" +
           std::to_string(status);
  }
  std::string line = out.substr(at, out.find('\n', at) - at);
  std::fprintf(stderr, "%s\n", line.c_str());  // raw figures, for the record
  return line;
}

void ParseResult(const std::string& line, Row* row) {
  std::stringstream ss(line.substr(7));
  std::string item;
  std::map<std::string, double> run;
  while (ss >> item) {
    size_t eq = item.find('=');
    std::string k = item.substr(0, eq), v = item.substr(eq + 1);
    if (k == "name") {
      row->name = v;
    } else if (k == "bytes") {
      row->bytes = std::strtoull(v.c_str(), nullptr, 10);
    } else if (k == "note") {
      if (v != "-") row->note = v;
    } else {
      run[k] = std::atof(v.c_str());
    }
  }
  if (run.count("load")) row->runs.push_back(run);
}

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

// The checkpoint: per layer four attention projections, three MLP matrices and two norms.
void Generate(const std::string& path, double gib) {
  const uint64_t target = static_cast<uint64_t>(gib * (1ull << 30));
  const int64_t hidden = 4096, ffn = 14336;
  WriterOptions wo;
  wo.durable = false;
  auto w = Writer::Create(path, wo);
  if (!w.ok()) Die(w.status().ToString());
  std::vector<uint16_t> buf(static_cast<size_t>(hidden) * ffn);
  uint64_t x = 0x9E3779B97F4A7C15ull;
  for (auto& v : buf) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    v = static_cast<uint16_t>(0x3c00 | (x & 0x83ff));
  }
  uint64_t written = 0;
  size_t stamp = 0;
  for (int layer = 0; written < target; ++layer) {
    std::string p = "model.layers." + std::to_string(layer) + ".";
    struct M {
      const char* n;
      int64_t r, c;
    } mats[] = {
        {"self_attn.q_proj.weight", hidden, hidden},   {"self_attn.k_proj.weight", 1024, hidden},
        {"self_attn.v_proj.weight", 1024, hidden},     {"self_attn.o_proj.weight", hidden, hidden},
        {"mlp.gate_proj.weight", ffn, hidden},         {"mlp.up_proj.weight", ffn, hidden},
        {"mlp.down_proj.weight", hidden, ffn},         {"input_layernorm.weight", 1, hidden},
        {"post_attention_layernorm.weight", 1, hidden}};
    for (const M& m : mats) {
      std::vector<int64_t> shape =
          m.r == 1 ? std::vector<int64_t>{m.c} : std::vector<int64_t>{m.r, m.c};
      uint64_t n = static_cast<uint64_t>(m.r * m.c) * 2;
      // Different bytes per tensor, so a misplaced copy fails the check.
      buf[stamp++ % buf.size()] ^= 0x5a5a;
      Status st = w->AddTensor(p + m.n, DType::kBF16, shape, buf.data(), n);
      if (!st.ok()) Die(st.ToString());
      written += n;
    }
  }
  if (Status st = w->Commit(); !st.ok()) Die(st.ToString());
}

void CopyFile(const std::string& from, const std::string& to) {
  int in = ::open(from.c_str(), O_RDONLY | O_CLOEXEC);
  int out = ::open(to.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (in < 0 || out < 0) Die("copy " + from + " -> " + to);
  std::vector<char> buf(64 << 20);
  for (ssize_t n; (n = ::read(in, buf.data(), buf.size())) > 0;) {
    if (::write(out, buf.data(), static_cast<size_t>(n)) != n) Die("write " + to);
  }
  ::fsync(out);  // no writeback running under the measurements
  ::close(in);
  ::close(out);
}

double Resident(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  struct stat st;
  ::fstat(fd, &st);
  size_t size = static_cast<size_t>(st.st_size);
  void* p = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
  std::vector<unsigned char> vec((size + 4095) / 4096);
  ::mincore(p, size, vec.data());
  size_t in = 0;
  for (unsigned char c : vec) in += c & 1;
  ::munmap(p, size);
  ::close(fd);
  return static_cast<double>(in) / vec.size();
}

void MakeHot(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  std::vector<char> buf(64 << 20);
  while (::read(fd, buf.data(), buf.size()) > 0) {
  }
  ::close(fd);
}

void PrintTable(const std::string& dir, std::vector<Row>& rows, double ceiling_gbps) {
  std::printf("\n== %s: one-shot load in a fresh process; pinned ceiling %.1f GB/s (same run) ==\n",
              dir.c_str(), ceiling_gbps);
  std::printf("%-22s %7s %7s %6s %8s %8s | %7s %7s %7s %7s %7s %7s | %s\n", "case", "GB/s", "best",
              "ceil", "all GB/s", "1st ms", "ctx ms", "ring", "open", "alloc", "copy", "total",
              "runs GB/s / note");
  for (Row& row : rows) {
    std::vector<double> gbps, all, first;
    std::map<std::string, std::vector<double>> phase;
    for (auto& run : row.runs) {
      gbps.push_back(row.bytes / run["load"] / 1e9);
      if (run.count("all")) all.push_back(row.bytes / run["all"] / 1e9);
      if (run.count("first")) first.push_back(run["first"] * 1e3);
      for (auto& [k, v] : run) phase[k].push_back(v * 1e3);
    }
    if (gbps.empty()) {
      std::printf("%-22s %s\n", row.name.c_str(), row.note.c_str());
      continue;
    }
    double med = Median(gbps);
    auto ph = [&](const char* k) { return phase.count(k) ? Median(phase[k]) : 0.0; };
    std::string runs;
    for (double g : gbps) {
      char b[32];
      std::snprintf(b, sizeof(b), "%.1f ", g);
      runs += b;
    }
    std::printf(
        "%-22s %7.1f %7.1f %6.2f %8.1f %8.1f | %7.0f %7.1f %7.1f %7.1f %7.1f %7.0f | %s%s\n",
        row.name.c_str(), med, *std::max_element(gbps.begin(), gbps.end()),
        ceiling_gbps > 0 ? med / ceiling_gbps : 0.0, Median(all), Median(first), ph("ctx"),
        ph("ring"), ph("open"), ph("alloc"), ph("copy"), ph("all"), runs.c_str(), row.note.c_str());
  }
  std::fflush(stdout);
}

// Loader rows: the first load beside the steady state of the same process, and where the
// first load's time went (ms from the start of the Load call; 0: the step did not occur).
void PrintLoaderDetail(std::vector<Row>& rows, double ceiling_gbps) {
  bool any = false;
  for (Row& row : rows) {
    for (auto& run : row.runs) any = any || run.count("p_enqueued") > 0;
  }
  if (!any) return;
  std::printf("\n%-22s %7s %7s %6s | %7s %7s %7s %7s %7s %7s %7s  (first load: ms into Load)\n",
              "loader case", "first", "steady", "st/ceil", "prep", "plan", "planes", "fill",
              "decode", "enq", "check");
  for (Row& row : rows) {
    std::map<std::string, std::vector<double>> v;
    for (auto& run : row.runs) {
      if (!run.count("p_enqueued")) continue;
      v["first"].push_back(row.bytes / run["load"] / 1e9);
      if (run.count("steady")) v["steady"].push_back(row.bytes / run["steady"] / 1e9);
      for (const char* k : {"p_prepared", "p_planned", "p_planes", "p_fill", "p_decode",
                            "p_enqueued", "p_checked"}) {
        v[k].push_back(run.count(k) ? run[k] * 1e3 : 0);
      }
    }
    if (v["first"].empty()) continue;
    const double steady = Median(v["steady"]);
    std::printf("%-22s %7.1f %7.1f %6.2f | %7.1f %7.1f %7.1f %7.1f %7.1f %7.1f %7.1f\n",
                row.name.c_str(), Median(v["first"]), steady,
                ceiling_gbps > 0 ? steady / ceiling_gbps : 0.0, Median(v["p_prepared"]),
                Median(v["p_planned"]), Median(v["p_planes"]), Median(v["p_fill"]),
                Median(v["p_decode"]), Median(v["p_enqueued"]), Median(v["p_checked"]));
  }
  std::fflush(stdout);
}

int Parent(int argc, char** argv) {
  double gib = 8;
  int reps = 3;
  std::vector<std::string> dirs = {"/dev/shm", "/var/tmp"};
  std::vector<std::string> cases;
  bool host = true, gpu = true, keep = false, host_all_dirs = false;
  std::string given;  // --file: an existing checkpoint (any encoding), neither copied nor removed
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto list = [](const std::string& s) {
      std::vector<std::string> v;
      std::stringstream ss(s);
      std::string item;
      while (std::getline(ss, item, ';')) v.push_back(item);
      return v;
    };
    if (a.rfind("--gib=", 0) == 0) {
      gib = std::atof(a.c_str() + 6);
    } else if (a.rfind("--reps=", 0) == 0) {
      reps = std::atoi(a.c_str() + 7);
    } else if (a.rfind("--dirs=", 0) == 0) {
      dirs.clear();
      std::stringstream ss(a.substr(7));
      std::string d;
      while (std::getline(ss, d, ',')) dirs.push_back(d);
    } else if (a.rfind("--cases=", 0) == 0) {
      cases = list(a.substr(8));  // specs separated by ';'
    } else if (a == "--host_only") {
      gpu = false;
    } else if (a == "--no_host") {
      host = false;
    } else if (a == "--host_all_dirs") {
      host_all_dirs = true;
    } else if (a == "--keep") {
      keep = true;
    } else if (a.rfind("--file=", 0) == 0) {
      given = a.substr(7);
    } else {
      Die("unknown argument " + a +
          " (--gib=N --reps=N --dirs=a,b --cases='spec;spec' --host_only --no_host "
          "--host_all_dirs --keep --file=PATH)");
    }
  }
  if (cases.empty()) {
    if (gpu) cases.assign(std::begin(kGpuCases), std::end(kGpuCases));
    if (host) cases.insert(cases.end(), std::begin(kHostCases), std::end(kHostCases));
  }
  std::vector<std::string> paths;
  bool gpu_ok = true;
  double t0 = Now();
  if (!given.empty()) {
    dirs = {given.substr(0, given.rfind('/') == std::string::npos ? 0 : given.rfind('/'))};
    keep = true;
  }
  for (size_t d = 0; d < dirs.size(); ++d) {
    std::string path = given.empty() ? dirs[d] + "/ferry_oneshot.ferry" : given;
    if (!given.empty()) {
    } else if (d == 0) {
      Generate(path, gib);
    } else {
      CopyFile(paths[0], path);
    }
    MakeHot(path);
    paths.push_back(path);
  }
  std::printf("files written and read once in %.1f s\n", Now() - t0);
  for (size_t d = 0; d < dirs.size(); ++d) {
    std::vector<Row> rows(cases.size());
    for (int rep = 0; rep < reps; ++rep) {
      for (size_t c = 0; c < cases.size(); ++c) {
        Spec spec = ParseSpec(cases[c]);
        bool gpu_case = spec.Get("kind", "").rfind("host_", 0) != 0;
        if (!gpu_case && d > 0 && !host_all_dirs) continue;
        if (gpu_case && !gpu_ok) {
          rows[c].name = spec.name;
          rows[c].note = "skipped_no_gpu";
          continue;
        }
        ParseResult(Spawn(cases[c], paths[d]), &rows[c]);
        // The ceiling runs first: when it fails there is no usable GPU.
        if (spec.Get("kind", "") == "ceiling" && rows[c].runs.empty()) gpu_ok = false;
      }
    }
    double ceiling = 0;
    for (Row& r : rows) {
      if (r.name == "ceiling") {
        for (auto& run : r.runs) ceiling = std::max(ceiling, r.bytes / run["load"] / 1e9);
      }
    }
    uint64_t bytes = 0;
    for (Row& r : rows) bytes = std::max(bytes, r.bytes);
    double host_ceiling = 0;
    for (Row& r : rows) {
      if (r.name == "host_memcpy") {
        std::vector<double> v;
        for (auto& run : r.runs) v.push_back(r.bytes / run["load"] / 1e9);
        host_ceiling = Median(v);
      }
    }
    std::printf("\n%s: %.2f GiB, %.0f%% resident in the page cache before the runs\n",
                paths[d].c_str(), bytes / double(1ull << 30), Resident(paths[d]) * 100);
    std::vector<Row> gpu_rows, host_rows;
    for (Row& r : rows) (r.name.rfind("host_", 0) == 0 ? host_rows : gpu_rows).push_back(r);
    if (!gpu_ok) {
      std::printf("GPU cases skipped: no usable GPU\n");
    } else if (!gpu_rows.empty()) {
      PrintTable(dirs[d], gpu_rows, ceiling);
      PrintLoaderDetail(gpu_rows, ceiling);
    }
    host_rows.erase(std::remove_if(host_rows.begin(), host_rows.end(),
                                   [](const Row& r) { return r.name.empty(); }),
                    host_rows.end());
    if (!host_rows.empty()) {
      std::printf("(host rows: 'ceil' is the fraction of host_memcpy, %.1f GB/s)", host_ceiling);
      PrintTable(dirs[d] + " (host memory target)", host_rows, host_ceiling);
    }
  }
  if (!keep) {
    for (const std::string& p : paths) ::unlink(p.c_str());
  }
  std::printf("\ntotal %.0f s\n", Now() - t0);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 5 && std::string(argv[1]) == "--child") {
    int rc = Child(argv[2], argv[3], std::atof(argv[4]));
    std::fflush(stdout);
    std::fflush(stderr);
    std::_Exit(rc);  // the OS tears the process down; nothing of it is timed
  }
  return Parent(argc, argv);
}
