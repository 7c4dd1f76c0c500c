// Replays the fuzz targets' inputs through the same entry points (tests/fuzz/fuzz_entries.hpp):
// every committed seed must load cleanly, and every input a fuzzer ever found (a crash, a
// sanitizer report, a hang) must now be answered with a clean Status. Runs in the normal
// suite, so a regression shows up without a fuzzing build.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "fuzz/fuzz_entries.hpp"
#include "fuzz/fuzz_hostile_entries.hpp"

namespace ferry {
namespace {

namespace fs = std::filesystem;

const fs::path kFuzzDir = fs::path(FERRY_TEST_DATA_DIR) / ".." / "fuzz";

using Entry = Status (*)(const uint8_t*, size_t);

struct Target {
  const char* name;
  Entry entry;
};

const Target kTargets[] = {
    {"footer", fuzz::FuzzFooter},        {"load", fuzz::FuzzLoad},
    {"chunk", fuzz::FuzzChunk},          {"safetensors", fuzz::FuzzSafetensors},
    {"unpickle", fuzz::FuzzUnpickle},    {"index", fuzz::FuzzIndex},
    {"fp8_json", fuzz::FuzzFp8Json},     {"describe", fuzz::FuzzDescribe},
    {"c_strings", fuzz::FuzzCStrings},   {"planes", fuzz::FuzzPlanes},
    {"torch_walk", fuzz::FuzzTorchWalk}, {"dcp", fuzz::FuzzDcp},
};

std::vector<fs::path> Inputs(const fs::path& dir) {
  std::vector<fs::path> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    if (e.is_regular_file() && e.path().filename().string()[0] != '.' &&
        e.path().extension() != ".md") {
      out.push_back(e.path());
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<uint8_t> ReadFile(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(in), {});
}

class FuzzRegressionTest : public ::testing::TestWithParam<Target> {};

// The seeds are valid files: anything but OK means an entry point or the corpus went stale.
TEST_P(FuzzRegressionTest, SeedsLoadCleanly) {
  auto inputs = Inputs(kFuzzDir / "corpus" / GetParam().name);
  EXPECT_FALSE(inputs.empty()) << "no seeds under " << (kFuzzDir / "corpus" / GetParam().name);
  for (const fs::path& p : inputs) {
    auto bytes = ReadFile(p);
    Status st = GetParam().entry(bytes.data(), bytes.size());
    EXPECT_TRUE(st.ok()) << p << ": " << st.ToString();
  }
}

// Found inputs may be rejected; the entry aborts on a crash-worthy answer (fuzz::Clean).
TEST_P(FuzzRegressionTest, FoundInputsAreAnsweredCleanly) {
  for (const fs::path& p : Inputs(kFuzzDir / "regressions" / GetParam().name)) {
    SCOPED_TRACE(p.string());
    auto bytes = ReadFile(p);
    Status st = GetParam().entry(bytes.data(), bytes.size());
    EXPECT_NE(st.code(), StatusCode::kInternal) << st.ToString();
  }
}

// Found while writing the seed corpus under UBSan: an empty block handed to the shuffle with
// null pointers reached memcpy(nullptr, nullptr, 0), which is undefined.
TEST(FuzzFindingsTest, EmptyShuffleTouchesNoPointer) {
  for (size_t width : {0, 1, 2, 3, 4, 8}) {
    Shuffle(nullptr, nullptr, 0, width);
    Unshuffle(nullptr, nullptr, 0, width);
  }
}

INSTANTIATE_TEST_SUITE_P(Targets, FuzzRegressionTest, ::testing::ValuesIn(kTargets),
                         [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace ferry
