// libFuzzer target: a checkpoint made of the input, loaded as a preload and an engine's fallback
// load it (loader::LoadCheckpoint): kept as stored by one worker (samples hashed as they are read,
// where the file's order allows) and by two (hashed from the segment); replicated to two ranks;
// split across two ranks by name (`c...` by columns, `r...` by rows, `v...` as a vocabulary);
// cast to BF16; and split and quantized to FP8 blocks. A file the format's rules refuse fails the
// load; one they accept loads or fails with an error (a shape a split cannot cut). A load that
// succeeds has the fingerprint's digest (the same whatever the fingerprint's read schedule), a
// manifest with every tensor the plan makes, and every tensor kept in its dtype holds, in every
// rank's segment, the file's bytes cut as the split says (cut again here, with zero rows for a
// vocabulary's padding). The layout and the copy jobs are
// made from the header alone (untrusted), and a run of small tensors read at once must cover each
// of them whatever their order and sizes (tensors of no bytes included), and the manifest, made
// while the reads run, takes every shard's tensors by name.
//
// The input is up to four pieces, split at kSeparator: each piece a shard
// (model-0000I-of-0000N.safetensors), except one that starts with `{`,
// which is the index (model.safetensors.index.json).
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include "fingerprint/fingerprint.h"
#include "format/checkpoint.h"
#include "format/dtype.h"
#include "io/file.h"
#include "loader/loader.h"
#include "memory/manifest.h"
#include "transform/plan.h"

namespace {

namespace fs = std::filesystem;

constexpr std::string_view kSeparator = "\xfe\xfe\xfe\xfe";
constexpr size_t kMaxPieces = 4;

const std::string& Dir() {
  static const std::string* dir = [] {
    // Named for the process, which the test removes however it ends.
    std::string name = "/tmp/weightd-load-fuzz-" + std::to_string(::getpid()) + "-XXXXXX";
    if (::mkdtemp(name.data()) == nullptr) __builtin_trap();
    auto* s = new std::string(name);
    std::atexit([] {
      std::error_code ignored;
      fs::remove_all(Dir(), ignored);
    });
    return s;
  }();
  return *dir;
}

using weightd::transform::Split;

// What names a weight's FP8 block scales: `<weight>_scale_inv`.
constexpr std::string_view kScaleSuffix = "_scale_inv";

// The split `plan` gives the tensor `name`, as PlanTensors decides it:
// block scales of a pre-quantized weight are cut as their weight is.
Split SplitOf(const weightd::transform::ShardPlan& plan, std::string_view name,
              const weightd::format::Checkpoint& checkpoint) {
  if (name.ends_with(kScaleSuffix)) {
    const std::string weight(name.substr(0, name.size() - kScaleSuffix.size()));
    for (const weightd::format::Shard& shard : checkpoint.shards) {
      if (shard.header.Find(weight) != nullptr) return plan.SplitOf(weight);
    }
  }
  return plan.SplitOf(std::string(name));
}

// What rank `rank` of `ranks` holds of tensor `t` kept in its dtype, whose
// bytes in the file are `bytes`: the cut done again, on its own terms.
std::string Cut(const weightd::format::TensorInfo& t, std::string_view bytes, Split split, int rank,
                int ranks) {
  using u128 = unsigned __int128;
  const u128 bits = weightd::format::DTypeBits(t.dtype);
  const u128 rows = t.shape.empty() ? 1 : t.shape[0];
  u128 rest = 1;
  for (size_t d = 1; d < t.shape.size(); ++d) rest = rest * t.shape[d];  // the load checked
  auto at = [&](u128 elements) { return static_cast<size_t>(elements * bits / 8); };
  const u128 r = static_cast<u128>(rank), n = static_cast<u128>(ranks);
  switch (split) {
    case Split::kReplicate:
      return std::string(bytes);
    case Split::kColumn: {
      const u128 per = rows / n;
      return std::string(bytes.substr(at(r * per * rest), at(per * rest)));
    }
    case Split::kVocab: {
      const u128 per = (rows + n - 1) / n;
      const u128 first = std::min(r * per, rows), last = std::min((r + 1) * per, rows);
      std::string out(bytes.substr(at(first * rest), at((last - first) * rest)));
      out.resize(at(per * rest), '\0');
      return out;
    }
    case Split::kRow: {
      const u128 per = rest / n;
      std::string out;
      if (at(per) == 0) return out;
      for (u128 i = 0; i < rows; ++i) out += bytes.substr(at(i * rest + r * per), at(per));
      return out;
    }
  }
  __builtin_trap();
}

// The shape each of `ranks` ranks gets of a tensor of shape `given`.
std::vector<uint64_t> CutShape(std::span<const uint64_t> given, Split split, int ranks) {
  std::vector<uint64_t> shape(given.begin(), given.end());
  const auto n = static_cast<uint64_t>(ranks);
  if (split == Split::kColumn) shape[0] /= n;
  if (split == Split::kVocab) shape[0] = shape[0] / n + (shape[0] % n != 0);
  if (split == Split::kRow) shape[1] /= n;
  return shape;
}

// The bytes of a tensor of `shape` and `dtype`.
uint64_t BytesOf(std::span<const uint64_t> shape, weightd::format::DType dtype) {
  unsigned __int128 bits = weightd::format::DTypeBits(dtype);
  for (uint64_t d : shape) bits *= d;  // the load checked it fits
  return static_cast<uint64_t>(bits / 8);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace weightd;
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  std::vector<std::string_view> pieces;
  for (size_t at = 0; pieces.size() < kMaxPieces;) {
    const size_t end =
        pieces.size() + 1 == kMaxPieces ? std::string_view::npos : input.find(kSeparator, at);
    pieces.push_back(input.substr(at, end == std::string_view::npos ? end : end - at));
    if (end == std::string_view::npos) break;
    at = end + kSeparator.size();
  }
  std::error_code ignored;
  for (const auto& entry : fs::directory_iterator(Dir())) fs::remove_all(entry.path(), ignored);
  size_t shard_count = 0;
  for (std::string_view piece : pieces) shard_count += piece.starts_with('{') ? 0 : 1;
  size_t shards_written = 0;
  bool have_index = false;
  for (std::string_view piece : pieces) {
    std::string name;
    if (piece.starts_with('{') && !have_index) {
      name = "model.safetensors.index.json";
      have_index = true;
    } else {
      name = "model-0000" + std::to_string(++shards_written) + "-of-0000" +
             std::to_string(shard_count) + ".safetensors";
    }
    std::ofstream out(Dir() + "/" + name, std::ios::binary | std::ios::trunc);
    out.write(piece.data(), static_cast<std::streamsize>(piece.size()));
    if (!out) __builtin_trap();
  }
  io::FileSystem& files = io::PosixFileSystem();
  auto checkpoint = format::OpenCheckpoint(files, Dir());
  auto fingerprint = fingerprint::FingerprintCheckpoint(files, Dir(), {});
  // The digest does not depend on the read schedule: here a first read of
  // the length prefix alone, then one sample a read, one read a window, each
  // window's buffer used again when its samples are hashed.
  auto one_by_one = fingerprint::FingerprintCheckpoint(files, Dir(),
                                                       {.max_inflight = 1,
                                                        .coalesce = false,
                                                        .speculative_bytes = 8,
                                                        .local_window_bytes = 1,
                                                        .remote_window_bytes = 1});
  if (fingerprint.ok() != one_by_one.ok()) __builtin_trap();
  if (fingerprint.ok() && fingerprint->digest != one_by_one->digest) __builtin_trap();
  static const auto ways = [] {
    using weightd::transform::Processing;
    using weightd::transform::ResolveProcessing;
    using weightd::transform::ShardPlan;
    // Block scales of a pre-quantized weight also match a rule of their
    // own (`inv$`), which the plan does not follow: it cuts them as it
    // cuts their weight, and so does SplitOf.
    auto by_name = ShardPlan::FromRules("file", {{"inv$", Split::kRow},
                                                 {"^c", Split::kColumn},
                                                 {"^r", Split::kRow},
                                                 {"^v", Split::kVocab}});
    auto replicated = ResolveProcessing(2, "keep", "none", "replicate");
    auto cast = ResolveProcessing(1, "bf16", "none", "");
    auto quantized = ResolveProcessing(2, "keep", "fp8-block", "replicate");
    if (!by_name.ok() || !replicated.ok() || !cast.ok() || !quantized.ok()) __builtin_trap();
    Processing split = *replicated;
    split.plan = *by_name;
    quantized->plan = *by_name;
    //       as stored, 1 and 2 workers; replicated; split; cast; split and quantized
    return std::vector<Processing>{{}, {}, *replicated, split, *cast, *quantized};
  }();
  std::map<std::string, std::string> shard_bytes;  // each shard listed, as the file holds it
  size_t tensors = 0;
  if (checkpoint.ok()) {
    for (const format::Shard& shard : checkpoint->shards) {
      tensors += shard.header.tensors.size();
      std::ifstream in(shard.path, std::ios::binary);
      shard_bytes[shard.name].assign(std::istreambuf_iterator<char>(in), {});
    }
  }
  for (size_t way = 0; way < ways.size(); ++way) {
    const transform::Processing& processing = ways[way];
    loader::LoadOptions options;
    options.max_inflight = way == 0 ? 1 : 2;
    options.chunk_bytes = 4096;  // big tensors in many jobs
    options.processing = processing;
    auto loaded = loader::LoadCheckpoint(files, Dir(), options);
    if (!checkpoint.ok()) {
      if (loaded.ok()) __builtin_trap();  // a file the rules refuse is never loaded
      continue;
    }
    // Whatever the plan refuses (a shape a split cannot cut) fails the
    // load, and nothing else does: inputs of 16 KiB need no more memory
    // than there is.
    const bool plannable =
        transform::PlanTensors(transform::SourcesOf(checkpoint->shards), processing).ok();
    if (loaded.ok() != plannable) __builtin_trap();
    if (!loaded.ok()) continue;
    if (!fingerprint.ok() || loaded->checkpoint_digest != fingerprint->digest) __builtin_trap();
    if (loaded->ranks.size() != static_cast<size_t>(processing.tp_size)) __builtin_trap();
    // Every tensor (and a new scale for each quantized one), in every rank.
    std::optional<size_t> planned;
    for (const loader::LoadedRank& rank : loaded->ranks) {
      const auto segment = rank.segment->readable();
      auto manifest = memory::ReadManifest(segment);
      if (!manifest.ok() || manifest->tensors.size() < tensors) __builtin_trap();
      if (planned.value_or(manifest->tensors.size()) != manifest->tensors.size()) __builtin_trap();
      planned = manifest->tensors.size();
      size_t sources_seen = 0;
      for (const memory::TensorRecord& t : manifest->tensors) {
        const format::TensorInfo* info = nullptr;
        std::string_view file;
        for (const format::Shard& shard : checkpoint->shards) {
          if ((info = shard.header.Find(t.name)) != nullptr) {
            file = shard_bytes[shard.name];
            if (file.size() < shard.header.data_offset() + info->end) __builtin_trap();
            file = file.substr(static_cast<size_t>(shard.header.data_offset() + info->begin),
                               static_cast<size_t>(info->bytes()));
            break;
          }
        }
        if (info == nullptr) {  // a quantized weight's new scales, after it by name
          if (!processing.fp8_block || !t.name.ends_with(kScaleSuffix)) __builtin_trap();
          const std::string_view weight = t.name.substr(0, t.name.size() - kScaleSuffix.size());
          auto w = std::lower_bound(
              manifest->tensors.begin(), manifest->tensors.end(), weight,
              [](const memory::TensorRecord& r, std::string_view name) { return r.name < name; });
          if (w == manifest->tensors.end() || w->name != weight || w->dtype != "F8_E4M3" ||
              w->shape.size() != 2 || t.dtype != "F32" || t.shape.size() != 2 ||
              t.shape[0] != (w->shape[0] + 127) / 128 || t.shape[1] != (w->shape[1] + 127) / 128 ||
              t.bytes != BytesOf(t.shape, format::DType::kF32)) {
            __builtin_trap();
          }
          continue;
        }
        ++sources_seen;
        const Split split = processing.tp_size == 1
                                ? Split::kReplicate
                                : SplitOf(*processing.plan, t.name, *checkpoint);
        const std::vector<uint64_t> shape = CutShape(info->shape, split, processing.tp_size);
        const auto dtype = format::ParseDType(t.dtype);
        if (!std::equal(t.shape.begin(), t.shape.end(), shape.begin(), shape.end()) || !dtype ||
            t.bytes != BytesOf(shape, *dtype)) {
          __builtin_trap();
        }
        // Cast or quantized: the values are the converters' tests' to check.
        if (*dtype != info->dtype) {
          if (processing.dtype ? *dtype != *processing.dtype
                               : !processing.fp8_block || *dtype != format::DType::kF8_E4M3) {
            __builtin_trap();
          }
          continue;
        }
        const std::string want = Cut(*info, file, split, rank.rank, processing.tp_size);
        if (want.size() != t.bytes ||
            std::memcmp(segment.data() + t.offset, want.data(), want.size()) != 0) {
          __builtin_trap();
        }
      }
      if (sources_seen != tensors) __builtin_trap();
    }
  }
  return 0;
}
