// The element types of the safetensors format, their sizes in bits, and
// decoding of single elements to numbers (for `weightd inspect --values` and
// for tests). Everything here is a pure function; safe from any thread.
//
// Packing of sub-byte types, as the reference implementation and PyTorch
// store them: F4 (E2M1) holds two elements per byte, element 2k in the low
// nibble; F6_E2M3 and F6_E3M2 are a little-endian bit stream, element k in
// bits [6k, 6k+6) counting from bit 0 of byte 0. A sub-byte tensor must end
// on a byte boundary (the format's rule), so no partial byte is ever read.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <variant>

namespace weightd::format {

// In the reference implementation's declaration order, which is also the
// order its writer sorts by (descending) to keep wide types aligned.
enum class DType : uint8_t {
  kBool,
  kF4,
  kF6_E2M3,
  kF6_E3M2,
  kU8,
  kI8,
  kF8_E5M2,
  kF8_E4M3,
  kF8_E8M0,
  kF8_E4M3FNUZ,
  kF8_E5M2FNUZ,
  kI16,
  kU16,
  kF16,
  kBF16,
  kI32,
  kU32,
  kF32,
  kC64,
  kF64,
  kI64,
  kU64,
};

inline constexpr int kDTypeCount = 22;

// "BF16" -> kBF16; nullopt for a name the format does not define.
std::optional<DType> ParseDType(std::string_view name);
std::string_view DTypeName(DType dtype);

// Bits per element: 4, 6, 8, 16, 32 or 64.
uint32_t DTypeBits(DType dtype);

bool IsFloatingPoint(DType dtype);  // every float type, F8 and sub-byte ones included
bool IsComplex(DType dtype);

// One decoded element. Integers stay exact; floats widen to double (every
// format's values are exactly representable in double); C64 is a pair.
struct Complex {
  float re = 0;
  float im = 0;
};
using ElementValue = std::variant<int64_t, uint64_t, double, Complex>;

// REQUIRES: `data` holds at least (index + 1) elements of `dtype`.
ElementValue DecodeElement(DType dtype, std::span<const std::byte> data, uint64_t index);

// The number as text: integers in decimal, floats in the shortest form that
// reads back to the same value ("-3", "0.5", "nan", "inf"), C64 as "re+imj".
std::string FormatElement(const ElementValue& value);

// Decoders for the individual float formats; `bits` holds the encoding in
// its low bits. Exposed for tests and the transform layer.
float DecodeF16(uint16_t bits);
float DecodeBF16(uint16_t bits);
double DecodeMinifloat(DType dtype, uint32_t bits);  // F4, F6_*, F8_*

}  // namespace weightd::format
