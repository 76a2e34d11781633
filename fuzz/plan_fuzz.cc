// libFuzzer target: the input is a shard plan file (TOML rules).
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "transform/plan.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  auto plan = weightd::transform::ShardPlan::FromToml(text, "fuzz.toml");
  if (!plan.ok()) return 0;
  // Rules that parsed match names, and the digest depends on the rules only.
  for (const char* name : {"model.layers.0.self_attn.q_proj.weight", "lm_head.weight", "", "x"}) {
    (void)(*plan)->SplitOf(name);
  }
  auto again = weightd::transform::ShardPlan::FromToml(text, "other.toml");
  if (!again.ok() || (*again)->digest() != (*plan)->digest()) __builtin_trap();
  return 0;
}
