// Helpers shared by the benchmark programs.
#ifndef FERRY_BENCHMARKS_BENCH_UTIL_HPP_
#define FERRY_BENCHMARKS_BENCH_UTIL_HPP_

#include <benchmark/benchmark.h>

#include <chrono>
#include <string>
#include <vector>

namespace ferry::bench {

inline double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Takes --ferry_gib=N and --ferry_dir=PATH out of argv, hands the rest to Google Benchmark.
// False when Google Benchmark rejects an argument.
inline bool ParseFlags(int argc, char** argv, double* gib, std::string* dir) {
  std::vector<char*> rest;
  for (int i = 0; i < argc; ++i) {
    std::string a = argv[i];
    if (a.rfind("--ferry_gib=", 0) == 0) {
      *gib = std::stod(a.substr(12));
    } else if (a.rfind("--ferry_dir=", 0) == 0) {
      *dir = a.substr(12);
    } else {
      rest.push_back(argv[i]);
    }
  }
  int rargc = static_cast<int>(rest.size());
  benchmark::Initialize(&rargc, rest.data());
  return !benchmark::ReportUnrecognizedArguments(rargc, rest.data());
}

}  // namespace ferry::bench

#endif  // FERRY_BENCHMARKS_BENCH_UTIL_HPP_
