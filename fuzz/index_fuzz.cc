// libFuzzer target: the input is a model.safetensors.index.json. It is
// read with simdjson's On-Demand API, which checks only what it reads:
// nothing a full parse of the JSON refuses may be accepted.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "format/checkpoint.h"
#include "format/json.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto map = weightd::format::ParseIndex(
      "fuzz.index.json", std::string_view(reinterpret_cast<const char*>(data), size));
  const simdjson::padded_string padded(reinterpret_cast<const char*>(data), size);
  if (map.ok() && weightd::format::json::DomError(padded.data(), padded.size(),
                                                  weightd::format::json::kMaxIndexDepth))
    __builtin_trap();
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
