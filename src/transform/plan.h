// The processing plan: how each tensor is split across tensor-parallel
// ranks and what happens to its values (a cast, FP8 block quantization),
// decided from the headers alone. Every check that needs no weight bytes
// runs here, so a checkpoint the plan cannot serve fails before a single
// weight byte is read, with the tensor and the rule named.
//
// Splits: `column` cuts dim 0, `row` dim 1, `vocab` dim 0 padded with zero
// rows to a multiple of the rank count, `replicate` gives every rank all of
// it. A shard plan's rules are POSIX extended regular expressions searched
// in tensor names (anchor them with ^ and $); the first that matches
// decides, and a tensor no rule matches is replicated.
//
// Thread safety: plans are immutable once built; share them freely.
#pragma once

#include <regex.h>

#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "format/checkpoint.h"
#include "format/dtype.h"
#include "weightd/result.h"

namespace weightd::transform {

enum class Split { kReplicate, kColumn, kRow, kVocab };
std::string_view SplitName(Split split);

struct ShardRule {
  std::string match;  // POSIX extended regular expression
  Split split = Split::kReplicate;
};

class ShardPlan {
 public:
  // A preset ("llama", "replicate") or the path of a TOML plan file:
  //   [[rule]]
  //   match = '(^|\.)(q_proj|k_proj)\.weight$'
  //   split = "column"
  static Result<std::shared_ptr<const ShardPlan>> Load(const std::string& preset_or_file);
  // `name` is what the cache key shows: the preset's, or "file".
  static Result<std::shared_ptr<const ShardPlan>> FromRules(std::string name,
                                                            std::vector<ShardRule> rules);
  static Result<std::shared_ptr<const ShardPlan>> FromToml(std::string_view text,
                                                           const std::string& label);

  ShardPlan(const ShardPlan&) = delete;
  ShardPlan& operator=(const ShardPlan&) = delete;
  ~ShardPlan();

  const std::string& name() const { return name_; }
  // "xxh3-64:<hex>" of the rules, in order: equal rules, equal digests,
  // whatever the file was called.
  const std::string& digest() const { return digest_; }
  const std::vector<ShardRule>& rules() const { return rules_; }
  Split SplitOf(const std::string& tensor) const;

 private:
  ShardPlan() = default;
  std::string name_;
  std::string digest_;
  std::vector<ShardRule> rules_;
  std::vector<regex_t> compiled_;
};

std::vector<std::string> ShardPlanPresets();
// Whether a --shard-plan value names a file (a path, or *.toml) rather than
// a preset.
bool IsPlanFile(const std::string& spec);

// What an engine asked for, resolved: the cast target, quantization, the
// rank count and the plan.
struct Processing {
  int tp_size = 1;
  std::optional<format::DType> dtype;  // nullopt: keep
  bool fp8_block = false;
  std::shared_ptr<const ShardPlan> plan;  // never null

  std::string DTypeName() const;  // "keep", "bf16", ...
  std::string QuantName() const;  // "none", "fp8-block"
};

// Checks the flags' values. An empty `shard_plan` names none: fine for one
// rank without quantization, an error otherwise (the plan says what is split
// and what is quantized). With one rank and no quantization the plan changes
// nothing, so it becomes `replicate` (and keys agree).
Result<Processing> ResolveProcessing(int tp_size, const std::string& dtype,
                                     const std::string& quant, const std::string& shard_plan);

// A tensor as the headers describe it: views into the parsed header, which
// must outlive it (a plan of 70,000 tensors copies no names to make one).
struct SourceTensor {
  std::string_view name;
  format::DType dtype = format::DType::kU8;
  std::span<const uint64_t> shape;
  uint64_t bytes = 0;
};

enum class Op {
  kCopy,      // bytes as they are (split, maybe padded)
  kCast,      // to Processing::dtype
  kQuantize,  // to F8_E4M3, with a new `<name>_scale_inv`
  kScale,     // the new `<name>_scale_inv` of the kQuantize output before it
};
std::string_view OpName(Op op);

// One tensor of every rank's segment. Every rank's has the same shape.
struct OutputTensor {
  std::string_view name;  // its source's, or one in TensorPlan::made_names
  format::DType dtype = format::DType::kU8;
  std::vector<uint64_t> shape;
  uint64_t bytes = 0;  // per rank
  size_t source = 0;   // index into the sources (kScale: its weight's)
  Split split = Split::kReplicate;
  Op op = Op::kCopy;
  // kQuantize: the index of its kScale output in TensorPlan::outputs.
  size_t scale = 0;

  // The geometry, in elements. A tensor is `rows` rows (dim 0; 1 for a
  // scalar) of `row_elems` each. Rank r's row i is source row
  // row_offset(r) + i, zeros where that is past `source_rows` (vocab
  // padding), and within it elements [col_offset(r), + row_elems).
  uint64_t rows = 1;
  uint64_t row_elems = 1;
  uint64_t source_rows = 1;
  uint64_t source_row_elems = 1;
  uint64_t RowOffset(int rank) const;
  uint64_t ColOffset(int rank) const;
};

struct TensorPlan {
  std::vector<OutputTensor> outputs;  // by name
  // Names of the tensors the plan makes (block scales); the others' are
  // their sources'. On the heap, so that moving the plan keeps the outputs'
  // views valid (and the plan cannot be copied, for the same reason).
  std::unique_ptr<std::deque<std::string>> made_names = std::make_unique<std::deque<std::string>>();
  uint64_t bytes_per_rank = 0;  // tensor bytes, before alignment
};

// Every tensor of the shards' headers, by name.
std::vector<SourceTensor> SourcesOf(const std::vector<format::Shard>& shards);

// Plans every tensor, or an error naming the first tensor the plan cannot
// serve and why. `sources` by name.
Result<TensorPlan> PlanTensors(const std::vector<SourceTensor>& sources, const Processing& p);

}  // namespace weightd::transform
