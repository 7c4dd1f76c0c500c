// Byte shuffle, zstd chunks and the streaming copy against simple references.
#include "codec/codec.hpp"

#include <gtest/gtest.h>

#include <cstring>

#include "test_util.hpp"

namespace ferry {
namespace {

using testing::RandomBytes;

TEST(CodecTest, ShufflePlanesMatchReferenceForEveryWidthAndSize) {
  for (size_t width : {1, 2, 4, 8}) {
    for (size_t n : {0,  1,  2,  3,   15,  16,  17,   31,   32,    33,
                     63, 64, 65, 127, 128, 129, 1000, 4099, 65536, 65537}) {
      std::vector<uint8_t> src = RandomBytes(n, n * 31 + width);
      std::vector<uint8_t> shuffled(n, 0xEE), back(n, 0xDD);
      Shuffle(src.data(), shuffled.data(), n, width);
      size_t count = n / width;
      for (size_t i = 0; i < count; ++i) {
        for (size_t k = 0; k < width; ++k) {
          ASSERT_EQ(shuffled[k * count + i], src[i * width + k])
              << "width " << width << " n " << n << " element " << i << " byte " << k;
        }
      }
      for (size_t i = count * width; i < n; ++i) ASSERT_EQ(shuffled[i], src[i]);
      Unshuffle(shuffled.data(), back.data(), n, width);
      ASSERT_EQ(back, src) << "width " << width << " n " << n;
    }
  }
}

// Ranges that start and end inside elements, around the 16-element steps of the SIMD
// transposes, and whole blocks: byte for byte what Unshuffle writes, nothing past the range.
TEST(CodecTest, UnshuffleRangeMatchesUnshuffleAtEveryCut) {
  for (size_t width : {2, 3, 4, 8}) {
    for (size_t n : {size_t{0}, size_t{1}, size_t{33}, size_t{1027}, size_t{65536} + 5}) {
      std::vector<uint8_t> src = RandomBytes(n, n * 7 + width);
      std::vector<uint8_t> shuffled(n), whole(n);
      Shuffle(src.data(), shuffled.data(), n, width);
      Unshuffle(shuffled.data(), whole.data(), n, width);
      std::vector<size_t> cuts = {0,
                                  1,
                                  width - 1,
                                  width,
                                  16 * width - 1,
                                  16 * width + 1,
                                  n / 2,
                                  n / 2 + 1,
                                  n - n % width,
                                  n - 1,
                                  n};
      for (size_t lo : cuts) {
        for (size_t hi : cuts) {
          if (lo > hi || hi > n) continue;
          std::vector<uint8_t> part(hi - lo + 8, 0xA5);
          UnshuffleRange(shuffled.data(), n, width, lo, hi, part.data());
          for (size_t i = 0; i < hi - lo; ++i) {
            ASSERT_EQ(part[i], whole[lo + i]) << "width " << width << " n " << n << " [" << lo
                                              << ", " << hi << ") byte " << lo + i;
          }
          for (size_t i = hi - lo; i < part.size(); ++i) ASSERT_EQ(part[i], 0xA5);
        }
      }
    }
  }
}

TEST(CodecTest, ShuffleWidths) {
  EXPECT_EQ(ShuffleWidth(DType::kBF16), 2u);
  EXPECT_EQ(ShuffleWidth(DType::kF32), 4u);
  EXPECT_EQ(ShuffleWidth(DType::kC64), 4u);
  EXPECT_EQ(ShuffleWidth(DType::kC128), 8u);
  EXPECT_EQ(ShuffleWidth(DType::kF8_E4M3FN), 1u);
  EXPECT_EQ(ShuffleWidth(DType::kF4_E2M1FN), 1u);
}

TEST(CodecTest, ZstdRoundTripAndExactSize) {
  std::vector<uint8_t> src(100000);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>(i % 7);
  std::vector<uint8_t> c(CompressBound(src.size()));
  auto n = ZstdCompress(src.data(), src.size(), c.data(), c.size(), 3);
  ASSERT_TRUE(n.ok());
  std::vector<uint8_t> out(src.size());
  ASSERT_TRUE(ZstdDecompressExact(c.data(), *n, out.data(), out.size()).ok());
  EXPECT_EQ(out, src);
  // A frame whose content is larger than the block it claims to fill: never written past.
  std::vector<uint8_t> small(src.size() - 1, 0x77);
  Status st = ZstdDecompressExact(c.data(), *n, small.data(), small.size());
  EXPECT_EQ(st.code(), StatusCode::kDataLoss);
  // Smaller than expected is an error too.
  std::vector<uint8_t> big(src.size() + 1);
  EXPECT_EQ(ZstdDecompressExact(c.data(), *n, big.data(), big.size()).code(),
            StatusCode::kDataLoss);
  // Garbage.
  std::vector<uint8_t> junk = RandomBytes(512, 5);
  EXPECT_EQ(ZstdDecompressExact(junk.data(), junk.size(), out.data(), out.size()).code(),
            StatusCode::kDataLoss);
}

TEST(CodecTest, StreamingCopyAnyAlignment) {
  std::vector<uint8_t> src = RandomBytes(1 << 20, 9);
  for (size_t off : {0, 1, 7, 16, 33}) {
    for (size_t n : {0, 5, 4095, 4096, 4097, 100000, (1 << 20) - 64}) {
      std::vector<uint8_t> dst(n + 64, 0);
      StreamingCopy(dst.data() + off % 16, src.data() + off, n);
      ASSERT_EQ(std::memcmp(dst.data() + off % 16, src.data() + off, n), 0) << off << " " << n;
    }
  }
}

TEST(CodecTest, ChecksumStreamingMatchesOneShot) {
  std::vector<uint8_t> data = RandomBytes(300000, 3);
  StreamingChecksum s;
  s.Update(data.data(), 1000);
  s.Update(data.data() + 1000, data.size() - 1000);
  EXPECT_EQ(s.Digest(), Checksum64(data.data(), data.size()));
  EXPECT_NE(Checksum64(data.data(), data.size() - 1), Checksum64(data.data(), data.size()));
}

}  // namespace
}  // namespace ferry
