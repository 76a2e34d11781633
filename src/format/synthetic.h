// Synthetic checkpoints for tests, benchmarks and the demo: the layouts of
// real models with pseudo-random values, the same bytes for the same options
// and seed. Presets:
//   tiny          a few small tensors of several dtypes, one shard
//   llama         embed, per-layer q/k/v/o, gate/up/down, norms, lm_head in
//                 BF16, sharded with an index; sized by size_bytes or by
//                 layers/hidden
//   many-tensors  tens of thousands of small tensors over several shards
//   k3-layout     a trillion-parameter MoE layout (about 70,000 tensors over
//                 50 shards of about 20 GB) as sparse files: each tensor's
//                 first 4 KiB is real, the rest a hole
// The finetune variant keeps every name, shape and offset and changes every
// tensor's values (its first bytes included), as a fine-tune of a base model
// would.
//
// Thread safety: reentrant; writes to distinct directories may run at once.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "format/writer.h"

namespace weightd::format {

struct SyntheticOptions {
  std::string preset;
  uint64_t seed = 0;
  bool finetune = false;
  uint64_t size_bytes = 0;  // llama: approximate total; 0 = 512 MiB
  int layers = 0;           // llama, k3-layout; 0 = derived
  int hidden = 0;           // llama; 0 = derived
  int experts = 0;          // k3-layout; 0 = 384
  uint64_t tensors = 0;     // many-tensors; 0 = 70,000
  int shards = 0;           // 0 = the preset's default
};

struct PlannedShard {
  std::string name;
  std::vector<TensorSpec> tensors;
};

struct SyntheticPlan {
  std::vector<PlannedShard> shards;
  bool sparse = false;  // k3-layout
  bool with_index = false;
  uint64_t data_bytes = 0;
  uint64_t tensor_count = 0;
};

// What a preset produces, without writing anything (also what `inspect`
// would report for the written checkpoint).
Result<SyntheticPlan> PlanSyntheticCheckpoint(const SyntheticOptions& options);

// The pseudo-random bytes of one tensor at `offset`. Values are finite and
// small for float dtypes; the same (seed, variant, name, offset) always gives
// the same bytes, however the tensor is cut into calls.
void FillSyntheticTensor(uint64_t seed, bool finetune, const TensorInfo& tensor, uint64_t offset,
                         std::span<std::byte> dst);

// Writes the checkpoint into `out_dir`, which must not exist or be empty. It
// is built in a sibling temporary directory and renamed into place, so a
// failure or a kill leaves no partial checkpoint under `out_dir`.
// `progress` (optional) is called after each shard with (shards done, total).
Result<SyntheticPlan> WriteSyntheticCheckpoint(
    const std::string& out_dir, const SyntheticOptions& options,
    const std::function<void(size_t done, size_t total)>& progress = {});

}  // namespace weightd::format
