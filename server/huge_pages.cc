#include "server/huge_pages.h"

#include <sys/mman.h>

#include <cstdint>
#include <new>

namespace pstrain::server {
namespace {

size_t Rounded(size_t bytes) { return (bytes + kHugePageBytes - 1) & ~(kHugePageBytes - 1); }

}  // namespace

void* MapHugePages(size_t bytes) {
  // Mapped a huge page longer than asked, then trimmed to a huge page's
  // alignment at both ends: mmap aligns to 4 KiB only.
  const size_t length = Rounded(bytes);
  void* mapped = mmap(nullptr, length + kHugePageBytes, PROT_READ | PROT_WRITE,
                      MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (mapped == MAP_FAILED) throw std::bad_alloc();
  const auto start = reinterpret_cast<uintptr_t>(mapped);
  const uintptr_t aligned = (start + kHugePageBytes - 1) & ~uintptr_t{kHugePageBytes - 1};
  if (aligned > start) munmap(mapped, aligned - start);
  const uintptr_t end = start + length + kHugePageBytes;
  if (end > aligned + length) munmap(reinterpret_cast<void*>(aligned + length), end - aligned - length);
  // Advice only: without THP the block is ordinary pages.
  madvise(reinterpret_cast<void*>(aligned), length, MADV_HUGEPAGE);
  return reinterpret_cast<void*>(aligned);
}

void UnmapHugePages(void* p, size_t bytes) { munmap(p, Rounded(bytes)); }

}  // namespace pstrain::server
