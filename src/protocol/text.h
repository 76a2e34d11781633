// Text for people that both ends write: the daemon in its errors and logs,
// the command line in what it prints.
#pragma once

#include <cstdint>
#include <string>

namespace weightd::protocol {

// 1288490188 -> "1.20 GiB", 8192 -> "8.00 KiB", 882 -> "882 B".
std::string FormatBytes(uint64_t bytes);

}  // namespace weightd::protocol
