// libFuzzer target: the input is a model.safetensors.index.json.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "format/checkpoint.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto map = weightd::format::ParseIndex(
      "fuzz.index.json", std::string_view(reinterpret_cast<const char*>(data), size));
  if (map.ok()) {
    for (size_t i = 1; i < map->size(); ++i) {
      if (!((*map)[i - 1].first < (*map)[i].first)) __builtin_trap();  // sorted, unique
    }
  }
  return 0;
}
