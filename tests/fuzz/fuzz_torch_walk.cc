#include "fuzz_entries.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  (void)ferry::fuzz::FuzzTorchWalk(data, size);
  return 0;
}
