// XXH3-64 built for AVX2 (this file alone is compiled with -mavx2): the copy workers hash every
// block they load, and the SSE2 build every other file gets hashes at about half the rate. The
// functions here are called only where the CPU reports AVX2 (codec.cc). Nothing but xxhash is
// included, so no inline function of another header is compiled for AVX2 and then shared with
// callers on CPUs without it.
#include <cstddef>
#include <cstdint>

#define XXH_INLINE_ALL
#include <xxhash.h>

namespace ferry::avx2 {

uint64_t Checksum64(const void* data, size_t size) { return XXH3_64bits(data, size); }

void ChecksumUpdate(void* state, const void* data, size_t size) {
  XXH3_64bits_update(static_cast<XXH3_state_t*>(state), data, size);
}

}  // namespace ferry::avx2
