#include "transform/plan.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <toml++/toml.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <limits>

#include "transform/convert.h"

namespace weightd::transform {
namespace {

using format::DType;

constexpr std::string_view kScaleSuffix = "_scale_inv";
constexpr uint64_t kMaxPlanFileBytes = 1 << 20;

// Llama, Mistral (Mixtral's experts too) and Qwen naming.
std::vector<ShardRule> LlamaRules() {
  return {
      {R"((^|\.)(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|bias)$)", Split::kColumn},
      {R"((^|\.)experts\.[0-9]+\.(w1|w3)\.weight$)", Split::kColumn},
      {R"((^|\.)(o_proj|down_proj)\.weight$)", Split::kRow},
      {R"((^|\.)experts\.[0-9]+\.w2\.weight$)", Split::kRow},
      {R"((^|\.)(embed_tokens|lm_head)\.weight$)", Split::kVocab},
  };
}

std::optional<Split> ParseSplit(std::string_view s) {
  for (Split split : {Split::kReplicate, Split::kColumn, Split::kRow, Split::kVocab}) {
    if (SplitName(split) == s) return split;
  }
  return std::nullopt;
}

// Projections that hold q, k and v (or gate and up) in one tensor beside
// the o_proj and down_proj the llama preset splits by rows (Phi-3): a rank
// needs its slice of each part, which no single split gives. (GPT-NeoX's
// query_key_value, GPT-2's c_attn and MPT's Wqkv come with output layers
// the preset does not split either: all replicated, a layout that holds.)
bool IsFusedProjection(std::string_view name) {
  for (std::string_view fused : {"qkv_proj.", "gate_up_proj."}) {
    const size_t at = name.rfind(fused);
    if (at != std::string_view::npos && (at == 0 || name[at - 1] == '.')) return true;
  }
  return false;
}

// Names of tensors from quantization formats whose packing or scales weightd
// does not know how to split or convert.
std::optional<std::string_view> ForeignQuantization(std::string_view name) {
  struct Known {
    std::string_view suffix;
    std::string_view format;
  };
  static constexpr Known kKnown[] = {
      {".qweight", "GPTQ/AWQ packed int4"},
      {".qzeros", "GPTQ/AWQ packed int4"},
      {".g_idx", "GPTQ packed int4"},
      {".scales", "GPTQ/AWQ packed int4"},
      {".weight_packed", "compressed-tensors packed int4"},
      {".weight_zero_point", "compressed-tensors"},
      {".weight_scale", "compressed-tensors (per-tensor or per-channel scales)"},
      {".input_scale", "compressed-tensors (activation scales)"},
      {".absmax", "bitsandbytes"},
      {".quant_map", "bitsandbytes"},
      {".SCB", "bitsandbytes int8"},
  };
  for (const Known& k : kKnown) {
    if (name.ends_with(k.suffix)) return k.format;
  }
  if (name.find(".quant_state.") != std::string_view::npos) return "bitsandbytes";
  return std::nullopt;
}

Error TensorError(std::string_view name, const std::string& why) {
  return Error("tensor `" + std::string(name) + "`: " + why);
}

bool Mul(uint64_t a, uint64_t b, uint64_t* out) { return !__builtin_mul_overflow(a, b, out); }

// The regular expressions a plan may use. glibc compiles repetition by
// copying what it repeats, so stacked or nested repetition (`a++++`,
// `((a+)+)+`, `(a?a?a?…)+`, `a{1000}`) takes memory and time far beyond
// the pattern's size (a third of a second and 10 MB for one of 255
// characters), and back-references make matching exponential: a plan file
// (read from disk, untrusted) gets the subset tensor names need, with the
// reason when not.
Status CheckPattern(const std::string& match) {
  constexpr size_t kMaxPattern = 256;
  constexpr int kMaxDepth = 3;
  const auto refuse = [&](const std::string& why) {
    return Error("shard plan rule `" + match + "`: " + why);
  };
  if (match.size() > kMaxPattern) return refuse("longer than 256 characters");
  // Tensor names hold none, and the plan's digest separates rules with
  // tabs and newlines: a rule holding them could spell two rules, and two
  // different plans would share a digest (and a resident model).
  for (const char c : match) {
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) {
      return refuse("control characters (tabs, newlines) are not allowed");
    }
  }
  int depth = 0;
  bool can_repeat = false;  // the last thing was an atom a quantifier may follow
  // Per open group (and the whole pattern, at 0): whether it holds a
  // repetition; and whether the last atom was a group that did.
  bool holds_repetition[kMaxDepth + 1] = {};
  bool last_group_repeats = false;
  for (size_t i = 0; i < match.size(); ++i) {
    const bool after_group = last_group_repeats;
    last_group_repeats = false;
    const char c = match[i];
    if (c == '\\') {
      if (i + 1 < match.size() && match[i + 1] >= '1' && match[i + 1] <= '9') {
        return refuse("back-references are not allowed");
      }
      ++i;
      can_repeat = true;
    } else if (c == '[') {  // a bracket expression is one atom
      size_t j = i + 1;
      if (j < match.size() && match[j] == '^') ++j;
      if (j < match.size() && match[j] == ']') ++j;
      while (j < match.size() && match[j] != ']') {
        // [:alpha:], [=a=] and [.a.] end at their own closing pair.
        if (match[j] == '[' && j + 1 < match.size() &&
            (match[j + 1] == ':' || match[j + 1] == '=' || match[j + 1] == '.')) {
          const char kind = match[j + 1];
          size_t k = j + 2;
          while (k + 1 < match.size() && !(match[k] == kind && match[k + 1] == ']')) ++k;
          if (k + 1 >= match.size()) return refuse("an unclosed [" + std::string(1, kind));
          j = k + 2;
          continue;
        }
        ++j;
      }
      if (j >= match.size()) return refuse("an unclosed bracket expression");
      i = j;
      can_repeat = true;
    } else if (c == '(') {
      if (++depth > kMaxDepth) return refuse("groups nested more than 3 deep");
      holds_repetition[depth] = false;
      can_repeat = false;
    } else if (c == ')') {
      if (depth == 0) return refuse("a ) without its (");
      last_group_repeats = holds_repetition[depth];
      holds_repetition[depth - 1] |= holds_repetition[depth];
      --depth;
      can_repeat = true;
    } else if (c == '*' || c == '+' || c == '?') {
      if (!can_repeat) return refuse("a repetition must follow a character, class or group, once");
      if (after_group) return refuse("a repeated group must not hold a repetition itself");
      holds_repetition[depth] = true;
      can_repeat = false;
    } else if (c == '{') {
      return refuse("counted repetition ({m,n}) is not allowed; use +, * or ?");
    } else if (c == '|' || c == '^') {
      can_repeat = false;
    } else {
      can_repeat = true;
    }
  }
  return OkStatus();
}

// The output geometry of `s` under `split` over `n` ranks.
Result<OutputTensor> Cut(const SourceTensor& s, Split split, int n) {
  OutputTensor o;
  o.name = s.name;
  o.dtype = s.dtype;
  o.shape.assign(s.shape.begin(), s.shape.end());
  o.split = split;
  const auto ranks = static_cast<uint64_t>(n);
  // For errors only: not built for the 70,000 tensors that have none.
  auto how = [&] { return std::string(SplitName(split)) + " split"; };
  uint64_t rest = 1;
  for (size_t d = 1; d < s.shape.size(); ++d) {
    if (!Mul(rest, s.shape[d], &rest)) return TensorError(s.name, "too many elements");
  }
  o.source_rows = s.shape.empty() ? 1 : s.shape[0];
  o.source_row_elems = rest;
  o.rows = o.source_rows;
  o.row_elems = rest;
  switch (split) {
    case Split::kReplicate:
      break;
    case Split::kColumn:
    case Split::kVocab:
      if (s.shape.empty())
        return TensorError(s.name, how() + " cuts dim 0; the tensor is a scalar");
      if (split == Split::kColumn && o.source_rows % ranks != 0) {
        return TensorError(s.name, how() + ": dim 0 (" + std::to_string(o.source_rows) +
                                       ") is not divisible by --tp-size " + std::to_string(n));
      }
      o.rows = CeilDiv(o.source_rows, ranks);
      o.shape[0] = o.rows;
      break;
    case Split::kRow: {
      if (s.shape.size() < 2) {
        return TensorError(s.name, how() + " cuts dim 1; the tensor has " +
                                       std::to_string(s.shape.size()) + " dimension(s)");
      }
      if (s.shape[1] % ranks != 0) {
        return TensorError(s.name, how() + ": dim 1 (" + std::to_string(s.shape[1]) +
                                       ") is not divisible by --tp-size " + std::to_string(n));
      }
      o.shape[1] = s.shape[1] / ranks;
      o.row_elems = rest / ranks;
      break;
    }
  }
  const uint64_t bits = format::DTypeBits(s.dtype);
  if (split != Split::kReplicate && n > 1 && bits % 8 != 0 &&
      ((o.source_row_elems * bits) % 8 != 0 || (o.row_elems * bits) % 8 != 0)) {
    return TensorError(s.name, how() + ": packed " + std::string(format::DTypeName(s.dtype)) +
                                   " elements would be cut inside a byte");
  }
  uint64_t elements, total_bits;
  if (!Mul(o.rows, o.row_elems, &elements) || !Mul(elements, bits, &total_bits)) {
    return TensorError(s.name, "too many elements");
  }
  o.bytes = total_bits / 8;
  return o;
}

// Checks a pre-quantized FP8 weight's block scales against the weight and
// the split, and cuts them the same way, in whole 128x128 blocks.
Result<OutputTensor> CutScale(const SourceTensor& weight, const OutputTensor& cut_weight,
                              const SourceTensor& scale, int n) {
  if (weight.shape.size() != 2) {
    return TensorError(scale.name, "block scales for a weight that is not a matrix");
  }
  const uint64_t block_rows = CeilDiv(weight.shape[0], kFp8Block);
  const uint64_t block_cols = CeilDiv(weight.shape[1], kFp8Block);
  if (scale.dtype != DType::kF32 && scale.dtype != DType::kBF16) {
    return TensorError(scale.name, "block scales must be F32 or BF16");
  }
  if (scale.shape.size() != 2 || scale.shape[0] != block_rows || scale.shape[1] != block_cols) {
    return TensorError(scale.name, "block scales of shape [" + std::to_string(block_rows) + ", " +
                                       std::to_string(block_cols) +
                                       "] (128x128 blocks of its weight) expected");
  }
  const std::string whole_blocks = " per rank, which cuts a 128x128 FP8 block";
  switch (cut_weight.split) {
    case Split::kColumn:
      if (n > 1 && cut_weight.rows % kFp8Block != 0) {
        return TensorError(weight.name, "column split gives " + std::to_string(cut_weight.rows) +
                                            " rows" + whole_blocks);
      }
      break;
    case Split::kRow:
      if (n > 1 && cut_weight.row_elems % kFp8Block != 0) {
        return TensorError(weight.name, "row split gives " + std::to_string(cut_weight.row_elems) +
                                            " columns" + whole_blocks);
      }
      break;
    case Split::kVocab:
      if (n > 1) return TensorError(weight.name, "vocab split of FP8 block-scaled weights");
      break;
    case Split::kReplicate:
      break;
  }
  return Cut(scale, cut_weight.split, n);
}

const SourceTensor* FindSource(const std::vector<SourceTensor>& sources, std::string_view name) {
  auto it = std::lower_bound(sources.begin(), sources.end(), name,
                             [](const SourceTensor& t, std::string_view n) { return t.name < n; });
  return it != sources.end() && it->name == name ? &*it : nullptr;
}

bool IsFp8(DType d) {
  return d == DType::kF8_E4M3 || d == DType::kF8_E5M2 || d == DType::kF8_E4M3FNUZ ||
         d == DType::kF8_E5M2FNUZ;
}

}  // namespace

std::string_view SplitName(Split split) {
  switch (split) {
    case Split::kReplicate:
      return "replicate";
    case Split::kColumn:
      return "column";
    case Split::kRow:
      return "row";
    case Split::kVocab:
      return "vocab";
  }
  return "?";
}

std::string_view OpName(Op op) {
  switch (op) {
    case Op::kCopy:
      return "copy";
    case Op::kCast:
      return "cast";
    case Op::kQuantize:
      return "fp8-block";
    case Op::kScale:
      return "fp8 scales";
  }
  return "?";
}

ShardPlan::~ShardPlan() {
  for (regex_t& r : compiled_) ::regfree(&r);
}

Result<std::shared_ptr<const ShardPlan>> ShardPlan::FromRules(std::string name,
                                                              std::vector<ShardRule> rules) {
  // Every rule is tried on every tensor's name (70,000 of them in a large
  // MoE): a plan needs a few dozen.
  constexpr size_t kMaxRules = 128;
  if (rules.size() > kMaxRules) {
    return Error("a shard plan holds at most " + std::to_string(kMaxRules) + " rules, not " +
                 std::to_string(rules.size()));
  }
  std::shared_ptr<ShardPlan> plan(new ShardPlan());
  plan->name_ = std::move(name);
  std::string canonical = "weightd shard plan 1\n";
  for (const ShardRule& rule : rules) {
    WEIGHTD_RETURN_IF_ERROR(CheckPattern(rule.match));
    regex_t re;
    if (int err = ::regcomp(&re, rule.match.c_str(), REG_EXTENDED | REG_NOSUB); err != 0) {
      char why[256];
      ::regerror(err, &re, why, sizeof why);
      return Error("shard plan rule `" + rule.match + "`: " + why);
    }
    plan->compiled_.push_back(re);
    canonical += std::string(SplitName(rule.split)) + "\t" + rule.match + "\n";
  }
  plan->rules_ = std::move(rules);
  char hex[32];
  std::snprintf(hex, sizeof hex, "%016llx",
                static_cast<unsigned long long>(XXH3_64bits(canonical.data(), canonical.size())));
  plan->digest_ = std::string("xxh3-64:") + hex;
  return std::shared_ptr<const ShardPlan>(std::move(plan));
}

Result<std::shared_ptr<const ShardPlan>> ShardPlan::FromToml(std::string_view text,
                                                             const std::string& label) {
  toml::table table;
  try {
    table = toml::parse(text, label);
  } catch (const toml::parse_error& e) {
    return Error(label + ": not a TOML shard plan: " + std::string(e.description()));
  }
  std::vector<ShardRule> rules;
  for (const auto& [key, value] : table) {
    if (key.str() != "rule") {
      return Error(label + ": unknown key `" + std::string(key.str()) + "` (only [[rule]])");
    }
    const toml::array* list = value.as_array();
    if (list == nullptr) return Error(label + ": `rule` must be an array of tables ([[rule]])");
    for (const toml::node& node : *list) {
      const toml::table* t = node.as_table();
      if (t == nullptr) return Error(label + ": every [[rule]] must be a table");
      ShardRule rule;
      std::optional<std::string> match, split;
      for (const auto& [k, v] : *t) {
        if (k.str() == "match") {
          match = v.value<std::string>();
        } else if (k.str() == "split") {
          split = v.value<std::string>();
        } else {
          return Error(label + ": rule " + std::to_string(rules.size() + 1) + ": unknown key `" +
                       std::string(k.str()) + "` (match, split)");
        }
      }
      if (!match || !split) {
        return Error(label + ": rule " + std::to_string(rules.size() + 1) +
                     " needs a `match` and a `split` string");
      }
      auto kind = ParseSplit(*split);
      if (!kind) {
        return Error(label + ": rule " + std::to_string(rules.size() + 1) + ": unknown split `" +
                     *split + "` (column, row, vocab, replicate)");
      }
      rules.push_back({*match, *kind});
    }
  }
  auto plan = FromRules("file", std::move(rules));
  if (!plan.ok()) return Error(label + ": " + plan.error().message());
  return plan;
}

Result<std::shared_ptr<const ShardPlan>> ShardPlan::Load(const std::string& spec) {
  // Presets are compiled once: every engine start resolves one.
  if (spec == "llama") {
    static const auto llama = FromRules("llama", LlamaRules());
    return llama;
  }
  if (spec == "replicate") {
    static const auto replicate = FromRules("replicate", {});
    return replicate;
  }
  if (!IsPlanFile(spec)) {
    return Error("unknown shard plan `" + spec +
                 "` (presets: llama, replicate; or the path of a TOML plan file)");
  }
  // A regular file only: a FIFO named here (the daemon resolves plans that
  // requests name) must not block a connection waiting for a writer.
  const int fd = ::open(spec.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) return Error(spec + ": cannot read the shard plan: " + std::strerror(errno));
  struct stat st;
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return Error(spec + ": a shard plan must be a regular file");
  }
  std::string text(kMaxPlanFileBytes + 1, '\0');
  size_t got = 0;
  while (got < text.size()) {
    const ssize_t n = ::read(fd, text.data() + got, text.size() - got);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int err = errno;
      ::close(fd);
      return Error(spec + ": cannot read the shard plan: " + std::strerror(err));
    }
    if (n == 0) break;
    got += static_cast<size_t>(n);
  }
  ::close(fd);
  text.resize(got);
  if (text.size() > kMaxPlanFileBytes) return Error(spec + ": a shard plan is at most 1 MiB");
  return FromToml(text, spec);
}

Split ShardPlan::SplitOf(const std::string& tensor) const {
  for (size_t i = 0; i < compiled_.size(); ++i) {
    // The whole name, a NUL in it (a header may spell one) included: not
    // the part before it, which another tensor's name may be.
    if (tensor.size() > static_cast<size_t>(std::numeric_limits<regoff_t>::max())) break;
    regmatch_t whole{0, static_cast<regoff_t>(tensor.size())};
    if (::regexec(&compiled_[i], tensor.data(), 1, &whole, REG_STARTEND) == 0) {
      return rules_[i].split;
    }
  }
  return Split::kReplicate;
}

std::vector<std::string> ShardPlanPresets() { return {"llama", "replicate"}; }

bool IsPlanFile(const std::string& spec) {
  return spec.find('/') != std::string::npos || spec.ends_with(".toml");
}

std::string Processing::DTypeName() const {
  if (!dtype) return "keep";
  switch (*dtype) {
    case DType::kBF16:
      return "bf16";
    case DType::kF16:
      return "fp16";
    default:
      return "fp32";
  }
}

std::string Processing::QuantName() const { return fp8_block ? "fp8-block" : "none"; }

Result<Processing> ResolveProcessing(int tp_size, const std::string& dtype,
                                     const std::string& quant, const std::string& shard_plan) {
  Processing p;
  if (tp_size < 1 || tp_size > 1024) {
    return Error("--tp-size " + std::to_string(tp_size) + " must be between 1 and 1024");
  }
  p.tp_size = tp_size;
  if (dtype == "bf16") {
    p.dtype = DType::kBF16;
  } else if (dtype == "fp16") {
    p.dtype = DType::kF16;
  } else if (dtype == "fp32") {
    p.dtype = DType::kF32;
  } else if (dtype != "keep") {
    return Error("--dtype " + dtype + ": one of keep, bf16, fp16, fp32");
  }
  if (quant == "fp8-block") {
    p.fp8_block = true;
  } else if (quant != "none") {
    return Error("--quant " + quant + ": one of none, fp8-block");
  }
  if (shard_plan.empty() && (tp_size > 1 || p.fp8_block)) {
    return Error("name a --shard-plan (llama, replicate or a TOML file): it decides " +
                 std::string(tp_size > 1
                                 ? "what is split across the " + std::to_string(tp_size) + " ranks"
                                 : "what is quantized") +
                 (tp_size > 1 && p.fp8_block ? " and what is quantized" : ""));
  }
  auto plan = ShardPlan::Load(shard_plan.empty() ? "replicate" : shard_plan);
  if (!plan.ok()) return Error("--shard-plan: " + plan.error().message());
  p.plan = std::move(plan).value();
  if (tp_size == 1 && !p.fp8_block && p.plan->name() != "replicate") {
    p.plan = ShardPlan::Load("replicate").value();
  }
  return p;
}

uint64_t OutputTensor::RowOffset(int rank) const {
  return split == Split::kColumn || split == Split::kVocab ? static_cast<uint64_t>(rank) * rows : 0;
}

uint64_t OutputTensor::ColOffset(int rank) const {
  return split == Split::kRow ? static_cast<uint64_t>(rank) * row_elems : 0;
}

std::vector<SourceTensor> SourcesOf(const std::vector<format::Shard>& shards) {
  const std::vector<std::pair<size_t, size_t>> by_name = format::TensorsByName(shards);
  std::vector<SourceTensor> sources;
  sources.reserve(by_name.size());
  for (const auto& [s, i] : by_name) {
    const format::TensorInfo& t = shards[s].header.tensors[i];
    sources.push_back({t.name, t.dtype, t.shape, t.bytes()});
  }
  return sources;
}

Result<TensorPlan> PlanTensors(const std::vector<SourceTensor>& sources, const Processing& p) {
  TensorPlan plan;
  const int n = p.tp_size;
  const bool identity = n == 1 && !p.dtype && !p.fp8_block;
  plan.outputs.reserve(sources.size());
  for (size_t i = 0; i < sources.size(); ++i) {
    const SourceTensor& s = sources[i];
    if (identity) {  // every tensor as it is, whatever its format
      WEIGHTD_ASSIGN_OR_RETURN(OutputTensor o, Cut(s, Split::kReplicate, 1));
      o.source = i;
      plan.outputs.push_back(std::move(o));
      continue;
    }
    if (auto foreign = ForeignQuantization(s.name)) {
      return TensorError(s.name, "quantized format weightd does not understand (" +
                                     std::string(*foreign) +
                                     "); it can pass through only with --tp-size 1, --dtype keep "
                                     "and --quant none");
    }
    if (n > 1 && p.plan->name() == "llama" && IsFusedProjection(s.name)) {
      return TensorError(s.name,
                         "a fused projection (q, k and v, or gate and up, in one tensor): the "
                         "llama preset would replicate it while it splits the layer after it; "
                         "this layout needs a plan of its own");
    }
    if (s.name.ends_with(kScaleSuffix)) {
      const std::string weight_name(s.name.substr(0, s.name.size() - kScaleSuffix.size()));
      const SourceTensor* weight = FindSource(sources, weight_name);
      if (weight == nullptr) {
        return TensorError(s.name, "block scales without their weight `" + weight_name + "`");
      }
      if (!IsFp8(weight->dtype)) {
        return TensorError(s.name, "block scales for `" + weight_name + "`, which is " +
                                       std::string(format::DTypeName(weight->dtype)) + ", not FP8");
      }
      continue;  // cut with its weight, below
    }
    // One rank cuts nothing; the rule still says what is a layer to quantize.
    const Split rule = p.plan->SplitOf(std::string(s.name));
    const Split split = n == 1 ? Split::kReplicate : rule;
    WEIGHTD_ASSIGN_OR_RETURN(OutputTensor o, Cut(s, split, n));
    o.source = i;
    const SourceTensor* scale =
        FindSource(sources, std::string(s.name) + std::string(kScaleSuffix));
    if (scale != nullptr) {  // pre-quantized: weight and scales pass through, cut alike
      WEIGHTD_ASSIGN_OR_RETURN(OutputTensor cut_scale, CutScale(s, o, *scale, n));
      cut_scale.source = static_cast<size_t>(scale - sources.data());
      plan.outputs.push_back(std::move(o));
      plan.outputs.push_back(std::move(cut_scale));
      continue;
    }
    const bool linear = rule == Split::kColumn || rule == Split::kRow;
    const bool float_source =
        s.dtype == DType::kBF16 || s.dtype == DType::kF16 || s.dtype == DType::kF32;
    if (p.fp8_block && linear && s.shape.size() == 2 && float_source) {
      o.op = Op::kQuantize;
      o.dtype = DType::kF8_E4M3;
      if (!Mul(o.rows, o.row_elems, &o.bytes)) return TensorError(s.name, "too many elements");
      OutputTensor sc;
      sc.name = plan.made_names->emplace_back(std::string(s.name) + std::string(kScaleSuffix));
      sc.dtype = DType::kF32;
      sc.rows = CeilDiv(o.rows, kFp8Block);
      sc.row_elems = CeilDiv(o.row_elems, kFp8Block);
      sc.shape = {sc.rows, sc.row_elems};
      sc.bytes = sc.rows * sc.row_elems * 4;  // at most rows * cols / 4096: no overflow
      sc.source = i;
      sc.split = split;
      sc.op = Op::kScale;
      plan.outputs.push_back(std::move(o));
      plan.outputs.push_back(std::move(sc));
      continue;
    }
    if (p.dtype && IsCastSource(s.dtype) && s.dtype != *p.dtype) {
      o.op = Op::kCast;
      o.dtype = *p.dtype;
      uint64_t elements;
      if (!Mul(o.rows, o.row_elems, &elements) ||
          !Mul(elements, format::DTypeBits(o.dtype) / 8, &o.bytes)) {
        return TensorError(s.name, "too many elements");
      }
    }
    plan.outputs.push_back(std::move(o));
  }
  // Outputs come in the sources' order, by name, with new scales after their
  // weights; only a checkpoint that quantizes has some to move.
  auto by_name = [](const OutputTensor& a, const OutputTensor& b) { return a.name < b.name; };
  if (!std::is_sorted(plan.outputs.begin(), plan.outputs.end(), by_name)) {
    std::sort(plan.outputs.begin(), plan.outputs.end(), by_name);
  }
  for (size_t i = 1; i < plan.outputs.size(); ++i) {
    if (plan.outputs[i].name == plan.outputs[i - 1].name) {
      return TensorError(plan.outputs[i].name, "produced twice (a scale name already taken)");
    }
  }
  // Each quantized weight's scales, by name: other names may sort between.
  for (OutputTensor& o : plan.outputs) {
    if (o.op != Op::kQuantize) continue;
    const std::string scale_name = std::string(o.name) + std::string(kScaleSuffix);
    auto it = std::lower_bound(
        plan.outputs.begin(), plan.outputs.end(), scale_name,
        [](const OutputTensor& t, const std::string& wanted) { return t.name < wanted; });
    if (it == plan.outputs.end() || it->name != scale_name || it->op != Op::kScale) {
      return TensorError(o.name, "its block scales are missing from the plan");
    }
    o.scale = static_cast<size_t>(it - plan.outputs.begin());
  }
  for (const OutputTensor& o : plan.outputs) {
    if (__builtin_add_overflow(plan.bytes_per_rank, o.bytes, &plan.bytes_per_rank)) {
      return Error("the tensors' sizes add up to more than 64 bits");
    }
  }
  return plan;
}

}  // namespace weightd::transform
