// Host memory for bulk data (src/base/host_memory.hpp).
#include "base/host_memory.hpp"

#include <sys/mman.h>

#include <cstdlib>

#include "base/util.hpp"

namespace ferry {

void* AllocateBulk(uint64_t bytes, uint64_t small_align, uint64_t* allocated) {
  if (bytes < kHugePage) {
    *allocated = AlignUp(bytes, small_align);
    return std::aligned_alloc(small_align, *allocated);
  }
  *allocated = AlignUp(bytes, kHugePage);
  void* p = std::aligned_alloc(kHugePage, *allocated);
  if (p != nullptr) ::madvise(p, *allocated, MADV_HUGEPAGE);
  return p;
}

}  // namespace ferry
