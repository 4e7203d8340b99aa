#include "common/shm_pipe.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <new>

#include "absl/strings/str_cat.h"
#include "common/direct_connection.h"
#include "common/direct_wire.h"

namespace pstrain {

absl::Status ValidateShmOptions(const ShmOptions& options) {
  const int64_t p = options.pipe_bytes;
  if (p < kMinPipeBytes || p > kMaxPipeBytes || (p & (p - 1)) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "shared-memory pipe bytes must be a power of two in [64 KiB, 1 GiB], not ", p));
  }
  if (options.max_message_bytes < 1 || options.max_message_bytes > (int64_t{1} << 31)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "shared-memory max message bytes must be in [1, 2 GiB], not ", options.max_message_bytes));
  }
  return absl::OkStatus();
}

absl::StatusOr<ShmRegion> CreateShmRegion(uint64_t pipe_bytes) {
  const size_t bytes = RegionBytes(pipe_bytes);
  const int memfd = memfd_create("pstrain-shm", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (memfd < 0) return Errno("memfd_create");
  void* region = MAP_FAILED;
  if (ftruncate(memfd, static_cast<off_t>(bytes)) != 0 ||
      fcntl(memfd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0 ||
      (region = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, memfd, 0)) == MAP_FAILED) {
    absl::Status s = Errno("shared region");
    close(memfd);
    return s;
  }
  auto* header = new (region) RegionHeader{};
  header->magic = kRegionMagic;
  header->pipe_bytes = pipe_bytes;
  return ShmRegion{region, bytes, memfd};
}

absl::StatusOr<void*> MapPeerRegion(int memfd, uint64_t pipe_bytes) {
  const size_t bytes = RegionBytes(pipe_bytes);
  struct stat st {};
  const int seals = fcntl(memfd, F_GET_SEALS);
  if (fstat(memfd, &st) != 0 || static_cast<size_t>(st.st_size) != bytes || seals < 0 ||
      (seals & F_SEAL_SHRINK) == 0) {
    return absl::InvalidArgumentError("a bad shared region");
  }
  void* region = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, memfd, 0);
  if (region == MAP_FAILED) return Errno("mmap");
  const auto* header = static_cast<const RegionHeader*>(region);
  if (header->magic != kRegionMagic || header->pipe_bytes != pipe_bytes) {
    munmap(region, bytes);
    return absl::InvalidArgumentError("a bad shared region header");
  }
  return region;
}

std::pair<std::unique_ptr<ShmPipe>, std::unique_ptr<ShmPipe>> PipesOf(void* region,
                                                                     uint64_t pipe_bytes,
                                                                     bool is_client) {
  auto* header = static_cast<RegionHeader*>(region);
  auto* data = static_cast<unsigned char*>(region) + kControlBytes;
  auto to_listener = std::make_unique<ShmPipe>(&header->pipes[0], data, pipe_bytes);
  auto to_connector = std::make_unique<ShmPipe>(&header->pipes[1], data + pipe_bytes, pipe_bytes);
  if (is_client) return {std::move(to_listener), std::move(to_connector)};
  return {std::move(to_connector), std::move(to_listener)};
}

}  // namespace pstrain
