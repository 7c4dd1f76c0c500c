// The PLANES decoder on a CUDA device against the CPU decoder: bit-exact output, corrupt units
// reported through the error values (never a device fault), stream ordering.
#include <cuda_runtime.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <map>

#include "format/block_source.hpp"
#include "ferry/ferry.hpp"
#include "ferry/loader.hpp"
#include "ferry_generated.h"
#include "codec/planes.hpp"
#include "codec/planes_cuda.hpp"
#include "planes_data.hpp"
#include "test_util.hpp"

namespace ferry {
namespace {

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
    if (!verify) EXPECT_NE(m.find("decoded on the GPU"), std::string::npos) << m;
    // The loader and the device are still usable.
    auto other = (*loader)->Load(**r, {{"b.f32"}});
    EXPECT_TRUE(other.ok()) << other.status().ToString();
  }
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

}  // namespace
}  // namespace ferry
