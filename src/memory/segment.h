// Resident segments: one block of memory per model-rank that a daemon fills
// once and many engines map read-only, passed between processes as a file
// descriptor. A model-rank is one segment, so attaching costs one handle.
//
// The host backend is a memfd: filled by writes to the descriptor (normal
// memory: a page written by pwrite is not faulted in first, which makes
// filling about a tenth faster than through a mapping, and where the
// kernel's shmem policy allows, its pages are transparent huge pages; the
// hugetlbfs pool's pages take no write(2) and are filled through a
// mapping), then sealed (no write, grow or shrink, ever again)
// so an importer that checks the seals knows the bytes cannot change under
// it. The memory is freed when the last descriptor and the last mapping
// are gone, whichever process holds them: an engine's mapping outlives the
// daemon that made it.
//
// Thread safety: a Segment is filled by one owner; Mapping is immutable.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>

#include "weightd/result.h"

namespace weightd::memory {

// A file descriptor, closed when the object goes.
class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  UniqueFd(UniqueFd&& other) noexcept : fd_(other.Release()) {}
  UniqueFd& operator=(UniqueFd&& other) noexcept;
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  ~UniqueFd() { Reset(); }

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  int Release();
  void Reset(int fd = -1);
  // A second descriptor for the same open file.
  Result<UniqueFd> Duplicate() const;

 private:
  int fd_ = -1;
};

// Where a segment lives; the name is what keys and status messages carry
// ("host", "cuda:GPU-<uuid>").
enum class DeviceKind { kHost, kCuda };

struct Device {
  DeviceKind kind = DeviceKind::kHost;
  std::string uuid = {};  // kCuda
  std::string Name() const { return kind == DeviceKind::kHost ? "host" : "cuda:" + uuid; }
};

// The owner's side: created with a size, filled, sealed, exported.
class Segment {
 public:
  Segment() = default;
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;
  virtual ~Segment() = default;

  virtual Device device() const = 0;
  // Bytes usable (what was asked for), and bytes the memory really takes
  // (rounded to the page size used).
  virtual uint64_t size() const = 0;
  virtual uint64_t reserved_bytes() const = 0;
  virtual bool huge_pages() const = 0;
  // Normal memory that the kernel's policy lets it fill with transparent
  // huge pages (2 MiB folios, where it has free 2 MiB blocks; not from the
  // hugetlbfs pool).
  virtual bool transparent_huge_pages() const { return false; }
  // Where a GPU's segment is mapped in this process (its device address);
  // 0 for host memory.
  virtual uint64_t device_address() const { return 0; }
  // Reads how many bytes of memory the segment takes so far (normal host
  // memory: the pages written, which the kernel's figure of free memory
  // already lacks; 0 where no such figure counts them, a GPU's or the
  // huge-page pool's, and where swap is on, since pages swapped out would
  // count). Safe to call from any thread, after the segment is gone too
  // (it keeps the memory it reads alive while it lives).
  virtual std::function<uint64_t()> HeldProbe() const {
    return [] { return uint64_t{0}; };
  }

  // Copies `pieces`, one after another, into the segment from `offset`.
  // Calls on disjoint ranges may run at once, from many threads. An error
  // after Seal() or past the end.
  virtual Status Write(uint64_t offset, std::span<const std::span<const std::byte>> pieces) = 0;
  Status Write(uint64_t offset, std::span<const std::byte> bytes) {
    return Write(offset, std::span(&bytes, 1));
  }
  // Ends writing for good. Afterwards the segment can be exported.
  virtual Status Seal() = 0;
  // Whether readable() gives the bytes in this process once sealed (host
  // memory does; a GPU's does not).
  virtual bool readable_here() const = 0;
  // The segment's bytes as written so far: once sealed where
  // readable_here(), and host memory from its creation on (what a Write put
  // there shows at once, so a loader can read what it wrote while it still
  // writes elsewhere). Otherwise empty. Host memory keeps one view from
  // creation to the end where /proc lets it be mapped read-only early;
  // else the view may move at Seal: take it again after.
  virtual std::span<const std::byte> readable() const = 0;
  // Copies sealed bytes [offset, offset + out.size()) into host memory: from
  // readable(), or by a copy off the GPU.
  virtual Status ReadBack(uint64_t offset, std::span<std::byte> out) const;
  // A new descriptor for the sealed segment, to hand to another process.
  virtual Result<UniqueFd> Export() const = 0;
};

struct HostSegmentOptions {
  // Try huge pages (hugetlbfs) first; fall back to normal pages when the
  // system has none to give.
  bool try_huge_pages = true;
  // With try_huge_pages, where the pool cannot give them: false refuses
  // instead of taking normal pages, for a caller that made room for huge
  // pages, which come from the pool, not from the memory the kernel would
  // give (see PlanHostSegments).
  bool normal_pages_if_no_huge_pages = true;
  // Normal memory: where the kernel's shmem policy lets it fill memfds
  // with transparent huge pages, make the segment whole ones, its size
  // rounded up to 2 MiB. False: round to the page size whatever the
  // policy.
  bool transparent_huge_pages = true;
};

// What `count` host segments of `size` bytes each would take if made now:
// whole huge pages when the system's 2 MiB pool has that many free for all
// of them, else normal memory: whole transparent huge pages where the
// kernel's policy lets it fill memfds with those, else whole normal pages.
// For a caller that reserves memory before making segments: made with
// `options`, a segment never takes more than `bytes`, unless the kernel's
// shmem policy turned to `always` between the plan and the end of the fill.
// Where the plan is huge pages and the pool has shrunk meanwhile, its
// options refuse normal pages: room weighed for the pool is not room in
// memory (plan again without `huge_page_pool`, for normal memory whatever
// the pool has).
struct HostPlacement {
  uint64_t bytes = 0;  // per segment
  HostSegmentOptions options;
};
HostPlacement PlanHostSegments(uint64_t size, uint64_t count = 1, bool huge_page_pool = true);

// The kernel's policy for transparent huge pages in shared memory, memfds
// among it, as the file below names it ("never", "within_size", "always",
// "advise", "deny", "force"); empty where the kernel has none. The machine's
// to set: weightd only reads it.
inline constexpr const char* kShmemHugePagePolicyPath =
    "/sys/kernel/mm/transparent_hugepage/shmem_enabled";
std::string ShmemHugePagePolicy();

// A memfd of `size` bytes: of huge pages when the pool has them all (taken
// now), else of normal memory (transparent huge pages where the kernel
// gives memfds those), allocated as the fill touches it; a size
// beyond the memory the kernel reports available is then refused here with
// a message. `name` shows in /proc/PID/maps, for whoever debugs.
Result<std::unique_ptr<Segment>> CreateHostSegment(uint64_t size, const std::string& name,
                                                   const HostSegmentOptions& options = {});

// A read-only view of a segment in the importing process.
class Mapping {
 public:
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  ~Mapping();

  // The `size` bytes announced, not the page rounding after them.
  std::span<const std::byte> bytes() const { return {data_, size_}; }

 private:
  friend Result<std::unique_ptr<Mapping>> MapHostSegment(const UniqueFd&, uint64_t);
  Mapping(const std::byte* data, size_t size, size_t mapped)
      : data_(data), size_(size), mapped_(mapped) {}
  const std::byte* data_;
  size_t size_;
  size_t mapped_;  // the whole memfd, for munmap
};

// Maps an imported host segment read-only, after checking that it is
// sealed against writes and resizing and that it holds `size` bytes
// rounded up to its pages, no fewer and no more (a bigger one is not the
// segment announced). The descriptor may be closed afterwards; the mapping
// keeps the memory.
Result<std::unique_ptr<Mapping>> MapHostSegment(const UniqueFd& fd, uint64_t size);

// Sets up the page table entries of `bytes` (mapped memory) in one call,
// for a reader about to read all of them, such as a manifest: faulting them
// in 16 pages at a time as they are read costs several times more on a
// virtual machine. A hint: where the kernel does not know it (before
// Linux 5.14), nothing happens.
void PrefaultForReading(std::span<const std::byte> bytes);

}  // namespace weightd::memory
