// libFuzzer target: the input is a model.safetensors.index.json.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "format/checkpoint.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto map = weightd::format::ParseIndex(
      "fuzz.index.json", std::string_view(reinterpret_cast<const char*>(data), size));
  if (map.ok()) {
    const auto& entries = map->entries();
    for (size_t i = 1; i < entries.size(); ++i) {
      if (!(entries[i - 1].tensor < entries[i].tensor)) __builtin_trap();  // sorted, unique
    }
    for (const auto& e : entries) {
      if (e.shard >= map->shards().size()) __builtin_trap();
    }
  }
  return 0;
}
