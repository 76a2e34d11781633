#include "daemon/config.h"

#include <toml++/toml.h>

#include <set>

#include "daemon/registry.h"
#include "memory/cuda.h"
#include "protocol/text.h"

namespace weightd::daemon {

Result<Budget> ParseBudget(const std::string& device, const std::string& amount) {
  auto spec = memory::ParseDevice(device);
  if (!spec.ok()) return Error("`" + device + "` is not host, cuda:N or cuda:GPU-<uuid>");
  auto bytes = protocol::ParseSize(amount);
  if (!bytes) return Error(protocol::WhyNotASize(amount));
  const bool unitless = !amount.empty() && amount.back() >= '0' && amount.back() <= '9';
  std::string same_device = "host";
  if (spec->kind == memory::DeviceSpec::Kind::kCudaOrdinal) {
    same_device = "cuda:" + std::to_string(spec->ordinal);
  } else if (spec->kind == memory::DeviceSpec::Kind::kCudaUuid) {
    same_device = "cuda:GPU-" + spec->uuid.substr(4);  // MIG-x is GPU-x to the driver
  }
  return Budget{device, same_device, spec->kind == memory::DeviceSpec::Kind::kHost, *bytes,
                unitless};
}

Result<Config> ParseConfig(std::string_view text, const std::string& label) {
  toml::table t;
  try {
    t = toml::parse(text, label);
  } catch (const toml::parse_error& e) {
    const auto& where = e.source().begin;
    return Error(label + ":" + std::to_string(where.line) + ":" + std::to_string(where.column) +
                 ": " + std::string(e.description()));
  }
  auto fail = [&](const std::string& why) { return Error(label + ": " + why); };
  // The same, at the line of `node` (where a key's value, or an entry, is).
  auto fail_at = [&](const toml::node& node, const std::string& why) {
    return Error(label + ":" + std::to_string(node.source().begin.line) + ": " + why);
  };
  Config config;
  for (const auto& [key, value] : t) {
    const std::string k(key.str());
    if (k == "socket_dir") {
      if (!value.is_string()) return fail("socket_dir must be a string");
      config.socket_dir = *value.value<std::string>();
      // An empty one (a template's unset variable) must not quietly mean
      // the default.
      if (config.socket_dir.empty()) {
        return fail_at(value, "socket_dir must not be empty (leave it out for the default)");
      }
    } else if (k == "budget") {
      if (!value.is_table()) return fail("[budget] must be a table");
      std::set<std::string> given;  // `host` and `cpu` are one device, as are cuda:0 and cuda:00
      for (const auto& [device, size] : *value.as_table()) {
        if (!size.is_string() && !size.is_integer()) {
          return fail_at(size,
                         "budget." + std::string(device.str()) + " must be a size like \"64G\"");
        }
        const std::string amount =
            size.is_string() ? *size.value<std::string>() : std::to_string(*size.value<int64_t>());
        auto budget = ParseBudget(std::string(device.str()), amount);
        if (!budget.ok()) {
          return fail_at(size,
                         "budget." + std::string(device.str()) + ": " + budget.error().message());
        }
        if (!given.insert(budget->same_device).second) {
          return fail("[budget] names " + budget->same_device +
                      " twice (`host` and `cpu` are one device); give one budget per device");
        }
        config.budgets.push_back(*budget);
      }
    } else if (k == "model") {
      if (!value.is_array_of_tables()) return fail("model must be [[model]] tables");
      for (const auto& entry : *value.as_array()) {
        ConfigModel m;
        protocol::Processing& p = m.processing;
        for (const auto& [field, v] : *entry.as_table()) {
          const std::string f(field.str());
          if (f == "tp_size") {
            const std::optional<int64_t> n = v.value<int64_t>();
            // Whether the plan allows as many ranks is checked later.
            if (!v.is_integer() || !n || *n < 1 || *n > 1 << 20) {
              return fail_at(v, "[[model]] tp_size must be a positive whole number");
            }
            p.tp_size = static_cast<int>(*n);
            continue;
          }
          std::string* into = f == "path"          ? &m.path
                              : f == "pin"         ? &m.pin
                              : f == "device"      ? &p.device
                              : f == "dtype"       ? &p.dtype
                              : f == "quant"       ? &p.quant
                              : f == "shard_plan"  ? &p.shard_plan
                              : f == "fingerprint" ? &p.fingerprint
                                                   : nullptr;
          if (into != nullptr && !v.is_string()) {
            return fail_at(v, "[[model]] " + f + " must be a string (in quotes)");
          }
          if (into == nullptr) {
            return fail_at(
                v,
                "[[model]] takes path, pin, device, dtype, quant, shard_plan and fingerprint "
                "(strings) and tp_size (a number), not `" +
                    f + "`");
          }
          *into = *v.value<std::string>();
          if (into->empty()) {
            return fail_at(
                v, "[[model]] " + f + " must not be empty (give one, or leave the key out)");
          }
        }
        if (m.path.empty()) return fail_at(entry, "a [[model]] without a path");
        if (!m.pin.empty()) {
          if (Status s = CheckPinName(m.pin); !s.ok()) {
            return fail("[[model]] pin `" + m.pin + "`: " + s.error().message());
          }
          for (const ConfigModel& other : config.models) {
            if (other.pin == m.pin) {
              return fail("two [[model]] entries are pinned as `" + m.pin +
                          "`; a name pins one model");
            }
          }
        }
        config.models.push_back(std::move(m));
      }
    } else {
      return fail_at(value, "unknown key `" + k + "`");
    }
  }
  return config;
}

}  // namespace weightd::daemon
