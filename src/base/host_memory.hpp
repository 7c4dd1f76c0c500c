// Host memory for bulk data (load destinations, pinned staging).
#ifndef FERRY_SRC_BASE_HOST_MEMORY_HPP_
#define FERRY_SRC_BASE_HOST_MEMORY_HPP_

#include <cstdint>

namespace ferry {

// Transparent huge pages: the unit large host allocations are aligned and advised to.
inline constexpr uint64_t kHugePage = uint64_t{2} << 20;

// `bytes` of host memory, freed with std::free; null when there is none. From kHugePage up it
// is kHugePage aligned, rounded up to whole huge pages and advised MADV_HUGEPAGE: a fresh
// process then faults it in 2 MiB at a time (one-shot LoadToHost of 8 GiB on an H200 host:
// 9.1 GB/s into 4 KiB pages, 15-16 into huge pages), and pinning it takes under half as long
// (a 64 MiB ring: 17-20 ms instead of 41-46). Smaller requests are `small_align` aligned
// (a power of two) and rounded up to it. `*allocated` gets the size allocated.
void* AllocateBulk(uint64_t bytes, uint64_t small_align, uint64_t* allocated);

}  // namespace ferry

#endif  // FERRY_SRC_BASE_HOST_MEMORY_HPP_
