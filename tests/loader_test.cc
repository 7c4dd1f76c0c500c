// Loader tests: host targets run everywhere; device tests skip when no GPU is usable.
#include "ferry/loader.hpp"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <stdexcept>
#include <thread>

#include "test_util.hpp"

#ifdef FERRY_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace ferry {
namespace {

using testing::RandomBytes;
using testing::TempDir;

// A checkpoint with every dtype in every encoding, a multi-block tensor, many small tensors,
// a scalar and an empty tensor.
class LoaderTest : public ::testing::Test {
 protected:
  void SetUp() override {
    path_ = dir_.File("ckpt.ferry");
    WriterOptions wo;
    wo.block_size = 64 << 10;  // small blocks so modest tensors span several
    auto w = Writer::Create(path_, wo);
    ASSERT_TRUE(w.ok()) << w.status().ToString();
    uint64_t seed = 1;
    for (Encoding enc :
         {Encoding::kRaw, Encoding::kZstd, Encoding::kShuffleZstd, Encoding::kPlanes}) {
      for (int d = 0; d < kNumDTypes; ++d) {
        auto dtype = static_cast<DType>(d);
        std::vector<int64_t> shape = {37, 129};
        Add(*w, std::string(EncodingName(enc)) + "/" + DTypeName(dtype), dtype, shape, enc, seed++);
      }
    }
    Add(*w, "big", DType::kBF16, {1000, 777}, Encoding::kRaw, 100);
    Add(*w, "big_zstd", DType::kBF16, {1000, 777}, Encoding::kShuffleZstd, 101);
    Add(*w, "big_planes", DType::kBF16, {1000, 777}, Encoding::kPlanes, 102);
    for (int i = 0; i < 300; ++i) {
      Add(*w, "small/" + std::to_string(i), DType::kF32, {i % 7 + 1}, Encoding::kRaw, 200 + i);
    }
    Add(*w, "scalar", DType::kF64, {}, Encoding::kRaw, 999);
    Add(*w, "empty", DType::kF16, {0, 4}, Encoding::kRaw, 998);
    ASSERT_TRUE(w->Commit().ok());
    auto r = Reader::Open(path_);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    reader_ = *r;
  }

  void Add(Writer& w, const std::string& name, DType dtype, std::vector<int64_t> shape,
           Encoding enc, uint64_t seed) {
    ASSERT_TRUE(testing::AddTestTensor(w, name, dtype, shape, enc, seed, &expected_).ok());
  }

  TempDir dir_;
  std::string path_;
  std::shared_ptr<Reader> reader_;
  std::map<std::string, std::vector<uint8_t>> expected_;
};

TEST_F(LoaderTest, RejectsBadOptions) {
  LoaderOptions o;
  o.slot_bytes = 1000;
  EXPECT_EQ(Loader::Create(o).status().code(), StatusCode::kInvalidArgument);
  o = LoaderOptions();
  o.staging_bytes = o.slot_bytes;
  EXPECT_EQ(Loader::Create(o).status().code(), StatusCode::kInvalidArgument);
}

TEST_F(LoaderTest, HostLoadAllBitExact) {
  LoaderOptions o;
  o.verify = true;
  o.slot_bytes = 16 << 10;
  o.staging_bytes = 64 << 10;
  auto loader = Loader::Create(o);
  ASSERT_TRUE(loader.ok());
  auto out = (*loader)->LoadToHost(*reader_, {});
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  ASSERT_EQ(out->size(), expected_.size());
  for (const LoadedTensor& t : *out) {
    const auto& want = expected_.at(t.info.name);
    ASSERT_EQ(t.nbytes, want.size()) << t.info.name;
    EXPECT_EQ(t.device, -1);
    if (!want.empty()) {
      EXPECT_EQ(std::memcmp(t.data, want.data(), want.size()), 0) << t.info.name;
    }
  }
}

TEST_F(LoaderTest, HostLoadRowsAndCallerBuffers) {
  auto loader = Loader::Create();
  ASSERT_TRUE(loader.ok());
  const auto& big = expected_.at("big_zstd");
  const uint64_t row = 777 * 2;
  std::vector<uint8_t> buf(100 * row);
  std::vector<LoadRequest> reqs(2);
  reqs[0].name = "big_zstd";
  reqs[0].row_begin = 123;
  reqs[0].row_end = 223;
  reqs[0].dst = buf.data();
  reqs[0].dst_bytes = buf.size();
  reqs[1].name = "raw/F32";
  auto out = (*loader)->LoadToHost(*reader_, reqs);
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  EXPECT_EQ((*out)[0].info.shape, (std::vector<int64_t>{100, 777}));
  EXPECT_EQ((*out)[0].owner, nullptr);
  EXPECT_EQ(std::memcmp(buf.data(), big.data() + 123 * row, buf.size()), 0);
  EXPECT_EQ(std::memcmp((*out)[1].data, expected_.at("raw/F32").data(), (*out)[1].nbytes), 0);

  reqs.resize(1);
  reqs[0].dst_bytes = buf.size() - 1;
  auto small = (*loader)->LoadToHost(*reader_, reqs);
  EXPECT_EQ(small.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(small.status().message().find("'big_zstd'"), std::string::npos);

  std::vector<LoadRequest> missing(1);
  missing[0].name = "nope";
  auto nf = (*loader)->LoadToHost(*reader_, missing);
  EXPECT_EQ(nf.status().code(), StatusCode::kNotFound);
  EXPECT_NE(nf.status().message().find(path_), std::string::npos);
}

TEST_F(LoaderTest, HostLoadWithDirectIoBitExact) {
  LoaderOptions o;
  o.io = IoMode::kDirect;
  o.verify = true;
  auto loader = Loader::Create(o);
  ASSERT_TRUE(loader.ok());
  ASSERT_NE(reader_->file_size() % 4096, 0u);  // the last direct read ends at end of file
  auto out = (*loader)->LoadToHost(*reader_, {});
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  if (!(*loader)->last_stats().used_direct_io) GTEST_SKIP() << "TMPDIR refuses O_DIRECT";
  for (const LoadedTensor& t : *out) {
    const auto& want = expected_.at(t.info.name);
    ASSERT_EQ(t.nbytes, want.size());
    if (!want.empty()) EXPECT_EQ(std::memcmp(t.data, want.data(), want.size()), 0) << t.info.name;
  }
  // Row ranges cut blocks; verification falls back to the mapping for the cut blocks.
  std::vector<LoadRequest> reqs(2);
  reqs[0].name = "big";
  reqs[0].row_begin = 3;
  reqs[0].row_end = 777;
  reqs[1].name = "big_zstd";
  reqs[1].row_begin = 500;
  auto rows = (*loader)->LoadToHost(*reader_, reqs);
  ASSERT_TRUE(rows.ok()) << rows.status().ToString();
  const uint64_t row = 777 * 2;
  EXPECT_EQ(std::memcmp((*rows)[0].data, expected_["big"].data() + 3 * row, 774 * row), 0);
  EXPECT_EQ(std::memcmp((*rows)[1].data, expected_["big_zstd"].data() + 500 * row, 500 * row), 0);
}

TEST_F(LoaderTest, DirectReadOfTruncatedFileIsAnError) {
  std::string path = dir_.File("short.ferry");
  std::vector<uint8_t> bytes = RandomBytes(5000, 77);
  {
    auto w = Writer::Create(path);
    ASSERT_TRUE(w->AddTensor("t", DType::kU8, {5000}, bytes.data(), bytes.size()).ok());
    ASSERT_TRUE(w->Commit().ok());
  }
  auto r = Reader::Open(path);
  ASSERT_TRUE(r.ok());
  LoaderOptions o;
  o.io = IoMode::kDirect;
  auto loader = Loader::Create(o);
  auto ok = (*loader)->LoadToHost(**r, {});
  ASSERT_TRUE(ok.ok()) << ok.status().ToString();
  if (!(*loader)->last_stats().used_direct_io) GTEST_SKIP() << "TMPDIR refuses O_DIRECT";
  EXPECT_EQ(std::memcmp((*ok)[0].data, bytes.data(), bytes.size()), 0);
  // The file shrinks under an open reader: a direct read reports it instead of faulting.
  ASSERT_EQ(::truncate(path.c_str(), 4096 + 100), 0);
  auto bad = (*loader)->LoadToHost(**r, {});
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(bad.status().message().find("truncated"), std::string::npos) << bad.status().ToString();
}

// Every tensor handed over exactly once, its bytes already in place when it is, in file
// order (one worker makes that order exact), on one callback thread that is neither the
// caller's nor running twice at once.
TEST_F(LoaderTest, HostStreamingHandsOverEachTensorOnceLoaded) {
  for (int threads : {1, 4}) {
    LoaderOptions o;
    o.threads = threads;
    o.slot_bytes = 16 << 10;
    auto loader = Loader::Create(o);
    ASSERT_TRUE(loader.ok());
    std::vector<int> seen(reader_->num_tensors(), 0);
    std::vector<uint64_t> offsets;
    std::atomic<int> inside{0};
    std::thread::id callback_thread;
    bool bytes_ok = true, one_thread = true, overlapped = false;
    auto on_ready = [&](const ReadyTensor& t) {
      overlapped = overlapped || inside.fetch_add(1) != 0;
      if (callback_thread == std::thread::id()) callback_thread = std::this_thread::get_id();
      one_thread = one_thread && callback_thread == std::this_thread::get_id();
      EXPECT_EQ(t.ready, nullptr);
      ++seen.at(t.index);
      const auto& want = expected_.at(t.tensor->info.name);
      bytes_ok = bytes_ok && t.tensor->nbytes == want.size() &&
                 (want.empty() || std::memcmp(t.tensor->data, want.data(), want.size()) == 0);
      if (t.tensor->nbytes > 0) offsets.push_back(t.tensor->info.data_offset);
      inside.fetch_sub(1);
    };
    auto out = (*loader)->LoadToHostStreaming(*reader_, {}, on_ready);
    ASSERT_TRUE(out.ok()) << out.status().ToString();
    EXPECT_EQ(out->size(), reader_->num_tensors());
    EXPECT_EQ(seen, std::vector<int>(reader_->num_tensors(), 1));
    EXPECT_TRUE(bytes_ok);
    EXPECT_TRUE(one_thread);
    EXPECT_FALSE(overlapped);
    EXPECT_NE(callback_thread, std::this_thread::get_id());
    if (threads == 1) EXPECT_TRUE(std::is_sorted(offsets.begin(), offsets.end()));
  }
}

TEST_F(LoaderTest, StreamingCallbackErrors) {
  auto loader = Loader::Create();
  ASSERT_TRUE(loader.ok());
  EXPECT_EQ((*loader)->LoadToHostStreaming(*reader_, {}, nullptr).status().code(),
            StatusCode::kInvalidArgument);
  int calls = 0;
  auto out = (*loader)->LoadToHostStreaming(*reader_, {}, [&](const ReadyTensor&) {
    ++calls;
    throw std::runtime_error("consumer gave up");
  });
  ASSERT_FALSE(out.ok());
  EXPECT_EQ(out.status().code(), StatusCode::kInternal);
  EXPECT_NE(out.status().message().find("consumer gave up"), std::string::npos);
  EXPECT_EQ(calls, 1);
  // The loader is usable afterwards.
  std::vector<LoadRequest> one(1);
  one[0].name = "scalar";
  int later = 0;
  auto again = (*loader)->LoadToHostStreaming(*reader_, one,
                                              [&](const ReadyTensor& t) { later += 1 + t.index; });
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_EQ(later, 1);
}

#ifdef FERRY_HAVE_CUDA

#define SKIP_WITHOUT_GPU() \
  if (!CudaAvailable()) GTEST_SKIP() << "no CUDA device"

std::vector<uint8_t> ToHost(const void* dev, uint64_t n) {
  std::vector<uint8_t> out(n);
  if (n) EXPECT_EQ(cudaMemcpy(out.data(), dev, n, cudaMemcpyDeviceToHost), cudaSuccess);
  return out;
}

int DeviceOf(const void* p) {
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) return -2;
  return a.device;
}

class DeviceLoaderTest : public LoaderTest {
 protected:
  void CheckAll(const std::vector<LoadedTensor>& out, int device) {
    for (const LoadedTensor& t : out) {
      const auto& want = expected_.at(t.info.name);
      ASSERT_EQ(t.nbytes, want.size()) << t.info.name;
      EXPECT_EQ(t.device, device);
      if (want.empty()) continue;
      EXPECT_EQ(DeviceOf(t.data), device) << t.info.name;
      EXPECT_EQ(ToHost(t.data, t.nbytes), want) << t.info.name;
    }
  }
};

TEST_F(DeviceLoaderTest, EveryDTypeBitExactBothHostPaths) {
  SKIP_WITHOUT_GPU();
  for (HostPath path : {HostPath::kStaging, HostPath::kRegister, HostPath::kRegisterWindows}) {
    for (PinnedAlloc pa : {PinnedAlloc::kHostRegister, PinnedAlloc::kHostAlloc}) {
      LoaderOptions o;
      o.io = IoMode::kPageCache;
      o.host_path = path;
      o.register_window_bytes = 64 << 10;  // many windows, each registered and released
      o.pinned_alloc = pa;
      o.verify = true;
      o.slot_bytes = 32 << 10;
      o.staging_bytes = 128 << 10;  // 4 slots: forces heavy slot reuse
      auto loader = Loader::Create(o);
      ASSERT_TRUE(loader.ok());
      int dev = -1;
      ASSERT_EQ(cudaGetDevice(&dev), cudaSuccess);
      auto out = (*loader)->Load(*reader_, {});
      ASSERT_TRUE(out.ok()) << out.status().ToString();
      EXPECT_EQ((*loader)->last_stats().used_register, path != HostPath::kStaging);
      ASSERT_EQ(out->size(), expected_.size());
      CheckAll(*out, dev);
    }
  }
}

// The first load from a mapping reads with pread (one-shot); the next one from the same
// reader copies from the mapping. Both bit-exact, with and without verification.
TEST_F(DeviceLoaderTest, OneShotThenRepeatedLoadBitExact) {
  SKIP_WITHOUT_GPU();
  for (bool verify : {false, true}) {
    LoaderOptions o;
    o.io = IoMode::kPageCache;
    o.verify = verify;
    o.slot_bytes = 32 << 10;
    o.staging_bytes = 128 << 10;
    auto loader = Loader::Create(o);
    ASSERT_TRUE(loader.ok());
    int dev = -1;
    ASSERT_EQ(cudaGetDevice(&dev), cudaSuccess);
    for (bool first : {true, false}) {
      auto out = (*loader)->Load(*reader_, {});
      ASSERT_TRUE(out.ok()) << out.status().ToString();
      EXPECT_EQ((*loader)->last_stats().used_pread, first);
      CheckAll(*out, dev);
    }
    // A new reader of the same file is a new mapping: one-shot again.
    auto again = Reader::Open(path_);
    ASSERT_TRUE(again.ok());
    ASSERT_TRUE((*loader)->Load(**again, {}).ok());
    EXPECT_TRUE((*loader)->last_stats().used_pread);
  }
}

TEST_F(DeviceLoaderTest, DirectIoBitExact) {
  SKIP_WITHOUT_GPU();
  LoaderOptions o;
  o.io = IoMode::kDirect;
  o.verify = true;
  o.slot_bytes = 32 << 10;
  o.staging_bytes = 128 << 10;
  auto loader = Loader::Create(o);
  ASSERT_TRUE(loader.ok());
  auto out = (*loader)->Load(*reader_, {});
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  if (!(*loader)->last_stats().used_direct_io) GTEST_SKIP() << "TMPDIR refuses O_DIRECT";
  int dev = -1;
  cudaGetDevice(&dev);
  CheckAll(*out, dev);
}

TEST_F(DeviceLoaderTest, StreamOrderingOnCallerStream) {
  SKIP_WITHOUT_GPU();
  cudaStream_t s;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  const auto& want = expected_.at("big");
  void* dst = nullptr;
  ASSERT_EQ(cudaMalloc(&dst, want.size()), cudaSuccess);
  // Slow work queued first on the caller's stream: if the load ignored the stream, the memset
  // of dst would land after (or race with) the loaded bytes.
  void* scratch = nullptr;
  const size_t scratch_bytes = size_t{1} << 30;
  ASSERT_EQ(cudaMalloc(&scratch, scratch_bytes), cudaSuccess);
  for (int i = 0; i < 8; ++i) ASSERT_EQ(cudaMemsetAsync(scratch, i, scratch_bytes, s), cudaSuccess);
  ASSERT_EQ(cudaMemsetAsync(dst, 0xAB, want.size(), s), cudaSuccess);
  auto loader = Loader::Create();
  ASSERT_TRUE(loader.ok());
  std::vector<LoadRequest> reqs(1);
  reqs[0].name = "big";
  reqs[0].dst = dst;
  reqs[0].dst_bytes = want.size();
  auto out = (*loader)->LoadAsync(*reader_, reqs, reinterpret_cast<Stream>(s));
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  std::vector<uint8_t> host(want.size());
  ASSERT_EQ(cudaMemcpyAsync(host.data(), dst, want.size(), cudaMemcpyDeviceToHost, s), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
  EXPECT_EQ(host, want);
  cudaFree(scratch);
  cudaFree(dst);
  cudaStreamDestroy(s);
}

// Streaming on a caller's stream held back by slow work queued first. kEnqueued: inside the
// callback a second stream waits on `ready` and copies the tensor back, which must already
// hold the loaded bytes. kComplete: the tensor is read on an unrelated stream without any
// wait, so the copies must be complete when it is handed over.
TEST_F(DeviceLoaderTest, StreamingOrderOnCallerStreamBitExact) {
  SKIP_WITHOUT_GPU();
  cudaStream_t s, other;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_EQ(cudaStreamCreateWithFlags(&other, cudaStreamNonBlocking), cudaSuccess);
  void* scratch = nullptr;
  const size_t scratch_bytes = size_t{1} << 30;
  ASSERT_EQ(cudaMalloc(&scratch, scratch_bytes), cudaSuccess);
  int dev = -1;
  ASSERT_EQ(cudaGetDevice(&dev), cudaSuccess);
  for (HandOver when : {HandOver::kEnqueued, HandOver::kComplete}) {
    for (int i = 0; i < 8; ++i) {
      ASSERT_EQ(cudaMemsetAsync(scratch, i, scratch_bytes, s), cudaSuccess);
    }
    LoaderOptions o;
    o.slot_bytes = 32 << 10;
    o.staging_bytes = 128 << 10;
    auto loader = Loader::Create(o);
    ASSERT_TRUE(loader.ok());
    std::map<std::string, std::vector<uint8_t>> got;
    std::vector<int> seen(reader_->num_tensors(), 0);
    auto on_ready = [&](const ReadyTensor& t) {
      ++seen.at(t.index);
      EXPECT_NE(t.ready, nullptr);
      EXPECT_EQ(t.tensor->device, dev);
      std::vector<uint8_t>& host = got[t.tensor->info.name];
      host.resize(t.tensor->nbytes);
      if (host.empty()) return;
      if (when == HandOver::kEnqueued) {
        EXPECT_EQ(cudaStreamWaitEvent(other, reinterpret_cast<cudaEvent_t>(t.ready), 0),
                  cudaSuccess);
      }
      EXPECT_EQ(
          cudaMemcpyAsync(host.data(), t.tensor->data, host.size(), cudaMemcpyDeviceToHost, other),
          cudaSuccess);
      if (when == HandOver::kComplete) EXPECT_EQ(cudaStreamSynchronize(other), cudaSuccess);
    };
    auto out = (*loader)->LoadStreaming(*reader_, {}, on_ready, when, reinterpret_cast<Stream>(s));
    ASSERT_TRUE(out.ok()) << out.status().ToString();
    ASSERT_EQ(cudaStreamSynchronize(other), cudaSuccess);
    EXPECT_EQ(seen, std::vector<int>(reader_->num_tensors(), 1));
    for (const auto& [name, want] : expected_) EXPECT_EQ(got[name], want) << name;
    ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
    CheckAll(*out, dev);
  }
  cudaFree(scratch);
  cudaStreamDestroy(other);
  cudaStreamDestroy(s);
}

TEST_F(DeviceLoaderTest, DefaultStreamAndAllocatedMemory) {
  SKIP_WITHOUT_GPU();
  auto loader = Loader::Create();
  ASSERT_TRUE(loader.ok());
  auto out = (*loader)->LoadAsync(*reader_, {}, nullptr);
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  // A plain cudaMemcpy on the legacy default stream orders after the enqueued load.
  int dev = -1;
  cudaGetDevice(&dev);
  CheckAll(*out, dev);
}

TEST_F(DeviceLoaderTest, LoadFromAnotherThread) {
  SKIP_WITHOUT_GPU();
  int count = 0;
  cudaGetDeviceCount(&count);
  int target = count - 1;
  Status status;
  std::vector<LoadedTensor> out;
  int device_after = -1;
  std::thread t([&] {
    cudaSetDevice(target);
    auto loader = Loader::Create();
    auto r = (*loader)->Load(*reader_, {});
    status = r.status();
    if (r.ok()) out = std::move(*r);
    cudaGetDevice(&device_after);
  });
  t.join();
  ASSERT_TRUE(status.ok()) << status.ToString();
  EXPECT_EQ(device_after, target);  // the caller's current device is unchanged
  int cur = -1;
  cudaGetDevice(&cur);
  cudaSetDevice(target);
  CheckAll(out, target);
  cudaSetDevice(cur);
}

TEST_F(DeviceLoaderTest, PartialRowsAndList) {
  SKIP_WITHOUT_GPU();
  auto loader = Loader::Create();
  ASSERT_TRUE(loader.ok());
  std::vector<LoadRequest> reqs(3);
  reqs[0].name = "big";
  reqs[0].row_begin = 10;
  reqs[0].row_end = 510;
  reqs[1].name = "big_zstd";
  reqs[1].row_begin = 999;
  reqs[2].name = "shuffle+zstd/F32";
  auto out = (*loader)->Load(*reader_, reqs);
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  ASSERT_EQ(out->size(), 3u);
  const uint64_t row = 777 * 2;
  const auto& big = expected_.at("big");
  EXPECT_EQ(ToHost((*out)[0].data, (*out)[0].nbytes),
            std::vector<uint8_t>(big.begin() + 10 * row, big.begin() + 510 * row));
  EXPECT_EQ((*out)[0].info.shape, (std::vector<int64_t>{500, 777}));
  const auto& bz = expected_.at("big_zstd");
  EXPECT_EQ(ToHost((*out)[1].data, (*out)[1].nbytes),
            std::vector<uint8_t>(bz.begin() + 999 * row, bz.end()));
  EXPECT_EQ(ToHost((*out)[2].data, (*out)[2].nbytes), expected_.at("shuffle+zstd/F32"));
}

TEST_F(DeviceLoaderTest, AllocatorCallbackServesEveryAllocation) {
  SKIP_WITHOUT_GPU();
  std::atomic<int> allocs{0}, frees{0};
  std::atomic<uint64_t> live{0};
  DeviceAllocator alloc;
  alloc.allocate = [&](uint64_t n, Stream s) -> void* {
    void* p = nullptr;
    if (cudaMallocAsync(&p, n, reinterpret_cast<cudaStream_t>(s)) != cudaSuccess) return nullptr;
    allocs++;
    live += n;
    return p;
  };
  alloc.deallocate = [&](void* p, uint64_t n, Stream s) {
    cudaFreeAsync(p, reinterpret_cast<cudaStream_t>(s));
    frees++;
    live -= n;
  };
  int nonempty = 0;
  for (const auto& [name, bytes] : expected_) nonempty += !bytes.empty();
  {
    auto loader = Loader::Create();
    auto out = (*loader)->Load(*reader_, {}, nullptr, &alloc);
    ASSERT_TRUE(out.ok()) << out.status().ToString();
    EXPECT_EQ(allocs.load(), nonempty);
    int dev = -1;
    cudaGetDevice(&dev);
    CheckAll(*out, dev);
  }
  EXPECT_EQ(frees.load(), nonempty);
  EXPECT_EQ(live.load(), 0u);
}

TEST_F(DeviceLoaderTest, LandsOnCurrentDeviceOnly) {
  SKIP_WITHOUT_GPU();
  int count = 0;
  cudaGetDeviceCount(&count);
  if (count < 2) GTEST_SKIP() << "needs two GPUs";
  int prev = -1;
  cudaGetDevice(&prev);
  cudaSetDevice(1);
  {
    auto loader = Loader::Create();
    auto out = (*loader)->Load(*reader_, {});
    ASSERT_TRUE(out.ok()) << out.status().ToString();
    int cur = -1;
    cudaGetDevice(&cur);
    EXPECT_EQ(cur, 1);
    CheckAll(*out, 1);
  }
  cudaSetDevice(prev);
}

TEST_F(DeviceLoaderTest, CorruptBlockIsDataLossOnDevice) {
  SKIP_WITHOUT_GPU();
  // Flip one byte of a raw tensor's data in a copy of the file.
  auto info = reader_->Find("big");
  ASSERT_TRUE(info.ok());
  std::string bad = dir_.File("bad.ferry");
  {
    FILE* in = std::fopen(path_.c_str(), "rb");
    FILE* out = std::fopen(bad.c_str(), "wb");
    std::vector<char> buf(1 << 20);
    size_t n;
    while ((n = std::fread(buf.data(), 1, buf.size(), in)) > 0) std::fwrite(buf.data(), 1, n, out);
    std::fclose(in);
    std::fseek(out, static_cast<long>(info->data_offset + 70000), SEEK_SET);
    std::fputc(0x5a ^ expected_["big"][70000], out);
    std::fclose(out);
  }
  auto r = Reader::Open(bad);
  ASSERT_TRUE(r.ok());
  for (HostPath path : {HostPath::kStaging, HostPath::kRegister, HostPath::kRegisterWindows}) {
    LoaderOptions o;
    o.verify = true;
    o.host_path = path;
    auto loader = Loader::Create(o);
    auto out = (*loader)->Load(**r, {});
    ASSERT_FALSE(out.ok());
    EXPECT_EQ(out.status().code(), StatusCode::kDataLoss);
    EXPECT_NE(out.status().message().find("'big'"), std::string::npos) << out.status().ToString();
    EXPECT_NE(out.status().message().find("block 1"), std::string::npos) << out.status().ToString();
  }
}

#endif  // FERRY_HAVE_CUDA

}  // namespace
}  // namespace ferry
