// Text for people that both ends write: the daemon in its errors and logs,
// the command line in what it prints; and sizes as people write them, in
// flags and config files.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace weightd::protocol {

// 1288490188 -> "1.20 GiB", 8192 -> "8.00 KiB", 882 -> "882 B".
std::string FormatBytes(uint64_t bytes);

// Control characters in names from files (a newline in a path, an escape
// sequence in a tensor name) as \xNN: shown, not obeyed, and one log line
// stays one line.
std::string Printable(std::string_view text);

// "512M", "64G", "1T", "4096" (bytes); binary multiples. nullopt when the
// text is not a size or overflows.
std::optional<uint64_t> ParseSize(std::string_view text);
// Why ParseSize refused `text`, for a message: "`1.5G` is not a size: ...".
std::string WhyNotASize(std::string_view text);

}  // namespace weightd::protocol
