// libFuzzer target: the input is a whole safetensors file. The length
// prefix, the JSON header and the layout validation must return an error,
// never crash, hang or allocate beyond the input's size.
#include <cstddef>
#include <cstdint>
#include <span>

#include "format/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace weightd::format;
  std::span<const std::byte> file(reinterpret_cast<const std::byte*>(data), size);
  auto n = DecodeHeaderLength("fuzz.safetensors", file, size);
  if (!n.ok()) return 0;
  auto header = ParseHeader("fuzz.safetensors", file.subspan(kHeaderLengthBytes, *n), size);
  if (header.ok()) {
    // What a valid header promises: tensors tile the data region exactly.
    uint64_t total = 0;
    for (const TensorInfo& t : header->tensors) total += t.bytes();
    if (total != header->data_bytes || header->file_size() != size) __builtin_trap();
  }
  return 0;
}
