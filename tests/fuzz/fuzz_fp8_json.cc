#include "fuzz_hostile_entries.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  (void)ferry::fuzz::FuzzFp8Json(data, size);
  return 0;
}
