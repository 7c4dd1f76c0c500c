// Round trips through the writer and reader on host memory.
#include <gtest/gtest.h>

#include <cstring>

#include "ferry/ferry.hpp"
#include "test_util.hpp"

namespace ferry {
namespace {

using testing::RandomBytes;
using testing::TempDir;

TEST(FormatTest, RoundTripEveryDTypeAndEncoding) {
  TempDir dir;
  for (Encoding enc : {Encoding::kRaw, Encoding::kZstd, Encoding::kShuffleZstd}) {
    std::string path = dir.File(std::string("all_") + EncodingName(enc) + ".ferry");
    std::vector<std::vector<uint8_t>> data;
    {
      auto w = Writer::Create(path);
      ASSERT_TRUE(w.ok()) << w.status().ToString();
      for (int d = 0; d < kNumDTypes; ++d) {
        auto dtype = static_cast<DType>(d);
        std::vector<int64_t> shape = {3, 5, 7};
        uint64_t n = *StorageBytes(dtype, 105);
        data.push_back(RandomBytes(n, d));
        ASSERT_TRUE(w->AddTensor(DTypeName(dtype), dtype, shape, data.back().data(), n, enc).ok());
      }
      ASSERT_TRUE(w->Commit().ok());
    }
    auto r = Reader::Open(path);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    ASSERT_EQ((*r)->num_tensors(), static_cast<size_t>(kNumDTypes));
    for (int d = 0; d < kNumDTypes; ++d) {
      auto dtype = static_cast<DType>(d);
      auto info = (*r)->Find(DTypeName(dtype));
      ASSERT_TRUE(info.ok());
      EXPECT_EQ(info->dtype, dtype);
      EXPECT_EQ(info->shape, (std::vector<int64_t>{3, 5, 7}));
      std::vector<uint8_t> out(info->nbytes);
      ASSERT_TRUE((*r)->ReadInto(DTypeName(dtype), out.data(), out.size(), {true}).ok());
      EXPECT_EQ(out, data[d]) << DTypeName(dtype);
    }
  }
}

TEST(FormatTest, Fp4PacksTwoPerByte) {
  EXPECT_EQ(*StorageBytes(DType::kF4_E2M1FN, 7), 4u);
  EXPECT_EQ(*StorageBytes(DType::kF4_E2M1FN, 8), 4u);
  EXPECT_EQ(*StorageBytes(DType::kBF16, 7), 14u);
}

}  // namespace
}  // namespace ferry
