// An allocator for a table's large arrays (rows, state, bookkeeping, the
// key index): a block of 2 MiB or more is mapped on its own, 2 MiB-aligned,
// and the kernel asked to back it with transparent huge pages
// (MADV_HUGEPAGE; where THP is "madvise", the only way to get them). A
// table's rows are reached at random, so with 4 KiB pages nearly every row
// a step touches costs a TLB miss once a table outgrows the TLB's reach
// (a few MiB); with 2 MiB pages the misses stay few up to tens of GiB, and
// a step costs the same at 10^6 rows as at 5 x 10^7. A freed block goes
// back to the system at once (munmap). Smaller blocks are the heap's.
#ifndef PSTRAIN_SERVER_HUGE_PAGES_H_
#define PSTRAIN_SERVER_HUGE_PAGES_H_

#include <cstddef>
#include <memory>

namespace pstrain::server {

inline constexpr size_t kHugePageBytes = size_t{2} << 20;

// `bytes` (>= kHugePageBytes) mapped and advised; throws std::bad_alloc.
void* MapHugePages(size_t bytes);
void UnmapHugePages(void* p, size_t bytes);

template <typename T>
struct HugePageAllocator {
  using value_type = T;
  HugePageAllocator() = default;
  template <typename U>
  HugePageAllocator(const HugePageAllocator<U>&) {}  // NOLINT: rebinding converts implicitly

  T* allocate(size_t n) {
    if (n * sizeof(T) < kHugePageBytes) return std::allocator<T>().allocate(n);
    return static_cast<T*>(MapHugePages(n * sizeof(T)));
  }
  void deallocate(T* p, size_t n) {
    if (n * sizeof(T) < kHugePageBytes) return std::allocator<T>().deallocate(p, n);
    UnmapHugePages(p, n * sizeof(T));
  }
  friend bool operator==(const HugePageAllocator&, const HugePageAllocator&) { return true; }
};

}  // namespace pstrain::server

#endif  // PSTRAIN_SERVER_HUGE_PAGES_H_
