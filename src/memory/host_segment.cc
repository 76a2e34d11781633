#include <fcntl.h>
#include <linux/memfd.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "memory/host_memory.h"
#include "memory/segment.h"

// Linux 5.14; headers older than the kernel may lack it.
#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22
#endif
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

namespace weightd::memory {
namespace {

constexpr uint64_t kHugePageBytes = 2ull << 20;
// Threads that take a new huge-page segment's pages (and zero them) at once.
constexpr uint64_t kMaxPopulateThreads = 16;
constexpr int kRequiredSeals = F_SEAL_WRITE | F_SEAL_GROW | F_SEAL_SHRINK;

std::string Errno(const std::string& what) { return what + ": " + std::strerror(errno); }

// Saturates: a size within a step of 2^64 rounds to the most there is (and
// no budget holds it), never wraps to a small reservation.
uint64_t RoundUp(uint64_t n, uint64_t to) {
  if (n > UINT64_MAX - (to - 1)) return UINT64_MAX;
  return (n + to - 1) / to * to;
}

class HostSegment final : public Segment {
 public:
  // `map` is a writable mapping for huge-page segments (hugetlbfs takes no
  // write(2)), null otherwise; `view` a read-only one, or null where none
  // could be made before the seal.
  HostSegment(UniqueFd fd, uint64_t size, uint64_t reserved, bool huge, bool thp, std::byte* map,
              std::byte* view)
      : fd_(std::move(fd)),
        size_(size),
        reserved_(reserved),
        huge_(huge),
        thp_(thp),
        map_(map),
        view_(view) {}
  ~HostSegment() override {
    if (map_ != nullptr) ::munmap(map_, reserved_);
    if (view_ != nullptr) ::munmap(view_, reserved_);
  }

  Device device() const override { return {}; }
  uint64_t size() const override { return size_; }
  uint64_t reserved_bytes() const override { return reserved_; }
  bool huge_pages() const override { return huge_; }
  bool transparent_huge_pages() const override { return thp_; }

  Status Write(uint64_t offset, std::span<const std::span<const std::byte>> pieces) override {
    if (sealed_) return Error("segment written after it was sealed");
    uint64_t total = 0;
    for (const auto& p : pieces) total += p.size();
    if (offset > size_ || total > size_ - offset) {
      return Error("write of " + std::to_string(total) + " bytes at " + std::to_string(offset) +
                   " passes the segment's end (" + std::to_string(size_) + ")");
    }
    if (huge_) {
      if (map_ == nullptr) return Error("segment written after a failed seal");
      for (const auto& p : pieces) {
        std::memcpy(map_ + offset, p.data(), p.size());
        offset += p.size();
      }
      return OkStatus();
    }
    return WriteAll(offset, pieces);
  }

  bool readable_here() const override { return true; }
  std::span<const std::byte> readable() const override {
    const std::byte* at = view_ != nullptr ? view_ : map_;
    if (at == nullptr) return {};  // not before the seal, here, or a failed one
    return {at, static_cast<size_t>(size_)};
  }

  Status Seal() override {
    if (sealed_) return OkStatus();
    // F_SEAL_WRITE is refused while a writable shared mapping exists: a
    // huge-page segment's goes first.
    if (map_ != nullptr) {
      if (::munmap(map_, reserved_) != 0) return Error(Errno("cannot unmap the segment"));
      map_ = nullptr;
    }
    int sealed = ::fcntl(fd_.get(), F_ADD_SEALS, kRequiredSeals | F_SEAL_SEAL);
    if (sealed != 0 && errno == EBUSY && view_ != nullptr) {
      // A kernel that counts even our read-only view as writable: without it.
      ::munmap(view_, reserved_);
      view_ = nullptr;
      sealed = ::fcntl(fd_.get(), F_ADD_SEALS, kRequiredSeals | F_SEAL_SEAL);
    }
    if (sealed != 0) return Error(Errno("cannot seal the segment"));
    if (view_ == nullptr) {
      void* p = ::mmap(nullptr, reserved_, PROT_READ, MAP_SHARED, fd_.get(), 0);
      if (p == MAP_FAILED) return Error(Errno("cannot map the sealed segment"));
      view_ = static_cast<std::byte*>(p);
    }
    sealed_ = true;
    return OkStatus();
  }

  Result<UniqueFd> Export() const override {
    if (!sealed_) return Error("segment exported before it was sealed");
    return fd_.Duplicate();
  }

  std::function<uint64_t()> HeldProbe() const override {
    if (huge_) return Segment::HeldProbe();
    auto fd = fd_.Duplicate();
    if (!fd.ok()) return Segment::HeldProbe();  // none counted: as if nothing were written
    return [fd = std::make_shared<UniqueFd>(std::move(fd).value())]() -> uint64_t {
      // st_blocks counts 512-byte units of the pages a memfd holds, those
      // swapped out too, which no figure of free memory lacks: none is
      // counted where swap is on.
      if (HostHasSwap()) return 0;
      struct stat st;
      return ::fstat(fd->get(), &st) == 0 ? static_cast<uint64_t>(st.st_blocks) * 512 : 0;
    };
  }

 private:
  // pwritev, as many times as a short write or IOV_MAX makes it take.
  Status WriteAll(uint64_t offset, std::span<const std::span<const std::byte>> pieces) {
    std::vector<iovec> iov;
    iov.reserve(std::min<size_t>(pieces.size(), IOV_MAX));
    size_t next = 0;
    while (next < pieces.size() || !iov.empty()) {
      while (next < pieces.size() && iov.size() < IOV_MAX) {
        if (!pieces[next].empty()) {
          iov.push_back({const_cast<std::byte*>(pieces[next].data()), pieces[next].size()});
        }
        ++next;
      }
      if (iov.empty()) break;
      const ssize_t n = ::pwritev(fd_.get(), iov.data(), static_cast<int>(iov.size()),
                                  static_cast<off_t>(offset));
      if (n < 0) {
        if (errno == EINTR) continue;
        return Error(Errno("cannot write into the segment"));
      }
      if (n == 0) return Error("cannot write into the segment: no progress");
      offset += static_cast<uint64_t>(n);
      // Drop what was written; keep the rest of a piece cut short.
      auto left = static_cast<size_t>(n);
      size_t done = 0;
      while (done < iov.size() && left >= iov[done].iov_len) left -= iov[done++].iov_len;
      iov.erase(iov.begin(), iov.begin() + static_cast<std::ptrdiff_t>(done));
      if (left > 0) {
        iov[0].iov_base = static_cast<char*>(iov[0].iov_base) + left;
        iov[0].iov_len -= left;
      }
    }
    return OkStatus();
  }

  UniqueFd fd_;
  uint64_t size_;
  uint64_t reserved_;
  bool huge_;
  bool thp_;
  std::byte* map_;
  std::byte* view_;
  bool sealed_ = false;
};

// A read-only shared mapping of the memfd `fd`, through a descriptor opened
// read-only: one through `fd` itself, even without PROT_WRITE, could be
// made writable later, and the kernel refuses F_SEAL_WRITE while it
// exists. Null where /proc is not mounted.
std::byte* MapReadOnly(int fd, uint64_t bytes) {
  const std::string path = "/proc/self/fd/" + std::to_string(fd);
  UniqueFd reading(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!reading.valid()) return nullptr;
  void* p = ::mmap(nullptr, bytes, PROT_READ, MAP_SHARED, reading.get(), 0);
  return p == MAP_FAILED ? nullptr : static_cast<std::byte*>(p);
}

// A memfd of `bytes`, or an error (ENOSPC, ENOMEM when the system has not
// that much to give).
Result<UniqueFd> MakeMemfd(const std::string& name, uint64_t bytes, bool huge) {
  unsigned flags = MFD_CLOEXEC | MFD_ALLOW_SEALING | (huge ? MFD_HUGETLB | MFD_HUGE_2MB : 0u);
  UniqueFd fd(::memfd_create(name.c_str(), flags));
  if (!fd.valid()) return Error(Errno("memfd_create"));
  if (::ftruncate(fd.get(), static_cast<off_t>(bytes)) != 0) return Error(Errno("ftruncate"));
  return fd;
}

// Whether the kernel may fill a memfd of `size` bytes with transparent
// huge pages of 2 MiB: its policy for shared memory says so (`always` or
// `force`; `within_size` where the memfd holds a whole one), and its huge
// pages are 2 MiB (not so on arm64 with 16 or 64 KiB pages, where they
// are 32 or 512 MiB: segments there stay rounded to pages). Where the
// policy allows them, the kernel still falls back to normal pages while
// it has no free 2 MiB block.
bool TakesTransparentHugePages(uint64_t size) {
  std::ifstream pmd("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size");
  uint64_t huge = 0;
  if (!(pmd >> huge) || huge != kHugePageBytes) return false;
  const std::string policy = ShmemHugePagePolicy();
  if (policy == "always" || policy == "force") return true;
  const auto page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  return policy == "within_size" && RoundUp(size, page) >= kHugePageBytes;
}

// Takes every page of a new huge-page mapping now, several threads each
// over its own stretch, so that each zeroes its share. Taken here, a page
// the system will not give is an error (EFAULT, ENOMEM) to fall back on;
// taken by a write during the fill, it would be a SIGBUS that kills the
// daemon (a cgroup's hugetlb limit is charged when a page is first
// touched, not when the mapping reserves it). EINVAL: the kernel is older
// than MADV_POPULATE_WRITE (5.14), and fallocate takes them in one pass.
Status TakeHugePages(int fd, std::byte* map, uint64_t bytes) {
  const uint64_t pages = bytes / kHugePageBytes;
  const uint64_t threads =
      std::clamp<uint64_t>(static_cast<uint64_t>(HostCpus()), 1, kMaxPopulateThreads);
  const uint64_t per_thread = (pages + threads - 1) / threads * kHugePageBytes;
  std::vector<int> errors(static_cast<size_t>(threads), 0);
  {
    std::vector<std::jthread> team;
    team.reserve(static_cast<size_t>(threads));
    for (uint64_t t = 0; t < threads && t * per_thread < bytes; ++t) {
      const uint64_t from = t * per_thread;
      const uint64_t length = std::min(per_thread, bytes - from);
      auto populate = [=, &errors] {
        if (::madvise(map + from, length, MADV_POPULATE_WRITE) != 0) {
          errors[static_cast<size_t>(t)] = errno;
        }
      };
      try {
        team.emplace_back(populate);
      } catch (const std::system_error&) {
        populate();  // no thread to spare: this one does it
      }
    }
  }
  const auto failed = std::find_if(errors.begin(), errors.end(), [](int e) { return e != 0; });
  if (failed == errors.end()) return OkStatus();
  errno = *failed;
  if (*failed == EINVAL && ::fallocate(fd, 0, 0, static_cast<off_t>(bytes)) == 0) {
    return OkStatus();
  }
  return Error(Errno("cannot take " + std::to_string(bytes) + " bytes of huge pages"));
}

// A huge-page memfd of `bytes` (a multiple of the huge page size) and its
// writable mapping, every page taken from the pool: a pool too small, or a
// limit on what this process may take, fails here, before any byte is
// read, and the caller falls back to normal pages instead of failing (or
// dying) halfway through the fill.
Result<std::pair<UniqueFd, std::byte*>> MakeHugeSegment(const std::string& name, uint64_t bytes) {
  WEIGHTD_ASSIGN_OR_RETURN(UniqueFd fd, MakeMemfd(name, bytes, true));
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
  if (p == MAP_FAILED) {
    return Error(Errno("cannot reserve " + std::to_string(bytes) + " bytes of huge pages"));
  }
  auto* map = static_cast<std::byte*>(p);
  if (Status taken = TakeHugePages(fd.get(), map, bytes); !taken.ok()) {
    ::munmap(map, bytes);
    return taken.error();
  }
  return std::pair(std::move(fd), map);
}

// Huge pages of the 2 MiB pool that a new segment could take: those no
// mapping holds or has reserved, and those the kernel may still add on
// demand (nr_overcommit_hugepages beyond the surplus it has added); 0 where
// there is no pool (or sysfs cannot be read).
uint64_t FreeHugePages() {
  auto read = [](const char* name) -> uint64_t {
    const std::string path = std::string("/sys/kernel/mm/hugepages/hugepages-2048kB/") + name;
    FILE* f = std::fopen(path.c_str(), "re");
    if (f == nullptr) return 0;
    unsigned long long n = 0;
    if (std::fscanf(f, "%llu", &n) != 1) n = 0;
    std::fclose(f);
    return n;
  };
  const uint64_t free = read("free_hugepages"), reserved = read("resv_hugepages");
  const uint64_t overcommit = read("nr_overcommit_hugepages"), surplus = read("surplus_hugepages");
  return (free > reserved ? free - reserved : 0) +
         (overcommit > surplus ? overcommit - surplus : 0);
}

}  // namespace

UniqueFd& UniqueFd::operator=(UniqueFd&& other) noexcept {
  if (this != &other) Reset(other.Release());
  return *this;
}

int UniqueFd::Release() {
  int fd = fd_;
  fd_ = -1;
  return fd;
}

void UniqueFd::Reset(int fd) {
  if (fd_ >= 0) ::close(fd_);
  fd_ = fd;
}

Status Segment::ReadBack(uint64_t offset, std::span<std::byte> out) const {
  const std::span<const std::byte> bytes = readable();
  if (offset > bytes.size() || out.size() > bytes.size() - offset) {
    return Error("bytes [" + std::to_string(offset) + ", +" + std::to_string(out.size()) +
                 ") are not readable in this segment");
  }
  std::memcpy(out.data(), bytes.data() + offset, out.size());
  return OkStatus();
}

Result<UniqueFd> UniqueFd::Duplicate() const {
  int fd = ::fcntl(fd_, F_DUPFD_CLOEXEC, 0);
  if (fd < 0) return Error(Errno("cannot duplicate a descriptor"));
  return UniqueFd(fd);
}

HostPlacement PlanHostSegments(uint64_t size, uint64_t count, bool huge_page_pool) {
  if (size == 0) size = 1;  // as CreateHostSegment
  HostPlacement out;
  if (huge_page_pool && size >= kHugePageBytes) {
    const uint64_t pages = RoundUp(size, kHugePageBytes) / kHugePageBytes;
    uint64_t all = 0;
    if (!__builtin_mul_overflow(pages, count, &all) && all <= FreeHugePages()) {
      out.bytes = pages * kHugePageBytes;
      out.options.try_huge_pages = true;
      out.options.normal_pages_if_no_huge_pages = false;
      return out;
    }
  }
  out.options.try_huge_pages = false;
  out.options.transparent_huge_pages = TakesTransparentHugePages(size);
  out.bytes = RoundUp(size, out.options.transparent_huge_pages
                                ? kHugePageBytes
                                : static_cast<uint64_t>(::sysconf(_SC_PAGESIZE)));
  return out;
}

std::string ShmemHugePagePolicy() {
  std::ifstream knob(kShmemHugePagePolicyPath);
  for (std::string word; knob >> word;) {
    if (word.size() > 2 && word.front() == '[' && word.back() == ']') {
      return word.substr(1, word.size() - 2);
    }
  }
  return "";
}

Result<std::unique_ptr<Segment>> CreateHostSegment(uint64_t size, const std::string& name,
                                                   const HostSegmentOptions& options) {
  if (size == 0) size = 1;  // an empty model still gets a mappable segment
  const std::string label = "weightd:" + name;
  // Huge pages come from their own pool, which MemAvailable does not count:
  // a machine set up for them may have more in the pool than free.
  if (options.try_huge_pages && size >= kHugePageBytes) {
    const uint64_t reserved = RoundUp(size, kHugePageBytes);
    auto made = MakeHugeSegment(label, reserved);
    if (made.ok()) {
      auto& [fd, map] = *made;
      // Read back through a view of its own, which the seal leaves in place.
      std::byte* view = MapReadOnly(fd.get(), reserved);
      return std::unique_ptr<Segment>(
          new HostSegment(std::move(fd), size, reserved, true, false, map, view));
    }
    if (!options.normal_pages_if_no_huge_pages) {
      return Error("cannot create a host segment of " + std::to_string(size) +
                   " bytes in huge pages, as planned: " + made.error().message());
    }
  }
  // Normal pages are allocated as the fill touches them, by every reading
  // thread at once (allocating them up front costs a single-threaded pass
  // over the whole size). What would not fit in the memory the kernel would
  // still give (the machine's, or a control group's) is refused now, with
  // a message, rather than ending in the OOM killer halfway through.
  if (auto room = HostMemoryRoom(); room && size > room->free) {
    return Error("cannot create a host segment of " + std::to_string(size) + " bytes: only " +
                 std::to_string(room->free) + " bytes of memory are available (" + room->source +
                 ")");
  }
  uint64_t reserved = RoundUp(size, static_cast<uint64_t>(::sysconf(_SC_PAGESIZE)));
  auto fd = MakeMemfd(label, reserved, false);
  if (!fd.ok()) {
    return Error("cannot create a host segment of " + std::to_string(size) +
                 " bytes: " + fd.error().message());
  }
  // Where the kernel may fill the memfd with transparent huge pages, the
  // segment is whole ones: a page is allocated, charged and listed per
  // 2 MiB written instead of per 4 KiB (the 1 GB model's reads up to
  // several times faster), engines map it with a page table entry per
  // 2 MiB, and what it takes is the size it has under either policy
  // (`always` would take the tail's whole huge page anyway). Not where the
  // caller planned for normal pages: `within_size` then keeps the tail in
  // them (`always` may not, if the policy changed since the plan). Where
  // the memfd cannot grow, it keeps its size.
  const bool thp = TakesTransparentHugePages(size);
  if (thp && options.transparent_huge_pages) {
    const uint64_t whole = RoundUp(size, kHugePageBytes);
    if (::ftruncate(fd->get(), static_cast<off_t>(whole)) == 0) reserved = whole;
  }
  // Mapped read-only now, where it can be, so that what is written can be
  // read back before the seal; it costs nothing until read.
  std::byte* map = MapReadOnly(fd->get(), reserved);
  return std::unique_ptr<Segment>(
      new HostSegment(std::move(fd).value(), size, reserved, false, thp, nullptr, map));
}

Mapping::~Mapping() {
  if (data_ != nullptr) ::munmap(const_cast<std::byte*>(data_), mapped_);
}

Result<std::unique_ptr<Mapping>> MapHostSegment(const UniqueFd& fd, uint64_t size) {
  const int seals = ::fcntl(fd.get(), F_GET_SEALS);
  if (seals < 0) return Error(Errno("the segment's descriptor is not a memfd"));
  if ((seals & kRequiredSeals) != kRequiredSeals) {
    return Error("the segment is not sealed against writes and resizing");
  }
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) return Error(Errno("cannot stat the segment"));
  // A segment is its size rounded up to its pages: 2 MiB at most.
  const auto held = static_cast<uint64_t>(st.st_size);
  if (held < size || held > RoundUp(size, kHugePageBytes)) {
    return Error("the segment holds " + std::to_string(held) + " bytes, " + std::to_string(size) +
                 " were announced");
  }
  // The whole memfd: its size is a multiple of the page size it was made
  // with (2 MiB for huge pages), which munmap needs.
  const auto length = static_cast<size_t>(held);
  if (size == 0) return Error("the segment is empty");
  void* p = ::mmap(nullptr, length, PROT_READ, MAP_SHARED, fd.get(), 0);
  if (p == MAP_FAILED) return Error(Errno("cannot map the segment"));
  return std::unique_ptr<Mapping>(
      new Mapping(static_cast<const std::byte*>(p), static_cast<size_t>(size), length));
}

void PrefaultForReading(std::span<const std::byte> bytes) {
  if (bytes.empty()) return;
  const auto page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const auto start = reinterpret_cast<uintptr_t>(bytes.data()) / page * page;
  const auto end = reinterpret_cast<uintptr_t>(bytes.data()) + bytes.size();
  ::madvise(reinterpret_cast<void*>(start), end - start, MADV_POPULATE_READ);
}

}  // namespace weightd::memory
