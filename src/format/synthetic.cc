#include "format/synthetic.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <optional>
#include <thread>

#include "format/checkpoint.h"
#include "io/file.h"
#include "io/read_many.h"

namespace weightd::format {
namespace {

constexpr uint64_t kSparsePrefixBytes = 4096;

uint64_t Mix(uint64_t x) {  // splitmix64's finalizer: a bijection with good avalanche
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

uint64_t HashName(std::string_view name, uint64_t seed) {
  uint64_t h = Mix(seed ^ 0x5741u);
  for (char c : name) h = Mix(h ^ static_cast<unsigned char>(c));
  return h;
}

// Turns 64 random bits into 64 bits of valid, finite, moderately sized
// elements of `dtype` (weights of magnitude about 2^-10 .. 2^-3).
uint64_t ShapeWord(DType dtype, uint64_t r) {
  uint64_t out = 0;
  switch (dtype) {
    case DType::kBF16:
      for (int lane = 0; lane < 4; ++lane) {
        uint64_t v = (r >> (16 * lane)) & 0xffff;
        uint64_t bits = (v & 0x807f) | ((117 + ((v >> 7) & 7)) << 7);
        out |= bits << (16 * lane);
      }
      return out;
    case DType::kF16:
      for (int lane = 0; lane < 4; ++lane) {
        uint64_t v = (r >> (16 * lane)) & 0xffff;
        uint64_t bits = (v & 0x83ff) | ((5 + ((v >> 10) & 7)) << 10);
        out |= bits << (16 * lane);
      }
      return out;
    case DType::kF32:
    case DType::kC64:
      for (int lane = 0; lane < 2; ++lane) {
        uint64_t v = (r >> (32 * lane)) & 0xffffffff;
        uint64_t bits = (v & 0x807fffff) | ((117 + ((v >> 23) & 7)) << 23);
        out |= bits << (32 * lane);
      }
      return out;
    case DType::kF64:
      return (r & 0x800fffffffffffffull) | ((1013 + ((r >> 52) & 7)) << 52);
    case DType::kF8_E4M3:
    case DType::kF8_E5M2:
    case DType::kF8_E4M3FNUZ:
    case DType::kF8_E5M2FNUZ:
      // Clear each byte's top exponent bit (no inf/NaN) and set its lowest
      // (no 0x80, the FNUZ NaN).
      return (r & 0xbfbfbfbfbfbfbfbfull) | 0x0808080808080808ull;
    case DType::kF8_E8M0:
      return r & 0x7f7f7f7f7f7f7f7full;  // at most 2^0; never 0xff (NaN)
    case DType::kBool:
      return r & 0x0101010101010101ull;
    default:
      return r;  // integers and sub-byte floats: every bit pattern is a value
  }
}

// --- Layouts -------------------------------------------------------------

std::string ShardName(size_t i, size_t n) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "model-%05zu-of-%05zu.safetensors", i + 1, n);
  return buf;
}

uint64_t SpecBytes(const TensorSpec& t) {
  uint64_t n = DTypeBits(t.dtype);
  for (uint64_t d : t.shape) n *= d;
  return n / 8;
}

// Cuts an ordered list of tensors into `n` shards of about equal bytes,
// keeping the order (as model-0000k-of-0000n files do).
std::vector<PlannedShard> Split(std::vector<TensorSpec> tensors, size_t n) {
  n = std::max<size_t>(1, std::min(n, tensors.size()));
  uint64_t total = 0;
  for (const auto& t : tensors) total += SpecBytes(t);
  std::vector<PlannedShard> shards(n);
  uint64_t cumulative = 0;
  size_t remaining = tensors.size();
  size_t shard = 0;
  for (auto& t : tensors) {
    // Move on when this shard has its share, but leave every later shard at
    // least one tensor.
    while (shard + 1 < n && !shards[shard].tensors.empty() &&
           (cumulative >= total / n * (shard + 1) || remaining <= n - shard - 1)) {
      ++shard;
    }
    cumulative += SpecBytes(t);
    --remaining;
    shards[shard].tensors.push_back(std::move(t));
  }
  for (size_t i = 0; i < n; ++i) shards[i].name = n == 1 ? "model.safetensors" : ShardName(i, n);
  return shards;
}

std::vector<TensorSpec> TinyTensors() {
  return {
      {"embed.weight", DType::kF32, {16, 8}},
      {"layer0.attn.weight", DType::kBF16, {8, 8}},
      {"layer0.mlp.weight", DType::kF16, {4, 8}},
      {"layer0.mlp.weight_fp8", DType::kF8_E4M3, {4, 8}},
      {"layer0.norm.weight", DType::kF64, {8}},
      {"position_ids", DType::kI64, {6}},
      {"token_type", DType::kI32, {5}},
      {"mask", DType::kBool, {7}},
      {"bytes", DType::kU8, {3}},
      {"scale", DType::kF32, {}},
  };
}

struct LlamaShape {
  uint64_t hidden, kv, intermediate, vocab, layers;
};

LlamaShape LlamaShapeFor(const SyntheticOptions& o) {
  const uint64_t size = o.size_bytes ? o.size_bytes : 512ull << 20;
  LlamaShape s{};
  s.hidden = o.hidden                 ? static_cast<uint64_t>(o.hidden)
             : size <= (256ull << 20) ? 512
             : size <= (4ull << 30)   ? 2048
             : size <= (32ull << 30)  ? 4096
                                      : 8192;
  s.vocab = s.hidden >= 2048 ? 32000 : 8192;
  s.kv = std::max<uint64_t>(s.hidden / 4, 64);
  s.intermediate = (s.hidden * 8 / 3 + 255) / 256 * 256;
  if (o.layers) {
    s.layers = static_cast<uint64_t>(o.layers);
  } else {
    const uint64_t h = s.hidden;
    const uint64_t per_layer = 2 * (2 * h * h + 2 * s.kv * h + 3 * h * s.intermediate + 2 * h);
    const uint64_t fixed = 2 * (2 * s.vocab * h + h);
    s.layers = size > fixed ? std::max<uint64_t>(1, (size - fixed + per_layer / 2) / per_layer) : 1;
  }
  return s;
}

std::vector<TensorSpec> LlamaTensors(const LlamaShape& s) {
  std::vector<TensorSpec> t;
  const auto bf16 = DType::kBF16;
  t.push_back({"model.embed_tokens.weight", bf16, {s.vocab, s.hidden}});
  for (uint64_t l = 0; l < s.layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    t.push_back({p + "input_layernorm.weight", bf16, {s.hidden}});
    t.push_back({p + "self_attn.q_proj.weight", bf16, {s.hidden, s.hidden}});
    t.push_back({p + "self_attn.k_proj.weight", bf16, {s.kv, s.hidden}});
    t.push_back({p + "self_attn.v_proj.weight", bf16, {s.kv, s.hidden}});
    t.push_back({p + "self_attn.o_proj.weight", bf16, {s.hidden, s.hidden}});
    t.push_back({p + "post_attention_layernorm.weight", bf16, {s.hidden}});
    t.push_back({p + "mlp.gate_proj.weight", bf16, {s.intermediate, s.hidden}});
    t.push_back({p + "mlp.up_proj.weight", bf16, {s.intermediate, s.hidden}});
    t.push_back({p + "mlp.down_proj.weight", bf16, {s.hidden, s.intermediate}});
  }
  t.push_back({"model.norm.weight", bf16, {s.hidden}});
  t.push_back({"lm_head.weight", bf16, {s.vocab, s.hidden}});
  return t;
}

std::vector<TensorSpec> ManyTensors(uint64_t count) {
  constexpr uint64_t kExperts = 64;
  const char* kProj[] = {"gate_proj", "up_proj", "down_proj"};
  std::vector<TensorSpec> t;
  t.reserve(count);
  for (uint64_t i = 0; i < count; ++i) {
    const uint64_t layer = i / (kExperts * 3), expert = (i / 3) % kExperts;
    t.push_back({"model.layers." + std::to_string(layer) + ".mlp.experts." +
                     std::to_string(expert) + "." + kProj[i % 3] + ".weight",
                 DType::kBF16,
                 {1 + (i * 7) % 16, 64}});
  }
  return t;
}

std::vector<TensorSpec> K3Tensors(uint64_t layers, uint64_t experts) {
  // The shapes of a DeepSeek-V3-style MoE at Kimi-K2 scale: MLA attention
  // in BF16, routed experts in FP8.
  const uint64_t h = 7168, moe = 2048, vocab = 163840;
  const auto bf16 = DType::kBF16, fp8 = DType::kF8_E4M3;
  std::vector<TensorSpec> t;
  t.push_back({"model.embed_tokens.weight", bf16, {vocab, h}});
  for (uint64_t l = 0; l < layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    t.push_back({p + "input_layernorm.weight", bf16, {h}});
    t.push_back({p + "post_attention_layernorm.weight", bf16, {h}});
    t.push_back({p + "self_attn.q_a_proj.weight", bf16, {1536, h}});
    t.push_back({p + "self_attn.q_a_layernorm.weight", bf16, {1536}});
    t.push_back({p + "self_attn.q_b_proj.weight", bf16, {12288, 1536}});
    t.push_back({p + "self_attn.kv_a_proj_with_mqa.weight", bf16, {576, h}});
    t.push_back({p + "self_attn.kv_a_layernorm.weight", bf16, {512}});
    t.push_back({p + "self_attn.kv_b_proj.weight", bf16, {16384, 512}});
    t.push_back({p + "self_attn.o_proj.weight", bf16, {h, 8192}});
    t.push_back({p + "mlp.gate.weight", bf16, {experts, h}});
    for (uint64_t e = 0; e < experts; ++e) {
      const std::string q = p + "mlp.experts." + std::to_string(e) + ".";
      t.push_back({q + "gate_proj.weight", fp8, {moe, h}});
      t.push_back({q + "up_proj.weight", fp8, {moe, h}});
      t.push_back({q + "down_proj.weight", fp8, {h, moe}});
    }
  }
  t.push_back({"model.norm.weight", bf16, {h}});
  t.push_back({"lm_head.weight", bf16, {vocab, h}});
  return t;
}

Status WriteIndex(const std::string& path, const SyntheticPlan& plan) {
  std::vector<std::pair<std::string_view, std::string_view>> map;
  for (const auto& shard : plan.shards) {
    for (const auto& t : shard.tensors) map.emplace_back(t.name, shard.name);
  }
  std::sort(map.begin(), map.end());
  std::string json =
      "{\n  \"metadata\": {\n    \"total_size\": " + std::to_string(plan.data_bytes) +
      "\n  },\n  \"weight_map\": {";
  for (size_t i = 0; i < map.size(); ++i) {
    json += (i ? ",\n    " : "\n    ") + JsonQuote(map[i].first) + ": " + JsonQuote(map[i].second);
  }
  json += "\n  }\n}\n";
  FILE* f = std::fopen(path.c_str(), "wbe");
  if (f == nullptr) return Error(path + ": cannot create: " + std::strerror(errno));
  const bool ok = std::fwrite(json.data(), 1, json.size(), f) == json.size();
  if (std::fclose(f) != 0 || !ok) return Error(path + ": write failed");
  return OkStatus();
}

}  // namespace

void FillSyntheticTensor(uint64_t seed, bool finetune, const TensorInfo& tensor, uint64_t offset,
                         std::span<std::byte> dst) {
  const uint64_t key = HashName(tensor.name, seed * 2 + (finetune ? 1 : 0));
  size_t done = 0;
  while (done < dst.size()) {
    const uint64_t pos = offset + done;
    const uint64_t word_index = pos / 8;
    const size_t in_word = static_cast<size_t>(pos % 8);
    const uint64_t word = ShapeWord(tensor.dtype, Mix(key ^ Mix(word_index)));
    const size_t len = std::min(8 - in_word, dst.size() - done);
    std::memcpy(dst.data() + done, reinterpret_cast<const std::byte*>(&word) + in_word, len);
    done += len;
  }
}

Result<SyntheticPlan> PlanSyntheticCheckpoint(const SyntheticOptions& o) {
  SyntheticPlan plan;
  const auto shards_or = [&](size_t fallback) {
    return o.shards > 0 ? static_cast<size_t>(o.shards) : fallback;
  };
  if (o.preset == "tiny") {
    plan.shards = Split(TinyTensors(), shards_or(1));
  } else if (o.preset == "llama") {
    plan.shards = Split(LlamaTensors(LlamaShapeFor(o)), shards_or(4));
  } else if (o.preset == "many-tensors") {
    plan.shards = Split(ManyTensors(o.tensors ? o.tensors : 70'000), shards_or(8));
  } else if (o.preset == "k3-layout") {
    plan.shards = Split(K3Tensors(o.layers ? static_cast<uint64_t>(o.layers) : 60,
                                  o.experts ? static_cast<uint64_t>(o.experts) : 384),
                        shards_or(50));
    plan.sparse = true;
  } else {
    return Error("unknown preset `" + o.preset +
                 "` (presets: tiny, llama, many-tensors, k3-layout)");
  }
  plan.with_index = plan.shards.size() > 1;
  for (const auto& s : plan.shards) {
    plan.tensor_count += s.tensors.size();
    for (const auto& t : s.tensors) plan.data_bytes += SpecBytes(t);
  }
  return plan;
}

Result<SyntheticPlan> WriteSyntheticCheckpoint(
    const std::string& out_dir, const SyntheticOptions& options,
    const std::function<void(size_t, size_t)>& progress) {
  WEIGHTD_ASSIGN_OR_RETURN(SyntheticPlan plan, PlanSyntheticCheckpoint(options));
  io::FileSystem& fs = io::PosixFileSystem();
  WEIGHTD_ASSIGN_OR_RETURN(bool exists, fs.Exists(out_dir));
  if (exists) {
    WEIGHTD_ASSIGN_OR_RETURN(bool is_dir, fs.IsDirectory(out_dir));
    if (!is_dir) return Error(out_dir + ": already exists and is not a directory");
    auto entries = fs.ListDirectory(out_dir);
    if (!entries.ok() || !entries->empty()) {
      return Error(out_dir + ": already exists and is not an empty directory");
    }
  }

  const std::string staging =
      io::WithoutTrailingSlashes(out_dir) + ".partial-" + std::to_string(::getpid());
  // Written beside OUT and renamed when complete; an error names OUT.
  // Removed however this ends short of the rename (an exception too), and
  // first by a process a signal ends (the CLI's), with no moment between
  // its making and its listing. Not made, whatever has the name is not ours.
  auto unfinished =
      io::UnfinishedPath::Make(staging, [&] { return ::mkdir(staging.c_str(), 0755) == 0; });
  if (!unfinished) {
    return Error(out_dir + ": cannot create it (it is written as " + io::BaseName(staging) +
                 " beside it first): " + std::strerror(errno));
  }

  std::vector<std::optional<Error>> errors(plan.shards.size());
  std::atomic<size_t> next{0}, done{0};
  std::mutex progress_mu;
  const int workers = static_cast<int>(
      std::min<size_t>(plan.shards.size(), std::max(1u, std::thread::hardware_concurrency())));
  io::RunTeam(workers, [&](int) {
    for (size_t i; (i = next.fetch_add(1)) < plan.shards.size();) {
      const PlannedShard& shard = plan.shards[i];
      auto layout = LayoutShard(shard.tensors, {{"format", "pt"}});
      Status s = layout.ok() ? OkStatus() : Status(layout.error());
      if (s.ok()) {
        WriteOptions write_options;
        if (plan.sparse) write_options.sparse_prefix = kSparsePrefixBytes;
        s = WriteShard(
            io::JoinPath(staging, shard.name), *layout,
            [&](const TensorInfo& t, uint64_t offset, std::span<std::byte> dst) {
              FillSyntheticTensor(options.seed, options.finetune, t, offset, dst);
            },
            write_options);
      }
      if (!s.ok()) errors[i] = s.error();
      if (progress) {
        std::lock_guard lock(progress_mu);
        progress(done.fetch_add(1) + 1, plan.shards.size());
      }
    }
  });
  Status status = OkStatus();
  for (auto& e : errors) {
    if (e && status.ok()) status = *e;
  }
  if (status.ok() && plan.with_index) {
    status = WriteIndex(io::JoinPath(staging, std::string(kIndexFileName)), plan);
  }
  if (status.ok()) {
    if (exists) ::rmdir(out_dir.c_str());
    if (::rename(staging.c_str(), out_dir.c_str()) != 0) {
      status = Error(out_dir + ": cannot move the checkpoint into place: " + std::strerror(errno));
    } else {
      unfinished->Keep();
    }
  }
  if (!status.ok()) return status.error();
  return plan;
}

}  // namespace weightd::format
