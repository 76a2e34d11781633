#include "format/dtype.h"

#include <gtest/gtest.h>

#include <cmath>

namespace weightd::format {
namespace {

std::vector<std::byte> B(std::initializer_list<int> v) {
  std::vector<std::byte> out;
  for (int x : v) out.push_back(static_cast<std::byte>(x));
  return out;
}

double D(DType t, std::initializer_list<int> bytes, uint64_t index = 0) {
  return std::get<double>(DecodeElement(t, B(bytes), index));
}

TEST(DType, EveryNameRoundTripsAndHasItsWidth) {
  for (int i = 0; i < kDTypeCount; ++i) {
    const auto t = static_cast<DType>(i);
    EXPECT_EQ(ParseDType(DTypeName(t)), t);
  }
  EXPECT_EQ(DTypeBits(*ParseDType("F4")), 4u);
  EXPECT_EQ(DTypeBits(*ParseDType("F6_E2M3")), 6u);
  EXPECT_EQ(DTypeBits(*ParseDType("F6_E3M2")), 6u);
  EXPECT_EQ(DTypeBits(*ParseDType("F8_E8M0")), 8u);
  EXPECT_EQ(DTypeBits(*ParseDType("F8_E4M3FNUZ")), 8u);
  EXPECT_EQ(DTypeBits(*ParseDType("C64")), 64u);
  EXPECT_EQ(DTypeBits(*ParseDType("BF16")), 16u);
  EXPECT_FALSE(ParseDType("bf16").has_value());
  EXPECT_FALSE(ParseDType("F8").has_value());
}

TEST(DType, HalfAndBrainFloat) {
  EXPECT_EQ(DecodeF16(0x3c00), 1.0f);
  EXPECT_EQ(DecodeF16(0xc000), -2.0f);
  EXPECT_EQ(DecodeF16(0x7bff), 65504.0f);
  EXPECT_EQ(DecodeF16(0x0001), std::ldexp(1.0f, -24));
  EXPECT_EQ(DecodeF16(0x0400), std::ldexp(1.0f, -14));
  EXPECT_TRUE(std::isinf(DecodeF16(0x7c00)));
  EXPECT_TRUE(std::isnan(DecodeF16(0x7e00)));
  EXPECT_TRUE(std::signbit(DecodeF16(0x8000)));
  EXPECT_EQ(DecodeBF16(0x3f80), 1.0f);
  EXPECT_EQ(DecodeBF16(0xc040), -3.0f);
  EXPECT_TRUE(std::isnan(DecodeBF16(0x7fc0)));
}

TEST(DType, EightBitFloatsAtTheirEdges) {
  EXPECT_EQ(DecodeMinifloat(DType::kF8_E4M3, 0x7e), 448.0);
  EXPECT_TRUE(std::isnan(DecodeMinifloat(DType::kF8_E4M3, 0x7f)));
  EXPECT_EQ(DecodeMinifloat(DType::kF8_E4M3, 0x01), std::ldexp(1.0, -9));
  EXPECT_EQ(DecodeMinifloat(DType::kF8_E4M3, 0x38), 1.0);
  EXPECT_EQ(DecodeMinifloat(DType::kF8_E5M2, 0x7b), 57344.0);
  EXPECT_TRUE(std::isinf(DecodeMinifloat(DType::kF8_E5M2, 0x7c)));
  EXPECT_TRUE(std::isnan(DecodeMinifloat(DType::kF8_E5M2, 0x7d)));
  EXPECT_EQ(DecodeMinifloat(DType::kF8_E5M2, 0x3c), 1.0);
  EXPECT_EQ(DecodeMinifloat(DType::kF8_E4M3FNUZ, 0x7f), 240.0);
  EXPECT_EQ(DecodeMinifloat(DType::kF8_E4M3FNUZ, 0x40), 1.0);
  EXPECT_TRUE(std::isnan(DecodeMinifloat(DType::kF8_E4M3FNUZ, 0x80)));
  EXPECT_EQ(DecodeMinifloat(DType::kF8_E5M2FNUZ, 0x7f), 57344.0);
  EXPECT_TRUE(std::isnan(DecodeMinifloat(DType::kF8_E5M2FNUZ, 0x80)));
  EXPECT_EQ(DecodeMinifloat(DType::kF8_E8M0, 127), 1.0);
  EXPECT_EQ(DecodeMinifloat(DType::kF8_E8M0, 0), std::ldexp(1.0, -127));
  EXPECT_TRUE(std::isnan(DecodeMinifloat(DType::kF8_E8M0, 0xff)));
}

TEST(DType, SubByteFloatsAtTheirEdges) {
  const double f4[] = {0, 0.5, 1, 1.5, 2, 3, 4, 6};
  for (uint32_t code = 0; code < 8; ++code) {
    EXPECT_EQ(DecodeMinifloat(DType::kF4, code), f4[code]);
    EXPECT_EQ(DecodeMinifloat(DType::kF4, code | 8), -f4[code]);
  }
  EXPECT_EQ(DecodeMinifloat(DType::kF6_E2M3, 0x1f), 7.5);
  EXPECT_EQ(DecodeMinifloat(DType::kF6_E2M3, 0x01), 0.125);
  EXPECT_EQ(DecodeMinifloat(DType::kF6_E3M2, 0x1f), 28.0);
  EXPECT_EQ(DecodeMinifloat(DType::kF6_E3M2, 0x01), 0.0625);
}

// Every non-NaN positive code of a float format decodes to a larger value
// than the code before it: catches a wrong bias, width or subnormal rule
// anywhere in the table, not just at the values checked above.
TEST(DType, SmallFloatCodesAreMonotonic) {
  struct Format {
    DType dtype;
    uint32_t positive_codes;
  };
  for (Format f : {Format{DType::kF4, 8}, Format{DType::kF6_E2M3, 32}, Format{DType::kF6_E3M2, 32},
                   Format{DType::kF8_E4M3, 128}, Format{DType::kF8_E5M2, 128},
                   Format{DType::kF8_E4M3FNUZ, 128}, Format{DType::kF8_E5M2FNUZ, 128},
                   Format{DType::kF8_E8M0, 256}}) {
    double previous = -1;
    for (uint32_t code = 0; code < f.positive_codes; ++code) {
      const double v = DecodeMinifloat(f.dtype, code);
      if (std::isnan(v)) continue;
      EXPECT_GT(v, previous) << DTypeName(f.dtype) << " code " << code;
      previous = v;
    }
  }
}

TEST(DType, F4PacksTheFirstElementInTheLowNibble) {
  EXPECT_EQ(D(DType::kF4, {0xd2}, 0), 1.0);   // low nibble 0x2
  EXPECT_EQ(D(DType::kF4, {0xd2}, 1), -3.0);  // high nibble 0xd
}

TEST(DType, F6IsALittleEndianBitStream) {
  // Elements 0..3 = codes 1, 2, 3, 0x1f packed LSB-first into 3 bytes.
  uint32_t stream = 1u | (2u << 6) | (3u << 12) | (0x1fu << 18);
  auto bytes = {static_cast<int>(stream & 0xff), static_cast<int>((stream >> 8) & 0xff),
                static_cast<int>((stream >> 16) & 0xff)};
  EXPECT_EQ(D(DType::kF6_E2M3, bytes, 0), 0.125);
  EXPECT_EQ(D(DType::kF6_E2M3, bytes, 1), 0.25);
  EXPECT_EQ(D(DType::kF6_E2M3, bytes, 2), 0.375);
  EXPECT_EQ(D(DType::kF6_E2M3, bytes, 3), 7.5);
}

TEST(DType, IntegersDecodeExactly) {
  auto u64 = DecodeElement(DType::kU64, B({0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff}), 0);
  EXPECT_EQ(std::get<uint64_t>(u64), UINT64_MAX);
  auto i64 = DecodeElement(DType::kI64, B({0, 0, 0, 0, 0, 0, 0, 0x80}), 0);
  EXPECT_EQ(std::get<int64_t>(i64), INT64_MIN);
  EXPECT_EQ(FormatElement(u64), "18446744073709551615");
  EXPECT_EQ(FormatElement(i64), "-9223372036854775808");
}

TEST(DType, FormatsFloatsShortAndComplexAsPairs) {
  EXPECT_EQ(FormatElement(0.5), "0.5");
  EXPECT_EQ(FormatElement(static_cast<double>(0.1f)), "0.1");
  EXPECT_EQ(FormatElement(-3.0), "-3");
  EXPECT_EQ(FormatElement(std::nan("")), "nan");
  EXPECT_EQ(FormatElement(-INFINITY), "-inf");
  EXPECT_EQ(FormatElement(Complex{1.5f, -2.0f}), "1.5-2j");
  EXPECT_EQ(FormatElement(Complex{0.0f, 2.0f}), "0+2j");
}

}  // namespace
}  // namespace weightd::format
