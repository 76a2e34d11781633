// libFuzzer target: the input is the start of a segment as an engine maps
// it. The manifest reader must return an error or records that all lie
// inside the segment; never crash or read outside it.
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
  auto m = weightd::memory::ReadManifest(segment);
  if (!m.ok()) return 0;
  const std::byte* begin = segment.data();
  const std::byte* end = begin + segment.size();
  for (const auto& t : m->tensors) {
    const auto* name = reinterpret_cast<const std::byte*>(t.name.data());
    const auto* shape = reinterpret_cast<const std::byte*>(t.shape.data());
    if (name < begin || name + t.name.size() > end) __builtin_trap();
    if (!t.shape.empty() && (shape < begin || shape + t.shape.size_bytes() > end)) __builtin_trap();
    if (t.offset + t.bytes > size || t.offset < m->data_offset) __builtin_trap();
  }
  return 0;
}
