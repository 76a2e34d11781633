#include "protocol/text.h"

#include <cstdio>

namespace weightd::protocol {

std::string FormatBytes(uint64_t bytes) {
  static const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  double v = static_cast<double>(bytes);
  int unit = 0;
  while (v >= 1024.0 && unit < 5) {
    v /= 1024.0;
    ++unit;
  }
  char buf[32];
  if (unit == 0) {
    std::snprintf(buf, sizeof buf, "%llu B", static_cast<unsigned long long>(bytes));
  } else {
    std::snprintf(buf, sizeof buf, "%.2f %s", v, kUnits[unit]);
  }
  return buf;
}

std::string Printable(std::string_view text) {
  std::string out;
  for (char c : text) {
    const auto u = static_cast<unsigned char>(c);
    if (u < 0x20 || u == 0x7f) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", u);
      out += buf;
    } else {
      out += c;
    }
  }
  return out;
}

std::optional<uint64_t> ParseSize(std::string_view text) {
  uint64_t value = 0;
  size_t i = 0;
  for (; i < text.size() && text[i] >= '0' && text[i] <= '9'; ++i) {
    if (__builtin_mul_overflow(value, uint64_t{10}, &value) ||
        __builtin_add_overflow(value, static_cast<uint64_t>(text[i] - '0'), &value)) {
      return std::nullopt;
    }
  }
  if (i == 0) return std::nullopt;
  std::string_view suffix = text.substr(i);
  int shift = 0;
  if (!suffix.empty()) {
    switch (suffix[0]) {
      case 'K':
      case 'k':
        shift = 10;
        break;
      case 'M':
      case 'm':
        shift = 20;
        break;
      case 'G':
      case 'g':
        shift = 30;
        break;
      case 'T':
      case 't':
        shift = 40;
        break;
      case 'B':
      case 'b':
        break;
      default:
        return std::nullopt;
    }
    if (shift != 0) suffix.remove_prefix(1);
    if (!(suffix.empty() || suffix == "B" || suffix == "iB" || suffix == "b")) return std::nullopt;
  }
  if (shift != 0 && value > (UINT64_MAX >> shift)) return std::nullopt;
  return value << shift;
}

std::string WhyNotASize(std::string_view text) {
  const std::string quoted = "`" + Printable(text) + "` is not a size: ";
  const size_t digits = text.find_first_not_of("0123456789");
  if (digits != std::string_view::npos && text[digits] == '.') {
    return quoted + "whole numbers only (1536M, not 1.5G)";
  }
  // Digits and a unit that each read (the unit tried on 1): too many.
  const std::string unit(digits == std::string_view::npos ? "" : text.substr(digits));
  if (digits != 0 && !text.empty() && ParseSize("1" + unit)) {
    return quoted + "more than 64 bits of bytes";
  }
  return quoted + "a whole number of bytes, or of K, M, G or T (binary: 64G, 512M)";
}

}  // namespace weightd::protocol
