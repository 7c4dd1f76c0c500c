// The PLANES decoder on a CUDA device against the CPU decoder: bit-exact output, corrupt units
// reported through the error values (never a device fault), stream ordering.
#include <cuda_runtime.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <map>

#include "base/util.hpp"
#include "codec/planes.hpp"
#include "codec/planes_cuda.hpp"
#include "ferry/ferry.hpp"
#include "ferry/loader.hpp"
#include "ferry_generated.h"
#include "format/block_source.hpp"
#include "load/loader_tuning.hpp"
#include "planes_data.hpp"
#include "test_util.hpp"

namespace ferry {
namespace {

using testing::Fp8Weights;
using testing::NormalWeights;
using testing::RandomBytes;
using testing::SprinkleSpecials;

constexpr size_t kUnit = planes::kStreamsPerUnit * planes::kSymbolsPerStream;

bool HaveDevice() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

#define SKIP_WITHOUT_DEVICE() \
  if (!HaveDevice()) GTEST_SKIP() << "no CUDA device"

#define CUDA_OK(call) ASSERT_EQ((call), cudaSuccess) << #call

struct Block {
  std::vector<uint8_t> raw, enc;
  planes::Layout layout;
};

Block Make(std::vector<uint8_t> raw, size_t width) {
  Block b;
  b.raw = std::move(raw);
  b.enc.resize(planes::Bound(b.raw.size()));
  std::vector<uint8_t> scratch(b.raw.size());
  size_t n = planes::Encode(b.raw.data(), b.raw.size(), width, b.enc.data(), scratch.data(), -1);
  b.enc.resize(n);
  EXPECT_TRUE(planes::Parse(b.enc.data(), n, b.raw.size(), &b.layout).ok());
  return b;
}

// Decodes blocks on the device (each source at a 256-byte aligned offset, destinations packed
// at `dst_shift` bytes past an aligned base); returns the outputs and error values.
void DeviceDecode(const std::vector<Block>& blocks, std::vector<std::vector<uint8_t>>* out,
                  std::vector<uint32_t>* errors, cudaStream_t stream = nullptr,
                  size_t dst_shift = 0) {
  size_t src_total = 0, dst_total = dst_shift;
  std::vector<size_t> so, doff;
  for (const Block& b : blocks) {
    so.push_back(src_total);
    src_total += (b.enc.size() + 255) / 256 * 256;
    doff.push_back(dst_total);
    dst_total += b.raw.size();
  }
  uint8_t *dsrc = nullptr, *ddst = nullptr;
  uint32_t* derr = nullptr;
  ASSERT_EQ(cudaMalloc(&dsrc, src_total + 1), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&ddst, dst_total + 1), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&derr, 4 * blocks.size() + 4), cudaSuccess);
  ASSERT_EQ(cudaMemset(ddst, 0xEE, dst_total + 1), cudaSuccess);
  ASSERT_EQ(cudaMemset(derr, 0, 4 * blocks.size() + 4), cudaSuccess);
  std::vector<planes::DeviceJob> jobs;
  for (size_t i = 0; i < blocks.size(); ++i) {
    ASSERT_EQ(cudaMemcpy(dsrc + so[i], blocks[i].enc.data(), blocks[i].enc.size(),
                         cudaMemcpyHostToDevice),
              cudaSuccess);
    jobs.push_back({dsrc + so[i], ddst + doff[i], blocks[i].layout});
  }
  Status st = planes::DecodeOnDevice(jobs.data(), static_cast<int>(jobs.size()), derr, stream);
  ASSERT_TRUE(st.ok()) << st.ToString();
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  errors->assign(blocks.size(), 0);
  ASSERT_EQ(cudaMemcpy(errors->data(), derr, 4 * blocks.size(), cudaMemcpyDeviceToHost),
            cudaSuccess);
  out->clear();
  for (size_t i = 0; i < blocks.size(); ++i) {
    std::vector<uint8_t> o(blocks[i].raw.size());
    ASSERT_EQ(cudaMemcpy(o.data(), ddst + doff[i], o.size(), cudaMemcpyDeviceToHost), cudaSuccess);
    out->push_back(std::move(o));
  }
  uint8_t guard = 0;
  ASSERT_EQ(cudaMemcpy(&guard, ddst + dst_total, 1, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(guard, 0xEE) << "decode wrote past the last block";
  cudaFree(dsrc);
  cudaFree(ddst);
  cudaFree(derr);
}

TEST(PlanesGpuTest, MatchesCpuDecodeForEveryWidthAndEdgeSize) {
  SKIP_WITHOUT_DEVICE();
  for (size_t width : {1, 2, 4, 8}) {
    const size_t u = kUnit * width;
    std::vector<Block> blocks;
    for (size_t n : {size_t{1}, width + 1, u - width, u - 1, u, u + 1, u + width, 9 * u + 5,
                     size_t{4} << 20}) {
      for (int kind = 0; kind < 3; ++kind) {
        std::vector<uint8_t> raw =
            kind == 0 ? NormalWeights(n, width, 0.02f, n + width) : RandomBytes(n, n * 7 + width);
        if (kind == 2) SprinkleSpecials(raw = NormalWeights(n, width, 1.0f, n), width);
        blocks.push_back(Make(std::move(raw), width));
      }
    }
    for (size_t shift : {size_t{0}, size_t{2}}) {  // aligned and unaligned destinations
      std::vector<std::vector<uint8_t>> out;
      std::vector<uint32_t> errors;
      DeviceDecode(blocks, &out, &errors, nullptr, shift);
      for (size_t i = 0; i < blocks.size(); ++i) {
        ASSERT_EQ(errors[i], 0u) << planes::DeviceErrorText(errors[i]) << " width " << width
                                 << " block " << i;
        std::vector<uint8_t> cpu(blocks[i].raw.size()), scratch(cpu.size());
        ASSERT_TRUE(
            planes::DecodeParsed(blocks[i].enc.data(), blocks[i].layout, cpu.data(), scratch.data())
                .ok());
        ASSERT_TRUE(cpu == blocks[i].raw);
        ASSERT_TRUE(out[i] == cpu) << "width " << width << " block " << i << " of "
                                   << blocks[i].raw.size() << " bytes, shift " << shift;
      }
    }
  }
}

TEST(PlanesGpuTest, CorruptUnitsAreReportedNotFaults) {
  SKIP_WITHOUT_DEVICE();
  const size_t n = size_t{4} << 20;
  Block good = Make(NormalWeights(n, 2, 0.02f, 3), 2);
  const planes::Layout& l = good.layout;
  uint32_t unit5;
  std::memcpy(&unit5, good.enc.data() + l.plane[1].offset + planes::kCodedUnitTableOffset + 20, 4);
  const size_t u5 = l.plane[1].offset + unit5;
  std::vector<Block> blocks;
  blocks.push_back(good);
  Block lengths = good;
  lengths.enc[u5 + 7] += 3;  // the unit's stream lengths no longer add up
  blocks.push_back(lengths);
  Block moved = good;
  moved.enc[u5 + 0] -= 1;  // a word moves from stream 0 to stream 1
  moved.enc[u5 + 1] += 1;
  blocks.push_back(moved);
  std::mt19937_64 rng(9);
  for (int r = 0; r < 24; ++r) {  // random bytes over the stream data
    Block c = good;
    for (int k = 0; k < 16; ++k) {
      size_t i = u5 + planes::kStreamsPerUnit + rng() % 1000;
      c.enc[i] = static_cast<uint8_t>(rng());
    }
    blocks.push_back(c);
  }
  Block maxed = good;  // every stream claims 255 words: reads stay inside the unit check
  std::memset(maxed.enc.data() + u5, 0xff, planes::kStreamsPerUnit);
  blocks.push_back(maxed);
  std::vector<std::vector<uint8_t>> out;
  std::vector<uint32_t> errors;
  DeviceDecode(blocks, &out, &errors);
  EXPECT_EQ(errors[0], 0u);
  EXPECT_TRUE(out[0] == good.raw);
  EXPECT_NE(errors[1], 0u);
  EXPECT_EQ(planes::DeviceErrorText(errors[1]).rfind("unit 5 of plane 1", 0), 0u)
      << planes::DeviceErrorText(errors[1]);
  EXPECT_NE(errors[2], 0u);
  EXPECT_EQ(errors[2] >> 8, 5u);
  for (size_t i = 3; i < blocks.size(); ++i) {
    // Either caught, or it decodes to what the CPU decoder makes of the same bytes (which the
    // block checksum then rejects).
    std::vector<uint8_t> cpu(n), scratch(n);
    Status st = planes::DecodeParsed(blocks[i].enc.data(), l, cpu.data(), scratch.data());
    EXPECT_EQ(st.ok(), errors[i] == 0)
        << i << " " << st.ToString() << " / " << planes::DeviceErrorText(errors[i]);
    if (st.ok() && errors[i] == 0) EXPECT_TRUE(cpu == out[i]) << i;
  }
  // The context is still healthy.
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

TEST(PlanesGpuTest, DecodeOnAStreamRunsAfterTheStreamsEarlierWork) {
  SKIP_WITHOUT_DEVICE();
  const size_t n = size_t{16} << 20;
  Block b = Make(NormalWeights(n, 2, 0.02f, 21), 2);
  cudaStream_t s;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  uint8_t *pinned = nullptr, *dsrc = nullptr, *ddst = nullptr;
  uint32_t* derr = nullptr;
  CUDA_OK(cudaHostAlloc(&pinned, b.enc.size(), cudaHostAllocDefault));
  std::memcpy(pinned, b.enc.data(), b.enc.size());
  CUDA_OK(cudaMalloc(&dsrc, b.enc.size()));
  CUDA_OK(cudaMalloc(&ddst, n));
  CUDA_OK(cudaMalloc(&derr, 4));
  CUDA_OK(cudaMemset(derr, 0, 4));
  CUDA_OK(cudaMemset(dsrc, 0xff, b.enc.size()));  // garbage until the copy lands
  CUDA_OK(cudaDeviceSynchronize());
  for (int round = 0; round < 3; ++round) {
    CUDA_OK(cudaMemsetAsync(ddst, 0, n, s));
    CUDA_OK(cudaMemcpyAsync(dsrc, pinned, b.enc.size(), cudaMemcpyHostToDevice, s));
    planes::DeviceJob job{dsrc, ddst, b.layout};
    ASSERT_TRUE(planes::DecodeOnDevice(&job, 1, derr, s).ok());
    std::vector<uint8_t> out(n);
    uint32_t err = 1;
    CUDA_OK(cudaMemcpyAsync(out.data(), ddst, n, cudaMemcpyDeviceToHost, s));
    CUDA_OK(cudaMemcpyAsync(&err, derr, 4, cudaMemcpyDeviceToHost, s));
    CUDA_OK(cudaStreamSynchronize(s));
    EXPECT_EQ(err, 0u) << planes::DeviceErrorText(err);
    EXPECT_TRUE(out == b.raw) << "round " << round;
    CUDA_OK(cudaMemsetAsync(dsrc, 0xff, b.enc.size(), s));
  }
  cudaFreeHost(pinned);
  cudaFree(dsrc);
  cudaFree(ddst);
  cudaFree(derr);
  cudaStreamDestroy(s);
}

// ---- through the loader: files written in PLANES, loaded onto the device -----------------

class PlanesLoadTest : public ::testing::Test {
 protected:
  void SetUp() override {
    path_ = dir_.File("planes.ferry");
    WriterOptions wo;
    wo.block_size = 1 << 20;
    auto w = Writer::Create(path_, wo);
    ASSERT_TRUE(w.ok());
    Add(*w, "a.bf16", DType::kBF16, {2560, 1000}, NormalWeights(5120000, 2, 0.02f, 1));
    Add(*w, "b.f32", DType::kF32, {300, 1000}, NormalWeights(1200000, 4, 0.02f, 2));
    Add(*w, "c.f16", DType::kF16, {70000}, NormalWeights(140000, 2, 0.02f, 3, true));
    Add(*w, "d.noise", DType::kBF16, {300000}, RandomBytes(600000, 4));  // stored raw
    Add(*w, "e.small", DType::kBF16, {10}, NormalWeights(20, 2, 0.02f, 5));
    ASSERT_TRUE(w->Commit().ok());
  }
  void Add(Writer& w, const std::string& name, DType dtype, std::vector<int64_t> shape,
           std::vector<uint8_t> bytes) {
    ASSERT_TRUE(
        w.AddTensor(name, dtype, shape, bytes.data(), bytes.size(), Encoding::kPlanes).ok());
    expected_[name] = std::move(bytes);
  }
  testing::TempDir dir_;
  std::string path_;
  std::map<std::string, std::vector<uint8_t>> expected_;
};

TEST_F(PlanesLoadTest, LoadsBitExactOnTheCallersStream) {
  SKIP_WITHOUT_DEVICE();
  auto r = Reader::Open(path_);
  ASSERT_TRUE(r.ok());
  cudaStream_t s;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  for (int round = 0; round < 3; ++round) {
    LoaderOptions o;
    o.verify = round == 2;  // verified loads decode on the host
    auto loader = Loader::Create(o);
    ASSERT_TRUE(loader.ok());
    auto out = (*loader)->Load(**r, {}, round == 0 ? nullptr : reinterpret_cast<Stream>(s));
    ASSERT_TRUE(out.ok()) << out.status().ToString();
    for (const LoadedTensor& t : *out) {
      const std::vector<uint8_t>& want = expected_.at(t.info.name);
      std::vector<uint8_t> got(t.nbytes);
      CUDA_OK(cudaMemcpy(got.data(), t.data, t.nbytes, cudaMemcpyDeviceToHost));
      EXPECT_TRUE(got == want) << t.info.name << " round " << round;
    }
  }
  cudaStreamDestroy(s);
}

TEST_F(PlanesLoadTest, CorruptUnitIsDataLossNamingTensorAndBlock) {
  SKIP_WITHOUT_DEVICE();
  uint64_t at = 0;
  {
    auto r = Reader::Open(path_);
    ASSERT_TRUE(r.ok());
    auto info = (*r)->Find("a.bf16");
    const fb::Tensor* t = BlocksOf(**r).at(info->index);
    const fb::Chunk* c = t->chunks()->Get(2);
    ASSERT_EQ(c->codec(), fb::ChunkCodec::PLANES);
    planes::Layout l;
    const uint8_t* block = BlocksOf(**r).mapping()->data() + info->data_offset + c->offset();
    ASSERT_TRUE(planes::Parse(block, c->stored_size(), 1 << 20, &l).ok());
    uint32_t unit3;
    std::memcpy(&unit3, block + l.plane[1].offset + planes::kCodedUnitTableOffset + 12, 4);
    at = info->data_offset + c->offset() + l.plane[1].offset + unit3 + 9;  // a stream length
  }
  int fd = ::open(path_.c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  uint8_t v;
  ASSERT_EQ(::pread(fd, &v, 1, static_cast<off_t>(at)), 1);
  v ^= 0x11;
  ASSERT_EQ(::pwrite(fd, &v, 1, static_cast<off_t>(at)), 1);
  ::close(fd);
  auto r = Reader::Open(path_);
  ASSERT_TRUE(r.ok());
  for (bool verify : {false, true}) {
    LoaderOptions o;
    o.verify = verify;
    auto loader = Loader::Create(o);
    auto out = (*loader)->Load(**r, {});
    ASSERT_FALSE(out.ok()) << verify;
    EXPECT_EQ(out.status().code(), StatusCode::kDataLoss);
    const std::string& m = out.status().message();
    EXPECT_NE(m.find("'a.bf16'"), std::string::npos) << m;
    EXPECT_NE(m.find("block 2 "), std::string::npos) << m;
    EXPECT_NE(m.find("unit 3 of plane 1"), std::string::npos) << m;
    EXPECT_NE(m.find("decoded on the GPU"), std::string::npos) << m;
    // The loader and the device are still usable.
    auto other = (*loader)->Load(**r, {{"b.f32"}});
    EXPECT_TRUE(other.ok()) << other.status().ToString();
  }
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

// Every tensor of `out` (device memory) against `expected`.
void ExpectLoaded(const std::vector<LoadedTensor>& out,
                  const std::map<std::string, std::vector<uint8_t>>& expected,
                  const std::string& what) {
  for (const LoadedTensor& t : out) {
    const std::vector<uint8_t>& want = expected.at(t.info.name);
    std::vector<uint8_t> got(t.nbytes);
    ASSERT_EQ(cudaMemcpy(got.data(), t.data, t.nbytes, cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_TRUE(got == want) << t.info.name << " " << what;
  }
}

// Decodes grouped over several slots per launch, device slots reused many times over within a
// load (1 MiB slots of a 2 MiB ring), with and without checksums checked on the device.
TEST_F(PlanesLoadTest, EveryGroupingLoadsBitExactOnTheGpu) {
  SKIP_WITHOUT_DEVICE();
  auto r = Reader::Open(path_);
  ASSERT_TRUE(r.ok());
  cudaStream_t s;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  struct Case {
    uint64_t slot, staging;
    int group, twins;
    bool each_group;
  };
  const uint64_t mib = 1 << 20;
  for (const Case& c : {Case{4 * mib, 64 * mib, 8, 2, false}, Case{mib, 2 * mib, 1, 1, false},
                        Case{mib, 2 * mib, 2, 1, true}, Case{mib, 2 * mib, 3, 2, false},
                        Case{mib, 3 * mib, 8, 1, true}}) {
    for (bool verify : {false, true}) {
      LoaderOptions o;
      o.slot_bytes = c.slot;
      o.staging_bytes = c.staging;
      o.verify = verify;
      auto loader = Loader::Create(o);
      ASSERT_TRUE(loader.ok());
      LoaderTuning t;
      t.planes_group = c.group;
      t.planes_twin_factor = c.twins;
      t.planes_verify_each_group = c.each_group;
      LoaderInternals::SetTuning(**loader, t);
      const std::string what =
          StrCat("slot ", c.slot, " group ", c.group, " twins ", c.twins, " verify ", verify);
      for (int round = 0; round < 3; ++round) {
        auto out = (*loader)->Load(**r, {}, reinterpret_cast<Stream>(s));
        ASSERT_TRUE(out.ok()) << out.status().ToString() << " " << what;
        EXPECT_GT(LoaderInternals::LastPhases(**loader).first_decode, 0) << what;
        ExpectLoaded(*out, expected_, what);
      }
    }
  }
  cudaStreamDestroy(s);
}

// A block whose stored bytes still decode, to other raw bytes than were saved (a byte of the
// raw mantissa plane changed): only the checksum tells. Verified loads check it on the device
// and report it as the host does; unverified loads hand out what the block holds.
TEST_F(PlanesLoadTest, BlockDecodingToOtherBytesFailsVerifiedLoadsOnly) {
  SKIP_WITHOUT_DEVICE();
  uint64_t at = 0;
  {
    auto r = Reader::Open(path_);
    ASSERT_TRUE(r.ok());
    auto info = (*r)->Find("a.bf16");
    const StoredBlock b = BlocksOf(**r).Block(info->index, 1);
    ASSERT_TRUE(b.planes);
    planes::Layout l;
    const uint8_t* block = BlocksOf(**r).mapping()->data() + b.file_offset;
    ASSERT_TRUE(planes::Parse(block, b.stored_size, b.raw_size, &l).ok());
    ASSERT_EQ(l.plane[0].mode, planes::kPlaneRaw);
    at = b.file_offset + l.plane[0].offset + 100;  // low byte of element 100 of block 1
  }
  ASSERT_TRUE(testing::XorFileByte(path_, at, 0x04));
  auto r = Reader::Open(path_);
  ASSERT_TRUE(r.ok());
  std::map<std::string, std::vector<uint8_t>> changed = expected_;
  changed["a.bf16"][(1 << 20) + 200] ^= 0x04;

  LoaderOptions host_options;
  host_options.verify = true;
  auto host_loader = Loader::Create(host_options);
  ASSERT_TRUE(host_loader.ok());
  auto host = (*host_loader)->LoadToHost(**r, {});
  ASSERT_FALSE(host.ok());
  const std::string want = host.status().message();
  EXPECT_NE(want.find("'a.bf16': checksum mismatch in block 1 "), std::string::npos) << want;

  for (int group : {1, 8}) {
    LoaderOptions o;
    o.verify = false;  // loads verify by default; this one shows what an opted-out load gets
    auto plain = Loader::Create(o);
    ASSERT_TRUE(plain.ok());
    o.verify = true;
    auto verified = Loader::Create(o);
    ASSERT_TRUE(verified.ok());
    LoaderTuning t;
    t.planes_group = group;
    LoaderInternals::SetTuning(**plain, t);
    LoaderInternals::SetTuning(**verified, t);
    auto out = (*plain)->Load(**r, {});
    ASSERT_TRUE(out.ok()) << out.status().ToString();
    ExpectLoaded(*out, changed, "unverified");
    auto bad = (*verified)->Load(**r, {});
    ASSERT_FALSE(bad.ok());
    EXPECT_EQ(bad.status().code(), StatusCode::kDataLoss);
    EXPECT_EQ(bad.status().message(), want) << "group " << group;
    EXPECT_GT(LoaderInternals::LastPhases(**verified).first_decode, 0);
    // The loader stays usable: other tensors load and verify.
    auto other = (*verified)->Load(**r, {{"b.f32"}, {"c.f16"}});
    ASSERT_TRUE(other.ok()) << other.status().ToString();
    ExpectLoaded(*other, expected_, "after the failure");
  }
  // Streaming loads decode on the host, where the same check fails the same way.
  LoaderOptions o;
  o.verify = true;
  auto streaming = Loader::Create(o);
  ASSERT_TRUE(streaming.ok());
  auto st = (*streaming)->LoadStreaming(**r, {}, [](const ReadyTensor&) {});
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.status().message(), want);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

// fp8 weights through PLANES onto the device, the GPU's output identical to the CPU decoder's.
TEST(PlanesFp8GpuTest, Fp8LoadsBitExactAndMatchTheCpuDecoder) {
  SKIP_WITHOUT_DEVICE();
  testing::TempDir dir;
  const std::string path = dir.File("fp8.ferry");
  std::map<std::string, std::vector<uint8_t>> expected;
  expected["e4m3"] = Fp8Weights((size_t{9} << 20) + 5, kE4M3FN, 1);
  expected["e5m2"] = Fp8Weights(size_t{6} << 20, kE5M2, 2);
  SprinkleSpecials(expected["e5m2"], 1);
  {
    auto w = Writer::Create(path);
    ASSERT_TRUE(w.ok());
    for (const auto& [name, bytes] : expected) {
      DType dtype = name == "e4m3" ? DType::kF8_E4M3FN : DType::kF8_E5M2;
      ASSERT_TRUE(w->AddTensor(name, dtype, {static_cast<int64_t>(bytes.size())}, bytes.data(),
                               bytes.size(), Encoding::kPlanes)
                      .ok());
    }
    ASSERT_TRUE(w->Commit().ok());
  }
  auto r = Reader::Open(path);
  ASSERT_TRUE(r.ok());
  for (bool verify : {false, true}) {
    LoaderOptions o;
    o.verify = verify;
    auto loader = Loader::Create(o);
    ASSERT_TRUE(loader.ok());
    auto out = (*loader)->Load(**r, {});
    ASSERT_TRUE(out.ok()) << out.status().ToString();
    EXPECT_GT(LoaderInternals::LastPhases(**loader).first_decode, 0);
    ExpectLoaded(*out, expected, verify ? "verified" : "unverified");
    auto host = (*loader)->LoadToHost(**r, {});
    ASSERT_TRUE(host.ok());
    for (const LoadedTensor& t : *host) {
      EXPECT_EQ(std::memcmp(t.data, expected.at(t.info.name).data(), t.nbytes), 0);
    }
  }
}

}  // namespace
}  // namespace ferry
