// libFuzzer target: the input is a whole safetensors file. The length
// prefix, the JSON header and the layout validation must return an error,
// never crash, hang or allocate beyond the input's size; and a header that
// passes must plan (split, cast, quantize) to an answer or an error, with
// outputs no bigger than their arithmetic says. The header is read with
// simdjson's On-Demand API, which checks only what it reads: whatever a full
// parse of the JSON refuses must be refused as not JSON, and nothing it
// refuses accepted.
#include <cstddef>
#include <cstdint>
#include <span>
#include <tuple>
#include <vector>

#include "format/checkpoint.h"
#include "format/json.h"
#include "format/rules.h"
#include "format/safetensors.h"
#include "transform/plan.h"

namespace {

// What the processing flags can ask of a header's tensors.
const std::vector<weightd::transform::Processing>& Processings() {
  static const std::vector<weightd::transform::Processing> all = [] {
    std::vector<weightd::transform::Processing> out;
    for (auto [tp, dtype, quant] : {std::tuple{2, "fp16", "fp8-block"},
                                    std::tuple{3, "keep", "none"}, std::tuple{1, "bf16", "none"}}) {
      auto p = weightd::transform::ResolveProcessing(tp, dtype, quant, "llama");
      if (!p.ok()) __builtin_trap();
      out.push_back(*p);
    }
    return out;
  }();
  return all;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace weightd::format;
  std::span<const std::byte> file(reinterpret_cast<const std::byte*>(data), size);
  auto n = DecodeHeaderLength("fuzz.safetensors", file, size);
  if (!n.ok()) return 0;
  const auto json = file.subspan(kHeaderLengthBytes, *n);
  auto header = ParseHeader("fuzz.safetensors", json, size);
  const simdjson::padded_string padded(reinterpret_cast<const char*>(json.data()), json.size());
  const bool valid_json =
      json::DomError(padded.data(), padded.size(), json::kMaxHeaderDepth) == simdjson::SUCCESS;
  if (!valid_json && header.ok()) __builtin_trap();
  if (!valid_json && simdjson::validate_utf8(padded.data(), padded.size()) &&
      header.error().message().find(rules::kHeaderNotJson) == std::string::npos) {
    __builtin_trap();
  }
  if (!header.ok()) return 0;
  // What a valid header promises: tensors tile the data region exactly.
  uint64_t total = 0;
  for (const TensorInfo& t : header->tensors) total += t.bytes();
  if (total != header->data_bytes || header->file_size() != size) __builtin_trap();

  // The sources view the shards' names: the shards outlive them.
  const std::vector<Shard> shards = {{"fuzz.safetensors", "fuzz.safetensors", size, *header}};
  const auto sources = weightd::transform::SourcesOf(shards);
  for (const auto& p : Processings()) {
    auto plan = weightd::transform::PlanTensors(sources, p);
    if (!plan.ok()) continue;
    for (const auto& o : plan->outputs) {
      // An output's bytes are its rows of whole elements, per rank: at most
      // 8 bytes an element (F64), whatever the header claimed.
      unsigned __int128 elements = static_cast<unsigned __int128>(o.rows) * o.row_elems;
      if (static_cast<unsigned __int128>(o.bytes) > elements * 8 + 8) __builtin_trap();
    }
  }
  return 0;
}
