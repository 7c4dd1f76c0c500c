// Shared helpers for the GoogleTest suites.
#ifndef FERRY_TESTS_TEST_UTIL_HPP_
#define FERRY_TESTS_TEST_UTIL_HPP_

#include <fcntl.h>
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "ferry/ferry.hpp"

namespace ferry::testing {

// A fresh directory under TMPDIR, removed with its contents at destruction.
class TempDir {
 public:
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "ferry_test_XXXXXX").string();
    path_ = mkdtemp(tmpl.data());
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  std::string File(const std::string& name) const { return path_ + "/" + name; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// XORs the byte at `offset` of the file with `mask`, in place (a corruption test's flip).
inline bool XorFileByte(const std::string& path, uint64_t offset, uint8_t mask) {
  int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) return false;
  uint8_t v = 0;
  bool ok = ::pread(fd, &v, 1, static_cast<off_t>(offset)) == 1;
  v ^= mask;
  ok = ok && ::pwrite(fd, &v, 1, static_cast<off_t>(offset)) == 1;
  ::close(fd);
  return ok;
}

// Starts this program again (via /proc/self/exe) with `args` (args[0] included) in a child
// process; returns its pid. Multi-process tests use it so that every process is fresh: no
// CUDA context or NCCL state inherited across fork.
inline pid_t SpawnSelf(const std::vector<std::string>& args) {
  pid_t pid = fork();
  if (pid == 0) {
    std::vector<char*> argv;
    for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    execv("/proc/self/exe", argv.data());
    _exit(127);
  }
  return pid;
}

inline std::vector<uint8_t> RandomBytes(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<uint8_t> out(n);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t v = rng();
    __builtin_memcpy(&out[i], &v, 8);
  }
  for (; i < n; ++i) out[i] = static_cast<uint8_t>(rng());
  return out;
}

// `n` random bytes; with `compressible`, every second byte keeps only its low nibble (the
// low-entropy high bytes of real weights), so encoded tensors really compress.
inline std::vector<uint8_t> TensorBytes(size_t n, uint64_t seed, bool compressible) {
  std::vector<uint8_t> bytes = RandomBytes(n, seed);
  if (compressible) {
    for (size_t i = 1; i < bytes.size(); i += 2) bytes[i] &= 0x0f;
  }
  return bytes;
}

// Adds tensor `name` of TensorBytes (compressible where `enc` encodes) to `w`, and its bytes
// to (*expected)[name].
inline Status AddTestTensor(Writer& w, const std::string& name, DType dtype,
                            const std::vector<int64_t>& shape, Encoding enc, uint64_t seed,
                            std::map<std::string, std::vector<uint8_t>>* expected) {
  const uint64_t n = *StorageBytes(dtype, *NumElements(shape));
  std::vector<uint8_t> bytes = TensorBytes(n, seed, enc != Encoding::kRaw);
  Status st = w.AddTensor(name, dtype, shape, bytes.data(), n, enc);
  (*expected)[name] = std::move(bytes);
  return st;
}

}  // namespace ferry::testing

#endif  // FERRY_TESTS_TEST_UTIL_HPP_
