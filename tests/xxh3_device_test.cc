// The host instantiation of the device XXH3-64 (codec/xxh3_device.cuh) against libxxhash, for
// every length class and boundary, and the device kernel's order of work (stripe blocks summed
// apart, loads chosen by alignment) replayed on the host for every alignment. Under
// AddressSanitizer the bytes around each input are poisoned, so a load outside it fails.
#include "codec/xxh3_device.cuh"

#include <gtest/gtest.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include <cstring>
#include <memory>
#include <random>
#include <vector>

#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define FERRY_TEST_ASAN 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__)
#define FERRY_TEST_ASAN 1
#endif
#ifdef FERRY_TEST_ASAN
#include <sanitizer/asan_interface.h>
#endif

#include "test_util.hpp"

namespace ferry {
namespace {

using testing::RandomBytes;

const uint64_t* Sw() { return xxh3::kSecret.w; }

// A copy of `len` bytes starting `align` bytes past a 64-byte boundary (random bytes, or the
// first `len` of `from`); under ASan every other byte of the allocation is poisoned.
class Placed {
 public:
  Placed(size_t len, unsigned align, uint64_t seed) : Placed(len, align, RandomBytes(len, seed)) {}
  Placed(size_t len, unsigned align, const std::vector<uint8_t>& from) : len_(len) {
    buf_.resize(len + align + 128);
    uintptr_t base = reinterpret_cast<uintptr_t>(buf_.data());
    uintptr_t start = ((base + 63) & ~uintptr_t{63}) + align;
    p_ = reinterpret_cast<uint8_t*>(start);
    if (len > 0) std::memcpy(p_, from.data(), len);
#ifdef FERRY_TEST_ASAN
    ASAN_POISON_MEMORY_REGION(buf_.data(), buf_.size());
    ASAN_UNPOISON_MEMORY_REGION(p_, len);
#endif
  }
  ~Placed() {
#ifdef FERRY_TEST_ASAN
    ASAN_UNPOISON_MEMORY_REGION(buf_.data(), buf_.size());
#endif
  }
  Placed(const Placed&) = delete;
  Placed& operator=(const Placed&) = delete;
  uint8_t* data() const { return p_; }
  size_t size() const { return len_; }

 private:
  std::vector<uint8_t> buf_;
  uint8_t* p_ = nullptr;
  size_t len_;
};

// The device kernel's schedule for one input, run on the host thread after thread: in each
// round every loader thread, then every chain thread, or the chain first (both orders must give
// the same result, which they do only if the two never touch the same half of the exchange).
// The exchange starts out as garbage, so a read of anything not written in time shows.
template <int kMode>
uint64_t KernelOrder(const uint8_t* p, uint64_t len, bool chain_first) {
  if (len <= xxh3::kMidSizeMax) return xxh3::Hash64(p, len, Sw());
  auto x = std::make_unique<xxh3::Exchange>();
  std::memset(x.get(), 0xA5, sizeof(*x));
  uint64_t acc[8];
  for (int i = 0; i < 8; ++i) acc[i] = xxh3::InitLane(i);
  for (uint64_t it = 0; it <= xxh3::Chunks(len); ++it) {
    auto loaders = [&] {
      for (int t = 0; t < xxh3::kLoaderThreads; ++t) {
        xxh3::LoaderRound<kMode>(p, len, it, t, Sw(), *x);
      }
    };
    auto chain = [&] {
      for (int i = 0; i < 8; ++i) acc[i] = xxh3::ChainRound(acc[i], len, it, i, Sw()[16 + i], *x);
    };
    if (chain_first) {
      chain();
      loaders();
    } else {
      loaders();
      chain();
    }
  }
  for (int i = 0; i < 8; ++i) acc[i] = xxh3::ChainFinish(acc[i], i, *x);
  return xxh3::Merge(acc, len, Sw());
}

uint64_t KernelOrder(const uint8_t* p, uint64_t len) {
  const bool chain_first = len & 1;
  switch (xxh3::LoadModeOf(p)) {
    case xxh3::kAligned16:
      return KernelOrder<xxh3::kAligned16>(p, len, chain_first);
    case xxh3::kAligned8:
      return KernelOrder<xxh3::kAligned8>(p, len, chain_first);
    case 0:
      return KernelOrder<0>(p, len, chain_first);
    case 1:
      return KernelOrder<1>(p, len, chain_first);
    case 2:
      return KernelOrder<2>(p, len, chain_first);
    default:
      return KernelOrder<3>(p, len, chain_first);
  }
}

TEST(Xxh3DeviceTest, SecretIsLibxxhashDefault) {
  ASSERT_EQ(sizeof(xxh3::kSecret), sizeof(XXH3_kSecret));
  EXPECT_EQ(std::memcmp(xxh3::kSecret.w, XXH3_kSecret, sizeof(XXH3_kSecret)), 0);
  for (unsigned off = 0; off <= 184; ++off) {
    uint64_t want;
    std::memcpy(&want, XXH3_kSecret + off, 8);
    ASSERT_EQ(xxh3::SecretAt(Sw(), off), want) << "offset " << off;
  }
}

TEST(Xxh3DeviceTest, EveryLengthUpTo2048) {
  for (uint64_t seed : {1, 2, 3}) {
    for (size_t len = 0; len <= 2048; ++len) {
      Placed in(len, static_cast<unsigned>(len % 16), seed * 100003 + len);
      const uint64_t want = XXH3_64bits(in.data(), len);
      ASSERT_EQ(xxh3::Hash64(in.data(), len, Sw()), want) << "len " << len << " seed " << seed;
      ASSERT_EQ(KernelOrder(in.data(), len), want) << "len " << len << " seed " << seed;
    }
  }
}

// Every byte counts: changing any one byte of inputs at the class boundaries changes the hash
// the same way libxxhash's does.
TEST(Xxh3DeviceTest, EveryByteOfBoundaryLengthsCounts) {
  for (size_t len : {1, 3, 4, 8, 9, 16, 17, 128, 129, 240, 241, 1024, 1025, 1088, 1089}) {
    std::vector<uint8_t> in = RandomBytes(len, len);
    for (size_t i = 0; i < len; ++i) {
      in[i] ^= 0x5A;
      ASSERT_EQ(xxh3::Hash64(in.data(), len, Sw()), XXH3_64bits(in.data(), len))
          << "len " << len << " byte " << i;
      in[i] ^= 0x5A;
    }
  }
}

// Lengths around the boundaries of stripes (64), stripe blocks (1024), the kernel's chunks of
// 64 stripe blocks (64 KiB) and the format's 4 MiB blocks, at every alignment.
TEST(Xxh3DeviceTest, BoundaryLengthsAtEveryAlignment) {
  std::vector<size_t> lens;
  const size_t kMiB = size_t{1} << 20;
  for (size_t b : {size_t{1024}, size_t{1024} * 2, size_t{1024} * 16, size_t{1024} * 17,
                   size_t{65536}, size_t{65536} + 1024, size_t{65536} * 2, size_t{65536} * 3 + 64,
                   kMiB, 4 * kMiB, 4 * kMiB + 65536}) {
    for (long d : {-65, -64, -63, -17, -16, -15, -1, 0, 1, 15, 16, 17, 63, 64, 65}) {
      lens.push_back(static_cast<size_t>(static_cast<long>(b) + d));
    }
  }
  const std::vector<uint8_t> bytes = RandomBytes(4 * kMiB + 65536 + 65, 7);
  for (size_t len : lens) {
    for (unsigned align = 0; align < 16; ++align) {
      Placed in(len, align, bytes);
      const uint64_t want = XXH3_64bits(in.data(), len);
      ASSERT_EQ(KernelOrder(in.data(), len), want) << "len " << len << " align " << align;
      if (align == 0) ASSERT_EQ(xxh3::Hash64(in.data(), len, Sw()), want) << "len " << len;
    }
  }
}

TEST(Xxh3DeviceTest, RandomLengthsUpTo9MiB) {
  for (uint64_t seed : {11, 12, 13, 14}) {
    std::mt19937_64 rng(seed);
    for (int i = 0; i < 12; ++i) {
      const size_t len = rng() % (size_t{9} << 20);
      const unsigned align = static_cast<unsigned>(rng() % 16);
      Placed in(len, align, rng());
      const uint64_t want = XXH3_64bits(in.data(), len);
      ASSERT_EQ(xxh3::Hash64(in.data(), len, Sw()), want) << "len " << len << " seed " << seed;
      ASSERT_EQ(KernelOrder(in.data(), len), want) << "len " << len << " align " << align;
    }
  }
}

// Inputs that are all zeros or all ones: products of zero halves, carries through every lane.
TEST(Xxh3DeviceTest, ConstantInputs) {
  for (uint8_t fill : {uint8_t{0}, uint8_t{0xFF}}) {
    for (size_t len : {size_t{0}, size_t{7}, size_t{100}, size_t{200}, size_t{4} << 20}) {
      std::vector<uint8_t> in(len, fill);
      const uint64_t want = XXH3_64bits(in.data(), len);
      EXPECT_EQ(xxh3::Hash64(in.data(), len, Sw()), want) << "len " << len;
      EXPECT_EQ(KernelOrder(in.data(), len), want) << "len " << len;
    }
  }
}

}  // namespace
}  // namespace ferry
