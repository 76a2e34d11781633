// The daemon's --config file: what its text says, checked, before any path
// in it is resolved or any file it names is read (that is the caller's,
// with the file's directory at hand).
//
//   socket_dir = "/run/weightd"          # optional; --socket-dir wins
//   [budget]
//   host = "64G"                         # optional; --budget wins
//   "cuda:0" = "70G"                     # optional, per GPU
//   [[model]]                            # preloaded at start, in this order
//   path = "/models/llama-3-8b"
//   pin = "llama3"                       # optional
//   device = "cuda:0"                    # optional; default: host memory
//   tp_size = 2                          # optional, with shard_plan, dtype,
//   shard_plan = "llama"                 # quant, fingerprint: as preload's flags
//
// Unknown keys are errors, so a typo does not silently do nothing.
//
// Thread safety: free functions, no shared state.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "protocol/cache_key.h"
#include "weightd/result.h"

namespace weightd::daemon {

// One device's budget, as --budget DEVICE=SIZE or a config's [budget] names it.
struct Budget {
  std::string device;  // as given: host, cpu, cuda:N, cuda:GPU-<uuid>
  // The device in one spelling (host for cpu, cuda:0 for cuda:00,
  // cuda:GPU-x for cuda:MIG-x): two budgets with the same are for one
  // device.
  std::string same_device;
  bool host = false;
  uint64_t bytes = 0;
  bool unitless = false;  // a bare number: bytes
};

// `device` is host (or cpu), cuda:N or cuda:GPU-<uuid>; `amount` a size
// like 64G (protocol::ParseSize).
Result<Budget> ParseBudget(const std::string& device, const std::string& amount);

struct ConfigModel {
  std::string path;                 // as written: relative to the config file's directory
  std::string pin;                  // empty: none
  protocol::Processing processing;  // as `weightd preload`'s flags give it, not yet checked
};

struct Config {
  std::string socket_dir;       // as written; empty: not given
  std::vector<Budget> budgets;  // one per device
  std::vector<ConfigModel> models;
};

// Parses and checks `text`; errors start with `label` (the file's name)
// and, where they can, the line. Checked here: the TOML, every key and its
// type, the budgets (one per device), each model's path (present) and pin
// (a valid name, one model each), that tp_size is a whole number from 1 to
// 2^20. Not checked here: the rest of the processing (which may name a plan
// file to read) and whether two entries name one model. So a file with
// several mistakes is refused for its pins before its processing.
Result<Config> ParseConfig(std::string_view text, const std::string& label);

}  // namespace weightd::daemon
