// Block checksums on a CUDA device (codec/checksum_cuda.hpp) against libxxhash: mixed batches at
// every alignment, the verifying form flagging exactly the corrupt blocks, argument checks, and
// blocks decoded from PLANES on the device and hashed on the same stream.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "codec/checksum_cuda.hpp"

#define XXH_INLINE_ALL
#include <xxhash.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <vector>

#include "codec/planes.hpp"
#include "codec/planes_cuda.hpp"
#include "planes_data.hpp"
#include "test_util.hpp"

namespace ferry {
namespace {

using testing::NormalWeights;
using testing::RandomBytes;

bool HaveDevice() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

#define SKIP_WITHOUT_DEVICE() \
  if (!HaveDevice()) GTEST_SKIP() << "no CUDA device"

#define CUDA_OK(call) ASSERT_EQ((call), cudaSuccess) << #call

template <typename T>
struct DeviceArray {
  T* p = nullptr;
  explicit DeviceArray(size_t n) {
    if (cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(T)) != cudaSuccess) p = nullptr;
  }
  ~DeviceArray() { cudaFree(p); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
};

// Cheap, varied contents for large inputs (mt19937 would dominate the test's time).
std::vector<uint8_t> FastBytes(size_t n, uint64_t seed) {
  std::vector<uint8_t> out(n);
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    std::memcpy(&out[i], &x, 8);
  }
  for (; i < n; ++i) out[i] = static_cast<uint8_t>(i * 131 + seed);
  return out;
}

// Host inputs copied into one device arena, each at its own alignment (offset within 16 bytes)
// with random gaps, or packed back to back when `packed`.
struct Batch {
  std::vector<std::vector<uint8_t>> host;
  std::vector<unsigned> align;
  std::vector<size_t> offset;
  uint8_t* arena = nullptr;
  size_t arena_bytes = 0;
  std::vector<DeviceBlock> blocks;

  ~Batch() { cudaFree(arena); }
  void Add(std::vector<uint8_t> bytes, unsigned a) {
    host.push_back(std::move(bytes));
    align.push_back(a);
  }
  // Copies to the device and fills `blocks` with the libxxhash sums as the expected values.
  void Upload(bool packed = false) {
    size_t at = 0;
    offset.clear();
    for (size_t i = 0; i < host.size(); ++i) {
      if (!packed) at = (at + 255) / 256 * 256 + align[i];
      offset.push_back(at);
      at += host[i].size();
    }
    arena_bytes = at;
    ASSERT_EQ(cudaMalloc(&arena, std::max<size_t>(arena_bytes, 1)), cudaSuccess);
    blocks.clear();
    for (size_t i = 0; i < host.size(); ++i) {
      if (!host[i].empty()) {
        ASSERT_EQ(
            cudaMemcpy(arena + offset[i], host[i].data(), host[i].size(), cudaMemcpyHostToDevice),
            cudaSuccess);
      }
      blocks.push_back(DeviceBlock{arena + offset[i], host[i].size(),
                                   XXH3_64bits(host[i].data(), host[i].size())});
    }
  }
};

// The device sums of `b`, checked against the expected ones.
void ExpectDeviceSums(const Batch& b, cudaStream_t stream = nullptr) {
  const size_t n = b.blocks.size();
  DeviceArray<uint64_t> sums(n);
  ASSERT_NE(sums.p, nullptr);
  CUDA_OK(cudaMemset(sums.p, 0, std::max<size_t>(n, 1) * 8));
  Status st = ChecksumOnDevice(b.blocks.data(), static_cast<int>(n), sums.p, stream);
  ASSERT_TRUE(st.ok()) << st.ToString();
  CUDA_OK(cudaStreamSynchronize(stream));
  std::vector<uint64_t> got(n);
  CUDA_OK(cudaMemcpy(got.data(), sums.p, n * 8, cudaMemcpyDeviceToHost));
  for (size_t i = 0; i < n; ++i) {
    ASSERT_EQ(got[i], b.blocks[i].expected)
        << "block " << i << " of " << b.blocks[i].size << " bytes at alignment " << b.align[i];
  }
}

TEST(ChecksumGpuTest, MixedBatchesMatchLibxxhash) {
  SKIP_WITHOUT_DEVICE();
  const size_t kMiB = size_t{1} << 20;
  for (uint64_t seed : {1, 2, 3}) {
    std::mt19937_64 rng(seed);
    Batch b;
    for (int i = 0; i < 400; ++i) {
      size_t len;
      switch (rng() % 8) {
        case 0:
          len = rng() % 17;
          break;
        case 1:
          len = 17 + rng() % 224;
          break;
        case 2:
          len = 241 + rng() % 2048;
          break;
        case 3:
          len = rng() % (64 * 1024 + 2048);
          break;
        case 4:
          len = rng() % (512 * 1024);
          break;
        case 5:
          len = 4 * kMiB - 1 + rng() % 3;
          break;
        case 6:
          len = 64 * 1024 * (1 + rng() % 8) - 1 + rng() % 3;
          break;
        default:
          len = rng() % (4 * kMiB);
          break;
      }
      b.Add(FastBytes(len, rng()), static_cast<unsigned>(rng() % 16));
    }
    b.Upload();
    ExpectDeviceSums(b);
  }
}

// Every length up to 2048 in one call (more blocks than one launch carries), and the same
// lengths packed back to back, so that no block starts aligned by accident.
TEST(ChecksumGpuTest, EveryShortLengthInOneCall) {
  SKIP_WITHOUT_DEVICE();
  for (bool packed : {false, true}) {
    Batch b;
    for (size_t len = 0; len <= 2048; ++len) {
      b.Add(RandomBytes(len, len + 7), static_cast<unsigned>(len % 16));
    }
    b.Upload(packed);
    ExpectDeviceSums(b);
  }
}

// The load paths by alignment (16, 8, and the four shifted ones) with lengths whose last full
// KiB ends near the input's end, where the shifted loads switch to bytes.
TEST(ChecksumGpuTest, EveryAlignmentAndEdgeLength) {
  SKIP_WITHOUT_DEVICE();
  Batch b;
  for (size_t base : {size_t{1024}, size_t{65536}, size_t{65536} + 1024, size_t{4} << 20}) {
    for (long d : {-17, -16, -15, -1, 0, 1, 15, 16, 17, 63, 64, 65}) {
      for (unsigned a = 0; a < 16; ++a) {
        const size_t len = static_cast<size_t>(static_cast<long>(base) + d);
        b.Add(FastBytes(len, len * 16 + a), a);
      }
    }
  }
  b.Upload();
  ExpectDeviceSums(b);
}

TEST(ChecksumGpuTest, OneGibibyteBlockAtOddAddress) {
  SKIP_WITHOUT_DEVICE();
  Batch b;
  b.Add(FastBytes((size_t{1} << 30) + 7, 99), 5);
  b.Add(FastBytes(300, 98), 0);
  b.Upload();
  ExpectDeviceSums(b);
}

TEST(ChecksumGpuTest, VerifyFlagsExactlyTheCorruptBlocks) {
  SKIP_WITHOUT_DEVICE();
  std::mt19937_64 rng(17);
  Batch b;
  for (int i = 0; i < 300; ++i) {
    const size_t len = i % 3 == 0 ? rng() % 300 : (i % 3 == 1 ? rng() % 100000 : 4194304 - i);
    b.Add(FastBytes(len, rng()), static_cast<unsigned>(rng() % 16));
  }
  b.Upload();
  const size_t n = b.blocks.size();
  // Corrupt some blocks on the device: one byte flipped at the start, the end or inside.
  std::vector<bool> corrupt(n, false);
  for (size_t i = 0; i < n; ++i) {
    if (b.blocks[i].size == 0 || rng() % 5 != 0) continue;
    const size_t len = b.blocks[i].size;
    const size_t at = i % 3 == 0 ? 0 : (i % 3 == 1 ? len - 1 : rng() % len);
    uint8_t v = static_cast<uint8_t>(b.host[i][at] ^ (1u << (rng() % 8)));
    CUDA_OK(cudaMemcpy(b.arena + b.offset[i] + at, &v, 1, cudaMemcpyHostToDevice));
    corrupt[i] = true;
  }
  // An expected sum that is wrong for intact bytes counts as a mismatch too.
  b.blocks[1].expected ^= 1;
  corrupt[1] = true;
  // Earlier errors stay as they were, on a corrupt block and on one that may be intact.
  if (!corrupt[5]) {
    uint8_t v = static_cast<uint8_t>(b.host[5][0] ^ 1);
    CUDA_OK(cudaMemcpy(b.arena + b.offset[5], &v, 1, cudaMemcpyHostToDevice));
    corrupt[5] = true;
  }
  std::vector<uint32_t> before(n, 0);
  before[2] = 7;
  before[5] = 9;
  DeviceArray<uint32_t> flags(n);
  ASSERT_NE(flags.p, nullptr);
  CUDA_OK(cudaMemcpy(flags.p, before.data(), n * 4, cudaMemcpyHostToDevice));
  Status st = VerifyOnDevice(b.blocks.data(), static_cast<int>(n), flags.p, nullptr);
  ASSERT_TRUE(st.ok()) << st.ToString();
  std::vector<uint32_t> got(n);
  CUDA_OK(cudaMemcpy(got.data(), flags.p, n * 4, cudaMemcpyDeviceToHost));
  size_t flagged = 0;
  for (size_t i = 0; i < n; ++i) {
    const uint32_t want = before[i] != 0 ? before[i] : (corrupt[i] ? kChecksumMismatch : 0u);
    ASSERT_EQ(got[i], want) << "block " << i << " of " << b.blocks[i].size << " bytes";
    flagged += got[i] == kChecksumMismatch;
  }
  EXPECT_GT(flagged, 20u);
}

TEST(ChecksumGpuTest, EmptyBatchAndBadArguments) {
  SKIP_WITHOUT_DEVICE();
  DeviceArray<uint64_t> sums(4);
  DeviceArray<uint32_t> flags(4);
  const uint64_t sentinel = 0x0123456789ABCDEFull;
  CUDA_OK(cudaMemcpy(sums.p, &sentinel, 8, cudaMemcpyHostToDevice));
  EXPECT_TRUE(ChecksumOnDevice(nullptr, 0, sums.p, nullptr).ok());
  EXPECT_TRUE(VerifyOnDevice(nullptr, 0, flags.p, nullptr).ok());
  CUDA_OK(cudaDeviceSynchronize());
  uint64_t after = 0;
  CUDA_OK(cudaMemcpy(&after, sums.p, 8, cudaMemcpyDeviceToHost));
  EXPECT_EQ(after, sentinel);

  DeviceBlock empty;  // no data, no bytes: the sum of the empty input
  ASSERT_TRUE(ChecksumOnDevice(&empty, 1, sums.p, nullptr).ok());
  CUDA_OK(cudaMemcpy(&after, sums.p, 8, cudaMemcpyDeviceToHost));
  EXPECT_EQ(after, XXH3_64bits(nullptr, 0));

  Status st = ChecksumOnDevice(&empty, -1, sums.p, nullptr);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(st.message(), "device checksum: negative block count -1");
  st = ChecksumOnDevice(&empty, 1, nullptr, nullptr);
  EXPECT_EQ(st.message(), "device checksum: null output array for 1 blocks");
  st = VerifyOnDevice(nullptr, 2, flags.p, nullptr);
  EXPECT_EQ(st.message(), "device checksum verify: null block array for 2 blocks");
  DeviceBlock blocks[2] = {empty, DeviceBlock{nullptr, 5, 0}};
  st = VerifyOnDevice(blocks, 2, flags.p, nullptr);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(st.message(), "device checksum verify: block 1 of 5 bytes has no data pointer");
}

// The forms that read their descriptors from device memory: any number of blocks in one launch,
// and a null data pointer with a nonzero size flagged instead of read.
TEST(ChecksumGpuTest, DeviceTablesOfAnySize) {
  SKIP_WITHOUT_DEVICE();
  std::mt19937_64 rng(23);
  Batch b;
  for (int i = 0; i < 1500; ++i) {
    const size_t len = i % 10 == 0 ? (size_t{4} << 20) - i : rng() % 5000;
    b.Add(FastBytes(len, rng()), static_cast<unsigned>(rng() % 16));
  }
  b.Upload();
  const size_t n = b.blocks.size();
  std::vector<DeviceBlock> blocks = b.blocks;
  blocks[7] = DeviceBlock{nullptr, 100, 5};
  DeviceArray<DeviceBlock> table(n);
  DeviceArray<uint64_t> sums(n);
  DeviceArray<uint32_t> flags(n);
  CUDA_OK(cudaMemcpy(table.p, blocks.data(), n * sizeof(DeviceBlock), cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemset(flags.p, 0, n * 4));
  ASSERT_TRUE(ChecksumTableOnDevice(table.p, static_cast<int>(n), sums.p, nullptr).ok());
  ASSERT_TRUE(VerifyTableOnDevice(table.p, static_cast<int>(n), flags.p, nullptr).ok());
  std::vector<uint64_t> got(n);
  std::vector<uint32_t> flagged(n);
  CUDA_OK(cudaMemcpy(got.data(), sums.p, n * 8, cudaMemcpyDeviceToHost));
  CUDA_OK(cudaMemcpy(flagged.data(), flags.p, n * 4, cudaMemcpyDeviceToHost));
  for (size_t i = 0; i < n; ++i) {
    ASSERT_EQ(got[i], i == 7 ? ~uint64_t{5} : blocks[i].expected) << "block " << i;
    ASSERT_EQ(flagged[i], i == 7 ? kChecksumMismatch : 0u) << "block " << i;
  }
  EXPECT_TRUE(ChecksumTableOnDevice(nullptr, 0, nullptr, nullptr).ok());
  EXPECT_EQ(VerifyTableOnDevice(table.p, 1, nullptr, nullptr).message(),
            "device checksum verify: null output array for 1 blocks");
}

// The use the loader makes of it: PLANES blocks decoded on the device, hashed right after the
// decode on the same stream, against the checksums of the raw bytes.
TEST(ChecksumGpuTest, HashesPlanesBlocksDecodedOnTheSameStream) {
  SKIP_WITHOUT_DEVICE();
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const size_t kBlock = size_t{4} << 20;
  std::vector<std::vector<uint8_t>> raw, enc;
  std::vector<planes::Layout> layouts;
  for (size_t i = 0; i < 6; ++i) {
    const size_t n = i == 5 ? 12345 : kBlock;
    raw.push_back(NormalWeights(n, 2, 0.02f, i + 1));
    std::vector<uint8_t> e(planes::Bound(n)), scratch(n);
    e.resize(planes::Encode(raw[i].data(), n, 2, e.data(), scratch.data(), -1));
    planes::Layout l;
    ASSERT_TRUE(planes::Parse(e.data(), e.size(), n, &l).ok());
    enc.push_back(std::move(e));
    layouts.push_back(l);
  }
  size_t src_total = 0, dst_total = 3;  // destinations packed from an odd offset
  std::vector<size_t> so, doff;
  for (size_t i = 0; i < raw.size(); ++i) {
    so.push_back(src_total);
    src_total += (enc[i].size() + 255) / 256 * 256;
    doff.push_back(dst_total);
    dst_total += raw[i].size();
  }
  DeviceArray<uint8_t> src(src_total), dst(dst_total);
  DeviceArray<uint32_t> errors(raw.size());
  DeviceArray<uint64_t> sums(raw.size());
  CUDA_OK(cudaMemset(dst.p, 0xEE, dst_total));
  CUDA_OK(cudaMemset(errors.p, 0, 4 * raw.size()));
  std::vector<planes::DeviceJob> jobs;
  std::vector<DeviceBlock> blocks;
  for (size_t i = 0; i < raw.size(); ++i) {
    CUDA_OK(cudaMemcpy(src.p + so[i], enc[i].data(), enc[i].size(), cudaMemcpyHostToDevice));
    jobs.push_back({src.p + so[i], dst.p + doff[i], layouts[i]});
    blocks.push_back({dst.p + doff[i], raw[i].size(), XXH3_64bits(raw[i].data(), raw[i].size())});
  }
  CUDA_OK(cudaDeviceSynchronize());
  ASSERT_TRUE(
      planes::DecodeOnDevice(jobs.data(), static_cast<int>(jobs.size()), errors.p, stream).ok());
  ASSERT_TRUE(
      ChecksumOnDevice(blocks.data(), static_cast<int>(blocks.size()), sums.p, stream).ok());
  ASSERT_TRUE(
      VerifyOnDevice(blocks.data(), static_cast<int>(blocks.size()), errors.p, stream).ok());
  CUDA_OK(cudaStreamSynchronize(stream));
  std::vector<uint64_t> got(raw.size());
  std::vector<uint32_t> err(raw.size());
  CUDA_OK(cudaMemcpy(got.data(), sums.p, 8 * got.size(), cudaMemcpyDeviceToHost));
  CUDA_OK(cudaMemcpy(err.data(), errors.p, 4 * err.size(), cudaMemcpyDeviceToHost));
  for (size_t i = 0; i < raw.size(); ++i) {
    EXPECT_EQ(got[i], blocks[i].expected) << "block " << i;
    EXPECT_EQ(err[i], 0u) << "block " << i;
  }
  CUDA_OK(cudaStreamDestroy(stream));
}

}  // namespace
}  // namespace ferry
