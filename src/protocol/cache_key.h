// The key a resident model is found by. Fields are named so that a miss can
// say which differ ("tp_rank: daemon has 0, engine wants 1"). Paths are never
// part of it: a byte-identical copy of a checkpoint elsewhere is a hit.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "weightd/result.h"

namespace weightd::protocol {

// Bumped whenever what weightd puts into a segment changes, so a daemon
// never serves a layout an engine would read differently.
inline constexpr int kSegmentFormatVersion = 1;

struct CacheKey {
  std::string checkpoint;  // content digest, algorithm-tagged ("xxh3-128:...")
  std::string dtype = "keep";
  std::string quant = "none";
  std::string shard_plan = "replicate";
  std::string plan_digest = "none";
  int tp_size = 1;
  int tp_rank = 0;
  std::string device = "host";
  int format = kSegmentFormatVersion;

  bool operator==(const CacheKey&) const = default;
};

struct FieldDifference {
  std::string field;
  std::string daemon;
  std::string engine;
  // "tp_rank: daemon has 0, engine wants 1"
  std::string Describe() const;
};

// The fields where `held` (the daemon's) and `wanted` (the engine's) differ;
// empty when they are equal. With `skip_checkpoint`, the content digest is
// not compared (trust mode).
std::vector<FieldDifference> Compare(const CacheKey& held, const CacheKey& wanted,
                                     bool skip_checkpoint = false);

nlohmann::json ToJson(const CacheKey& key);
// Every field must be present with the right type.
Result<CacheKey> KeyFromJson(const nlohmann::json& j);

// A checkpoint's shard files by name, with their sizes: its layout as far
// as a stat tells it, for explaining a miss. A fine-tune saved as its base
// was has the same files and sizes (its tensors' bytes are the same; its
// headers differ at most in their metadata); another model has other files
// or sizes.
struct ShardSize {
  std::string name;
  uint64_t bytes = 0;
  bool operator==(const ShardSize&) const = default;
};
// Whether two checkpoints' files are those of one layout: the same names
// (an empty one, a single file's, stands for any), each size within 1%
// (at least 64 KiB) of the other's. Both lists sorted by name.
bool SameLayout(const std::vector<ShardSize>& a, const std::vector<ShardSize>& b);
nlohmann::json ToJson(const std::vector<ShardSize>& shards);
// An array of {"name", "bytes"}, names as PathToJson writes them.
Result<std::vector<ShardSize>> ShardSizesFromJson(const nlohmann::json& j);

// What an engine asks to be done to the weights (the processing flags), as
// they travel. `shard_plan` is a preset's name or a plan file's path; the
// transform layer resolves it (and both sides put its name and digest into
// the key).
struct Processing {
  int tp_size = 1;
  int tp_rank = 0;
  std::string dtype = "keep";
  std::string quant = "none";
  std::string shard_plan = {};  // empty: none named (replicate, where allowed)
  // cpu | cuda:N | cuda:GPU-<uuid>, or one of those per rank, comma-separated.
  std::string device = "cpu";
  // How the checkpoint's content digest is made: sampled (each tensor's
  // first KiB) or full (every byte). Not a key field of its own: the
  // digest's tag (xxh3-128: or sha256:) says it, and the two never match.
  std::string fingerprint = "sampled";

  bool operator==(const Processing&) const = default;
};

// An error naming the flag when the rank or the device cannot be served.
// The rest (--tp-size, --dtype, --quant, --shard-plan) is checked where it is
// parsed, by transform::ResolveProcessing: call that first.
Status CheckSupported(const Processing& p);
// A --device value's devices, in order (one unless it names one per rank).
std::vector<std::string> SplitDevices(const std::string& device);
// The device `rank` goes to: the one device named, or the rank's own.
// REQUIRES: CheckSupported(p) is ok.
std::string DeviceOfRank(const Processing& p, int rank);
// `plan_name` and `plan_digest` are the resolved shard plan's ("llama" or
// "file", and the digest of its rules).
CacheKey MakeKey(const std::string& checkpoint_digest, const Processing& p,
                 const std::string& plan_name, const std::string& plan_digest);
nlohmann::json ToJson(const Processing& p);
Result<Processing> ProcessingFromJson(const nlohmann::json& j);

// A short, human-readable rendering for logs and `status`.
std::string ShortDescription(const CacheKey& key);

}  // namespace weightd::protocol
