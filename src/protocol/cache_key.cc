#include "protocol/cache_key.h"

#include <algorithm>

#include "memory/cuda.h"
#include "protocol/paths.h"

namespace weightd::protocol {

std::string FieldDifference::Describe() const {
  std::string text = field + ": daemon has " + daemon + ", engine wants " + engine;
  // Digests of two kinds never match: say which flag makes them one kind.
  auto kind = [](const std::string& digest) { return digest.substr(0, digest.find(':')); };
  if (field == "checkpoint" && kind(daemon) != kind(engine)) {
    text += " (digests of different kinds: preloaded and loaded with different --fingerprint)";
  }
  return text;
}

std::vector<FieldDifference> Compare(const CacheKey& held, const CacheKey& wanted,
                                     bool skip_checkpoint) {
  std::vector<FieldDifference> out;
  auto check = [&](const char* field, const auto& a, const auto& b) {
    if (a == b) return;
    if constexpr (std::is_same_v<std::decay_t<decltype(a)>, int>) {
      out.push_back({field, std::to_string(a), std::to_string(b)});
    } else {
      out.push_back({field, a, b});
    }
  };
  if (!skip_checkpoint) check("checkpoint", held.checkpoint, wanted.checkpoint);
  check("dtype", held.dtype, wanted.dtype);
  check("quant", held.quant, wanted.quant);
  check("shard_plan", held.shard_plan, wanted.shard_plan);
  check("plan_digest", held.plan_digest, wanted.plan_digest);
  check("tp_size", held.tp_size, wanted.tp_size);
  check("tp_rank", held.tp_rank, wanted.tp_rank);
  check("device", held.device, wanted.device);
  check("format", held.format, wanted.format);
  return out;
}

// How far apart two sizes of one layout's shard may be, at the least.
constexpr uint64_t kLeastLayoutSlack = 64 << 10;

bool SameLayout(const std::vector<ShardSize>& a, const std::vector<ShardSize>& b) {
  return std::equal(a.begin(), a.end(), b.begin(), b.end(),
                    [](const ShardSize& x, const ShardSize& y) {
                      const uint64_t larger = std::max(x.bytes, y.bytes);
                      const uint64_t apart = larger - std::min(x.bytes, y.bytes);
                      const bool named_alike = x.name == y.name || x.name.empty() || y.name.empty();
                      return named_alike && apart <= std::max(kLeastLayoutSlack, larger / 100);
                    });
}

nlohmann::json ToJson(const std::vector<ShardSize>& shards) {
  nlohmann::json out = nlohmann::json::array();
  for (const ShardSize& s : shards)
    out.push_back({{"name", PathToJson(s.name)}, {"bytes", s.bytes}});
  return out;
}

Result<std::vector<ShardSize>> ShardSizesFromJson(const nlohmann::json& j) {
  if (!j.is_array()) return Error("not an array");
  std::vector<ShardSize> out;
  out.reserve(j.size());
  for (const nlohmann::json& e : j) {
    auto name = e.is_object() && e.contains("name") ? PathFromJson(e["name"])
                                                    : Result<std::string>(Error("no name"));
    if (!name.ok()) return Error("a shard's name: " + name.error().message());
    if (!e.contains("bytes") || !e["bytes"].is_number_unsigned()) {
      return Error("a shard's `bytes` is not a size");
    }
    out.push_back({std::move(name).value(), e["bytes"].get<uint64_t>()});
  }
  return out;
}

nlohmann::json ToJson(const CacheKey& key) {
  return {{"checkpoint", key.checkpoint},
          {"dtype", key.dtype},
          {"quant", key.quant},
          {"shard_plan", key.shard_plan},
          {"plan_digest", key.plan_digest},
          {"tp_size", key.tp_size},
          {"tp_rank", key.tp_rank},
          {"device", key.device},
          {"format", key.format}};
}

Result<CacheKey> KeyFromJson(const nlohmann::json& j) {
  if (!j.is_object()) return Error("key is not an object");
  CacheKey key;
  auto text = [&](const char* field, std::string* out) -> Status {
    auto it = j.find(field);
    if (it == j.end() || !it->is_string()) {
      return Error(std::string("key field `") + field + "` is missing or not a string");
    }
    *out = it->get<std::string>();
    return OkStatus();
  };
  auto number = [&](const char* field, int* out) -> Status {
    auto it = j.find(field);
    if (it == j.end() || !it->is_number_integer()) {
      return Error(std::string("key field `") + field + "` is missing or not an integer");
    }
    const auto v = it->get<int64_t>();
    if (v < 0 || v > 1'000'000)
      return Error(std::string("key field `") + field + "` is out of range");
    *out = static_cast<int>(v);
    return OkStatus();
  };
  WEIGHTD_RETURN_IF_ERROR(text("checkpoint", &key.checkpoint));
  WEIGHTD_RETURN_IF_ERROR(text("dtype", &key.dtype));
  WEIGHTD_RETURN_IF_ERROR(text("quant", &key.quant));
  WEIGHTD_RETURN_IF_ERROR(text("shard_plan", &key.shard_plan));
  WEIGHTD_RETURN_IF_ERROR(text("plan_digest", &key.plan_digest));
  WEIGHTD_RETURN_IF_ERROR(number("tp_size", &key.tp_size));
  WEIGHTD_RETURN_IF_ERROR(number("tp_rank", &key.tp_rank));
  WEIGHTD_RETURN_IF_ERROR(text("device", &key.device));
  WEIGHTD_RETURN_IF_ERROR(number("format", &key.format));
  return key;
}

Status CheckSupported(const Processing& p) {
  if (p.tp_rank < 0 || p.tp_rank >= p.tp_size) {
    return Error("--tp-rank " + std::to_string(p.tp_rank) + " is not below --tp-size " +
                 std::to_string(p.tp_size));
  }
  // One device, or one per rank (a preload that puts rank r on GPU r).
  const std::vector<std::string> devices = SplitDevices(p.device);
  for (const std::string& d : devices) {
    if (auto device = memory::ParseDevice(d); !device.ok()) {
      return Error("--device: " + device.error().message());
    }
  }
  if (devices.size() > 1 && devices.size() != static_cast<size_t>(p.tp_size)) {
    return Error("--device " + p.device + ": one device, or one per rank (" +
                 std::to_string(p.tp_size) + "), not " + std::to_string(devices.size()));
  }
  if (p.fingerprint != "sampled" && p.fingerprint != "full") {
    return Error("fingerprint `" + p.fingerprint + "` is neither sampled nor full");
  }
  return OkStatus();
}

std::vector<std::string> SplitDevices(const std::string& device) {
  std::vector<std::string> out;
  for (size_t at = 0; at <= device.size();) {
    const size_t comma = std::min(device.find(',', at), device.size());
    out.push_back(device.substr(at, comma - at));
    at = comma + 1;
  }
  return out;
}

std::string DeviceOfRank(const Processing& p, int rank) {
  const std::vector<std::string> devices = SplitDevices(p.device);
  if (devices.size() == 1) return devices[0];
  return rank >= 0 && static_cast<size_t>(rank) < devices.size()
             ? devices[static_cast<size_t>(rank)]
             : p.device;
}

CacheKey MakeKey(const std::string& checkpoint_digest, const Processing& p,
                 const std::string& plan_name, const std::string& plan_digest) {
  CacheKey key;
  key.checkpoint = checkpoint_digest;
  key.dtype = p.dtype;
  key.quant = p.quant;
  key.shard_plan = plan_name;
  key.plan_digest = plan_digest;
  key.tp_size = p.tp_size;
  key.tp_rank = p.tp_rank;
  key.device = p.device == "cpu" ? "host" : p.device;
  return key;
}

nlohmann::json ToJson(const Processing& p) {
  nlohmann::json j = {{"tp_size", p.tp_size}, {"tp_rank", p.tp_rank},       {"dtype", p.dtype},
                      {"quant", p.quant},     {"shard_plan", p.shard_plan}, {"device", p.device}};
  // Only when it is not the default: a daemon of before it still serves.
  if (p.fingerprint != "sampled") j["fingerprint"] = p.fingerprint;
  return j;
}

Result<Processing> ProcessingFromJson(const nlohmann::json& j) {
  Processing p;
  if (!j.is_object()) return Error("processing options are not an object");
  for (const auto& [field, value] : j.items()) {
    if (field == "tp_size" || field == "tp_rank") {
      if (!value.is_number_integer()) return Error("`" + field + "` is not an integer");
      const auto v = value.get<int64_t>();
      if (v < 0 || v > 4096) return Error("`" + field + "` is out of range");
      (field == "tp_size" ? p.tp_size : p.tp_rank) = static_cast<int>(v);
    } else if (field == "dtype" || field == "quant" || field == "shard_plan" || field == "device") {
      if (!value.is_string()) return Error("`" + field + "` is not a string");
      std::string& out = field == "dtype"        ? p.dtype
                         : field == "quant"      ? p.quant
                         : field == "shard_plan" ? p.shard_plan
                                                 : p.device;
      out = value.get<std::string>();
    } else if (field == "fingerprint") {
      if (!value.is_string()) return Error("`fingerprint` is not a string");
      p.fingerprint = value.get<std::string>();
    } else {
      return Error("unknown processing option `" + field + "`");
    }
  }
  return p;
}

std::string ShortDescription(const CacheKey& key) {
  std::string digest = key.checkpoint;
  if (digest.size() > 26) digest = digest.substr(0, 26) + "…";
  return digest + " tp " + std::to_string(key.tp_rank) + "/" + std::to_string(key.tp_size) +
         (key.shard_plan == "replicate" ? "" : " plan " + key.shard_plan) + " dtype " + key.dtype +
         " quant " + key.quant + " on " + key.device;
}

}  // namespace weightd::protocol
