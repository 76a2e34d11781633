#include "format/dtype.h"

#include <array>
#include <bit>
#include <charconv>
#include <cmath>
#include <cstring>
#include <limits>

namespace weightd::format {
namespace {

struct DTypeInfo {
  DType dtype;
  std::string_view name;
  uint32_t bits;
};

constexpr std::array<DTypeInfo, kDTypeCount> kDTypes = {{
    {DType::kBool, "BOOL", 8},
    {DType::kF4, "F4", 4},
    {DType::kF6_E2M3, "F6_E2M3", 6},
    {DType::kF6_E3M2, "F6_E3M2", 6},
    {DType::kU8, "U8", 8},
    {DType::kI8, "I8", 8},
    {DType::kF8_E5M2, "F8_E5M2", 8},
    {DType::kF8_E4M3, "F8_E4M3", 8},
    {DType::kF8_E8M0, "F8_E8M0", 8},
    {DType::kF8_E4M3FNUZ, "F8_E4M3FNUZ", 8},
    {DType::kF8_E5M2FNUZ, "F8_E5M2FNUZ", 8},
    {DType::kI16, "I16", 16},
    {DType::kU16, "U16", 16},
    {DType::kF16, "F16", 16},
    {DType::kBF16, "BF16", 16},
    {DType::kI32, "I32", 32},
    {DType::kU32, "U32", 32},
    {DType::kF32, "F32", 32},
    {DType::kC64, "C64", 64},
    {DType::kF64, "F64", 64},
    {DType::kI64, "I64", 64},
    {DType::kU64, "U64", 64},
}};

const DTypeInfo& Info(DType dtype) { return kDTypes[static_cast<size_t>(dtype)]; }

template <typename T>
T LoadLE(std::span<const std::byte> data, uint64_t index) {
  T value;
  std::memcpy(&value, data.data() + index * sizeof(T), sizeof(T));
  static_assert(std::endian::native == std::endian::little, "weightd assumes a little-endian host");
  return value;
}

// The parameters of a small float format: exponent and mantissa widths, bias,
// and which encodings are special.
struct Minifloat {
  int exponent_bits;
  int mantissa_bits;
  int bias;
  bool ieee_specials;   // all-ones exponent is inf (mantissa 0) or NaN
  bool fn_nan;          // only all-ones exponent and mantissa is NaN (E4M3 "fn")
  bool nan_is_negzero;  // FNUZ: 0x80 is the one NaN, there is no -0
  bool has_sign;
};

Minifloat MinifloatOf(DType dtype) {
  switch (dtype) {
    case DType::kF4:
      return {2, 1, 1, false, false, false, true};
    case DType::kF6_E2M3:
      return {2, 3, 1, false, false, false, true};
    case DType::kF6_E3M2:
      return {3, 2, 3, false, false, false, true};
    case DType::kF8_E5M2:
      return {5, 2, 15, true, false, false, true};
    case DType::kF8_E4M3:
      return {4, 3, 7, false, true, false, true};
    case DType::kF8_E4M3FNUZ:
      return {4, 3, 8, false, false, true, true};
    case DType::kF8_E5M2FNUZ:
      return {5, 2, 16, false, false, true, true};
    case DType::kF8_E8M0:
      return {8, 0, 127, false, false, false, false};
    default:
      return {0, 0, 0, false, false, false, false};
  }
}

}  // namespace

std::optional<DType> ParseDType(std::string_view name) {
  for (const auto& info : kDTypes) {
    if (info.name == name) return info.dtype;
  }
  return std::nullopt;
}

std::string_view DTypeName(DType dtype) { return Info(dtype).name; }

uint32_t DTypeBits(DType dtype) { return Info(dtype).bits; }

bool IsFloatingPoint(DType dtype) {
  switch (dtype) {
    case DType::kF4:
    case DType::kF6_E2M3:
    case DType::kF6_E3M2:
    case DType::kF8_E5M2:
    case DType::kF8_E4M3:
    case DType::kF8_E8M0:
    case DType::kF8_E4M3FNUZ:
    case DType::kF8_E5M2FNUZ:
    case DType::kF16:
    case DType::kBF16:
    case DType::kF32:
    case DType::kF64:
      return true;
    default:
      return false;
  }
}

bool IsComplex(DType dtype) { return dtype == DType::kC64; }

float DecodeF16(uint16_t bits) {
  const uint32_t sign = (bits >> 15) & 1u;
  const uint32_t exponent = (bits >> 10) & 0x1fu;
  const uint32_t mantissa = bits & 0x3ffu;
  float magnitude;
  if (exponent == 0) {
    magnitude = std::ldexp(static_cast<float>(mantissa), -24);  // subnormal: m * 2^-14 / 2^10
  } else if (exponent == 0x1f) {
    magnitude = mantissa == 0 ? std::numeric_limits<float>::infinity()
                              : std::numeric_limits<float>::quiet_NaN();
  } else {
    magnitude = std::ldexp(static_cast<float>(mantissa | 0x400u), static_cast<int>(exponent) - 25);
  }
  return sign ? -magnitude : magnitude;
}

float DecodeBF16(uint16_t bits) {
  // BF16 is the top half of an F32.
  return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16);
}

double DecodeMinifloat(DType dtype, uint32_t bits) {
  const Minifloat f = MinifloatOf(dtype);
  const int width = f.exponent_bits + f.mantissa_bits + (f.has_sign ? 1 : 0);
  const uint32_t sign = f.has_sign ? (bits >> (width - 1)) & 1u : 0;
  const uint32_t exponent = (bits >> f.mantissa_bits) & ((1u << f.exponent_bits) - 1);
  const uint32_t mantissa = bits & ((1u << f.mantissa_bits) - 1);
  const uint32_t exponent_max = (1u << f.exponent_bits) - 1;
  const double nan = std::numeric_limits<double>::quiet_NaN();

  if (dtype == DType::kF8_E8M0) {
    return exponent == 0xff ? nan : std::ldexp(1.0, static_cast<int>(exponent) - 127);
  }
  if (f.nan_is_negzero && sign == 1 && exponent == 0 && mantissa == 0) return nan;
  if (f.ieee_specials && exponent == exponent_max) {
    if (mantissa != 0) return nan;
    return sign ? -std::numeric_limits<double>::infinity()
                : std::numeric_limits<double>::infinity();
  }
  if (f.fn_nan && exponent == exponent_max && mantissa == (1u << f.mantissa_bits) - 1) return nan;

  double magnitude;
  if (exponent == 0) {
    magnitude = std::ldexp(static_cast<double>(mantissa), 1 - f.bias - f.mantissa_bits);
  } else {
    magnitude = std::ldexp(static_cast<double>(mantissa | (1u << f.mantissa_bits)),
                           static_cast<int>(exponent) - f.bias - f.mantissa_bits);
  }
  return sign ? -magnitude : magnitude;
}

ElementValue DecodeElement(DType dtype, std::span<const std::byte> data, uint64_t index) {
  switch (dtype) {
    case DType::kBool:
      return static_cast<uint64_t>(LoadLE<uint8_t>(data, index));
    case DType::kU8:
      return static_cast<uint64_t>(LoadLE<uint8_t>(data, index));
    case DType::kI8:
      return static_cast<int64_t>(LoadLE<int8_t>(data, index));
    case DType::kU16:
      return static_cast<uint64_t>(LoadLE<uint16_t>(data, index));
    case DType::kI16:
      return static_cast<int64_t>(LoadLE<int16_t>(data, index));
    case DType::kU32:
      return static_cast<uint64_t>(LoadLE<uint32_t>(data, index));
    case DType::kI32:
      return static_cast<int64_t>(LoadLE<int32_t>(data, index));
    case DType::kU64:
      return LoadLE<uint64_t>(data, index);
    case DType::kI64:
      return LoadLE<int64_t>(data, index);
    case DType::kF16:
      return static_cast<double>(DecodeF16(LoadLE<uint16_t>(data, index)));
    case DType::kBF16:
      return static_cast<double>(DecodeBF16(LoadLE<uint16_t>(data, index)));
    case DType::kF32:
      return static_cast<double>(LoadLE<float>(data, index));
    case DType::kF64:
      return LoadLE<double>(data, index);
    case DType::kC64:
      return Complex{LoadLE<float>(data, 2 * index), LoadLE<float>(data, 2 * index + 1)};
    case DType::kF8_E5M2:
    case DType::kF8_E4M3:
    case DType::kF8_E8M0:
    case DType::kF8_E4M3FNUZ:
    case DType::kF8_E5M2FNUZ:
      return DecodeMinifloat(dtype, LoadLE<uint8_t>(data, index));
    case DType::kF4: {
      const uint8_t byte = LoadLE<uint8_t>(data, index / 2);
      return DecodeMinifloat(dtype, index % 2 == 0 ? byte & 0x0fu : byte >> 4);
    }
    case DType::kF6_E2M3:
    case DType::kF6_E3M2: {
      const uint64_t bit = index * 6;
      const uint64_t first = bit / 8;
      uint32_t window = static_cast<uint32_t>(data[first]);
      if (bit % 8 > 2) window |= static_cast<uint32_t>(data[first + 1]) << 8;
      return DecodeMinifloat(dtype, (window >> (bit % 8)) & 0x3fu);
    }
  }
  return 0.0;
}

namespace {

std::string FormatDouble(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v < 0 ? "-inf" : "inf";
  char buf[64];
  // A value that came from a float prints in float's shortest form, so a
  // float 0.1 reads "0.1" rather than "0.10000000149011612".
  const float as_float = static_cast<float>(v);
  std::to_chars_result r = static_cast<double>(as_float) == v
                               ? std::to_chars(buf, buf + sizeof buf, as_float)
                               : std::to_chars(buf, buf + sizeof buf, v);
  return std::string(buf, r.ptr);
}

}  // namespace

std::string FormatElement(const ElementValue& value) {
  if (const auto* i = std::get_if<int64_t>(&value)) return std::to_string(*i);
  if (const auto* u = std::get_if<uint64_t>(&value)) return std::to_string(*u);
  if (const auto* d = std::get_if<double>(&value)) return FormatDouble(*d);
  const auto& c = std::get<Complex>(value);
  std::string im = FormatDouble(static_cast<double>(c.im));
  if (im[0] != '-') im = "+" + im;
  return FormatDouble(static_cast<double>(c.re)) + im + "j";
}

}  // namespace weightd::format
