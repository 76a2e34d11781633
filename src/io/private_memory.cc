#include "io/private_memory.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>

namespace weightd::io {
namespace {

size_t PageBytes() {
  static const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  return page;
}

// `n` rounded up to a multiple of `unit` (a power of two); 0 on overflow.
size_t RoundUp(size_t n, size_t unit) {
  size_t up;
  if (__builtin_add_overflow(n, unit - 1, &up)) return 0;
  return up & ~(unit - 1);
}

}  // namespace

size_t PrivateMappedBytes(size_t bytes) {
  if (bytes == 0) bytes = 1;
  return RoundUp(bytes, bytes >= kPrivateHugePageBytes ? kPrivateHugePageBytes : PageBytes());
}

std::byte* MapPrivate(size_t bytes) {
  const size_t mapped = PrivateMappedBytes(bytes);
  if (mapped == 0) return nullptr;
  // Huge pages only come to a 2 MiB-aligned range: map a huge page more
  // than needed and cut the ends off.
  const size_t spare = mapped >= kPrivateHugePageBytes ? kPrivateHugePageBytes : 0;
  size_t reserved;
  if (__builtin_add_overflow(mapped, spare, &reserved)) return nullptr;
  void* raw = ::mmap(nullptr, reserved, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) return nullptr;
  auto* p = static_cast<std::byte*>(raw);
  if (spare > 0) {
    const size_t head = (spare - reinterpret_cast<uintptr_t>(raw) % spare) % spare;
    if (head > 0) ::munmap(raw, head);
    if (spare - head > 0) ::munmap(p + head + mapped, spare - head);
    p += head;
    ::madvise(p, mapped, MADV_HUGEPAGE);  // a hint: where refused, normal pages
  }
  return p;
}

void UnmapPrivate(std::byte* p, size_t bytes) {
  if (p != nullptr) ::munmap(p, PrivateMappedBytes(bytes));
}

PrivateBuffer::PrivateBuffer(size_t bytes) : data_(MapPrivate(bytes)), size_(bytes) {
  if (data_ == nullptr) throw std::bad_alloc();
}

PrivateBuffer& PrivateBuffer::operator=(PrivateBuffer&& other) noexcept {
  if (this != &other) {
    UnmapPrivate(data_, size_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

}  // namespace weightd::io
