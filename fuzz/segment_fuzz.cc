// libFuzzer target: the input is the start of a segment as an engine maps
// it (or, its first half, a GPU segment's manifest copy). The manifest
// reader must return an error or records that all lie inside the segment;
// never crash or read outside it.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "memory/manifest.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // Mapped segments are page aligned; give the reader the same.
  std::vector<uint64_t> aligned((size + 7) / 8 + 1);
  if (size > 0) std::memcpy(aligned.data(), data, size);
  std::span<const std::byte> segment(reinterpret_cast<const std::byte*>(aligned.data()), size);
  // `manifest`: the bytes in hand (all of a host segment, or a GPU
  // segment's manifest copy: here its first half); names and shapes must lie
  // in those, tensors in the segment's `size`.
  auto check = [&](std::span<const std::byte> manifest) {
    auto m = weightd::memory::ReadManifest(manifest, size);
    if (!m.ok()) return;
    const std::byte* begin = manifest.data();
    const std::byte* end = begin + manifest.size();
    for (const auto& t : m->tensors) {
      const auto* name = reinterpret_cast<const std::byte*>(t.name.data());
      const auto* shape = reinterpret_cast<const std::byte*>(t.shape.data());
      if (name < begin || name + t.name.size() > end) __builtin_trap();
      if (!t.shape.empty() && (shape < begin || shape + t.shape.size_bytes() > end)) {
        __builtin_trap();
      }
      if (t.offset + t.bytes > size || t.offset < m->data_offset) __builtin_trap();
    }
  };
  check(segment);
  check(segment.first(size / 2));
  return 0;
}
