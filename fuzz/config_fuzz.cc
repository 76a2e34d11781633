// libFuzzer target: the input is a daemon config file (TOML). Whatever it
// holds, it parses or is refused with an error naming the file; what
// parses keeps the promises ParseConfig makes to its caller.
#include <cstddef>
#include <cstdint>
#include <set>
#include <string>
#include <string_view>

#include "daemon/config.h"
#include "daemon/registry.h"
#include "memory/cuda.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace weightd;
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  auto config = daemon::ParseConfig(text, "fuzz.toml");
  if (!config.ok()) {
    if (!config.error().message().starts_with("fuzz.toml")) __builtin_trap();
    return 0;
  }
  std::set<std::string> devices, pins;
  for (const daemon::Budget& b : config->budgets) {
    // One per device, however it is spelled.
    auto device = memory::ParseDevice(b.device);
    if (!device.ok()) __builtin_trap();
    const std::string one = std::to_string(static_cast<int>(device->kind)) + ":" +
                            std::to_string(device->ordinal) + ":" +
                            (device->uuid.empty() ? "" : device->uuid.substr(4));
    if (!devices.insert(one).second) __builtin_trap();
    if (!daemon::ParseBudget(b.device, std::to_string(b.bytes)).ok()) __builtin_trap();
  }
  for (const daemon::ConfigModel& m : config->models) {
    if (m.path.empty() || m.processing.tp_size < 1) __builtin_trap();
    if (!m.pin.empty() && (!pins.insert(m.pin).second || !daemon::CheckPinName(m.pin).ok())) {
      __builtin_trap();
    }
  }
  return 0;
}
