// This process's own memory for what is big and written once: an engine's
// copy of a model (copy mode), the table of its tensors, an index's text,
// the buffers a fingerprint reads its samples into. From 2 MiB up it
// is 2 MiB-aligned and asks for transparent huge pages (the kernel's policy
// `madvise` gives them on request, `always` anyway, `never` not): a fault
// and a zeroing per 2 MiB instead of per 4 KiB. On a virtual machine where a
// fault costs ~10 µs that took a 62 MiB copy from 180 ms to 8, and the
// 5.6 MB table of a 70,000-tensor model from ~10 ms of faults to well
// under one. Where the kernel refuses huge pages the memory is normal pages.
//
// Thread safety: free functions, no shared state; a PrivateBuffer is one
// thread's at a time.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <new>
#include <utility>

namespace weightd::io {

inline constexpr size_t kPrivateHugePageBytes = size_t{2} << 20;

// What MapPrivate(bytes) maps: `bytes` (at least 1) rounded up to whole
// pages, to whole huge pages from kPrivateHugePageBytes up; 0 where that
// overflows.
size_t PrivateMappedBytes(size_t bytes);

// Zeroed, read-write, page-aligned private memory for `bytes` (at least 1),
// huge-page aligned (and asked for in huge pages) where PrivateMappedBytes
// (bytes) is whole huge pages; nullptr where the kernel gives none (or
// `bytes` is absurd). Give it back with UnmapPrivate(p, bytes), the same
// `bytes`; all PrivateMappedBytes(bytes) of it may be mprotect-ed.
std::byte* MapPrivate(size_t bytes);
void UnmapPrivate(std::byte* p, size_t bytes);

// MapPrivate's memory, owned: a buffer that reads land in.
class PrivateBuffer {
 public:
  PrivateBuffer() = default;
  // Throws std::bad_alloc where MapPrivate gives nothing, as new would.
  explicit PrivateBuffer(size_t bytes);
  PrivateBuffer(const PrivateBuffer&) = delete;
  PrivateBuffer& operator=(const PrivateBuffer&) = delete;
  PrivateBuffer(PrivateBuffer&& other) noexcept { *this = std::move(other); }
  PrivateBuffer& operator=(PrivateBuffer&& other) noexcept;
  ~PrivateBuffer() { UnmapPrivate(data_, size_); }

  std::byte* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  std::byte* data_ = nullptr;
  size_t size_ = 0;
};

// A std::allocator that takes what reaches kPrivateHugePageBytes from
// MapPrivate (std::allocator the rest): for a big vector that is filled
// once, such as the table of a model's tensors. Throws std::bad_alloc as
// std::allocator does.
template <class T>
class PrivateAllocator {
  static_assert(alignof(T) <= 4096, "MapPrivate aligns to a page");

 public:
  using value_type = T;
  PrivateAllocator() = default;
  template <class U>
  PrivateAllocator(const PrivateAllocator<U>&) {}  // NOLINT: rebinding is implicit

  T* allocate(size_t n) {
    if (n > SIZE_MAX / sizeof(T)) throw std::bad_array_new_length();
    if (n * sizeof(T) < kPrivateHugePageBytes) return std::allocator<T>().allocate(n);
    std::byte* p = MapPrivate(n * sizeof(T));
    if (p == nullptr) throw std::bad_alloc();
    return reinterpret_cast<T*>(p);
  }
  void deallocate(T* p, size_t n) {
    if (n * sizeof(T) < kPrivateHugePageBytes) return std::allocator<T>().deallocate(p, n);
    UnmapPrivate(reinterpret_cast<std::byte*>(p), n * sizeof(T));
  }

  template <class U>
  bool operator==(const PrivateAllocator<U>&) const {
    return true;
  }
};

}  // namespace weightd::io
