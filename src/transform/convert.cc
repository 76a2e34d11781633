#include "transform/convert.h"

#include <algorithm>
#include <bit>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace weightd::transform {
namespace {

using format::DType;

// The hot loops are built twice, for the baseline and for AVX2, and the
// machine picks at load time.
#define WEIGHTD_VECTOR_CLONES __attribute__((target_clones("avx2", "default")))

// Elements are read and written with memcpy in host order, which is the
// format's little-endian order on every machine weightd builds for.
static_assert(std::endian::native == std::endian::little);

template <typename T>
T Load(const std::byte* p, uint64_t i) {
  T v;
  std::memcpy(&v, p + i * sizeof(T), sizeof(T));
  return v;
}

template <typename T>
void Store(std::byte* p, uint64_t i, T v) {
  std::memcpy(p + i * sizeof(T), &v, sizeof(T));
}

float BF16ToFloat(uint16_t b) { return std::bit_cast<float>(static_cast<uint32_t>(b) << 16); }

float F16ToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0x1f) return std::bit_cast<float>(sign | 0x7f800000u | (mantissa << 13));
  if (exponent == 0) {  // subnormal: mantissa * 2^-24, exact in float
    const float magnitude = static_cast<float>(mantissa) * 0x1p-24f;
    return sign != 0 ? -magnitude : magnitude;
  }
  return std::bit_cast<float>(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

// Rounds a finite a >= 0 to a binary format with `mantissa_bits` stored
// bits, exponent bias `bias` and smallest normal exponent 1 - bias: the
// encoding as exponent field and mantissa, once, to nearest even. Overflow
// shows as an exponent field past the format's finite range.
uint32_t RoundDouble(double a, int mantissa_bits, int bias) {
  const int emin = 1 - bias;
  int e;
  std::frexp(a, &e);  // a = f * 2^e, f in [0.5, 1)
  int exponent = std::max(e - 1, emin);
  // a / 2^(exponent - mantissa_bits): exact, a power-of-two scaling.
  auto n = static_cast<uint64_t>(std::nearbyint(std::ldexp(a, mantissa_bits - exponent)));
  const uint64_t hidden = uint64_t{1} << mantissa_bits;
  if (n >= 2 * hidden) {  // rounded up to the next power of two
    n >>= 1;
    ++exponent;
  }
  if (n < hidden) return static_cast<uint32_t>(n);  // subnormal (exponent == emin) or zero
  return (static_cast<uint32_t>(exponent + bias) << mantissa_bits) |
         static_cast<uint32_t>(n - hidden);
}

uint16_t DoubleTo16(double x, int mantissa_bits, int bias, uint16_t infinity, uint16_t nan) {
  const uint16_t sign = std::signbit(x) ? 0x8000 : 0;
  if (std::isnan(x)) return sign | nan;
  if (std::isinf(x)) return sign | infinity;
  const uint32_t r = RoundDouble(std::fabs(x), mantissa_bits, bias);
  return static_cast<uint16_t>(sign | std::min<uint32_t>(r, infinity));
}

float ToFloat(DType from, const std::byte* src, uint64_t i) {
  switch (from) {
    case DType::kBF16:
      return BF16ToFloat(Load<uint16_t>(src, i));
    case DType::kF16:
      return F16ToFloat(Load<uint16_t>(src, i));
    case DType::kF32:
      return Load<float>(src, i);
    default:
      return static_cast<float>(Load<double>(src, i));
  }
}

}  // namespace

bool IsCastSource(DType d) {
  return d == DType::kF16 || d == DType::kBF16 || d == DType::kF32 || d == DType::kF64;
}

bool IsCastTarget(DType d) { return d == DType::kF16 || d == DType::kBF16 || d == DType::kF32; }

uint16_t FloatToBF16(float x) {
  uint32_t u = std::bit_cast<uint32_t>(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  // BF16 is F32's top half: round the dropped half to nearest, ties to the
  // even kept half. A carry moves into the exponent, up to infinity.
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// The two conversions below are branch-free, so that loops over them
// vectorize: every path is computed in 32-bit integers (|x| as bits fits a
// signed int) and the right one selected. No float is compared either: with
// trapping math (the default) the compiler would not turn that into a select.

uint16_t FloatToF16(float x) {
  const auto bits = std::bit_cast<int32_t>(x);
  const int32_t sign = (bits >> 16) & 0x8000;
  const int32_t u = bits & 0x7fffffff;
  // Normal results (from 2^-14): rebias the exponent, round 23 bits to 10.
  int32_t normal = u - ((127 - 15) << 23);
  normal = (normal + 0xfff + ((normal >> 13) & 1)) >> 13;
  // Below 2^-14, F16's subnormals are multiples of 2^-24: scale (exactly)
  // and round to an integer by the FPU's nearest-even addition. The clamp
  // keeps the unused lanes in range.
  const int32_t small = u < 0x38800000 ? u : 0x38800000;
  const float scaled = std::bit_cast<float>(small) * 16777216.0f;
  const auto subnormal = static_cast<int32_t>((scaled + 8388608.0f) - 8388608.0f);
  int32_t r = u < 0x38800000 ? subnormal : normal;
  r = u >= 0x477ff000 ? 0x7c00 : r;  // 65520 and up (the tie included) round to infinity
  r = u > 0x7f800000 ? 0x7e00 : r;   // NaN
  return static_cast<uint16_t>(sign | r);
}

namespace {

// c ? a : b, as masks: GCC if-converts the ternary in some loops and not in
// others (the quantization loop stayed scalar).
[[gnu::always_inline]] inline int32_t Select(bool c, int32_t a, int32_t b) {
  const int32_t mask = -static_cast<int32_t>(c);
  return (a & mask) | (b & ~mask);
}

// Always inlined: the quantization loop vectorizes only around it.
[[gnu::always_inline]] inline uint8_t ToE4M3(float x) {
  const auto bits = std::bit_cast<int32_t>(x);
  const int32_t sign = (bits >> 24) & 0x80;
  const int32_t u = bits & 0x7fffffff;
  // 448 and up, infinity included, saturate: 448's own encoding.
  const int32_t c = std::min(u, 0x43e00000);
  // Normal results (from 2^-6): rebias the exponent, round 23 bits to 3.
  int32_t normal = c - ((127 - 7) << 23);
  normal = (normal + 0x7ffff + ((normal >> 20) & 1)) >> 20;
  // Subnormal results are multiples of 2^-9.
  const int32_t small = std::min(c, 0x3c800000);
  const float scaled = std::bit_cast<float>(small) * 512.0f;
  const auto subnormal = static_cast<int32_t>((scaled + 8388608.0f) - 8388608.0f);
  const int32_t r = Select(c < 0x3c800000, subnormal, normal);
  // NaN: all ones but the sign (0x7e | 0x7f).
  return static_cast<uint8_t>(sign | r | Select(u > 0x7f800000, 0x7f, 0));
}

}  // namespace

uint8_t FloatToE4M3(float x) { return ToE4M3(x); }

uint16_t DoubleToBF16(double x) { return DoubleTo16(x, 7, 127, 0x7f80, 0x7fc0); }
uint16_t DoubleToF16(double x) { return DoubleTo16(x, 10, 15, 0x7c00, 0x7e00); }

namespace {

// Casts between F16, BF16 and F32 through float, in chunks copied through
// aligned local arrays (the bytes of a tensor in a file buffer need not be
// aligned), so that the conversion loops vectorize.
template <typename In, typename Out, typename Widen, typename Narrow>
void CastChunked(const std::byte* src, std::byte* dst, uint64_t count, Widen widen, Narrow narrow) {
  constexpr uint64_t kChunk = 1024;
  alignas(64) In in[kChunk];
  alignas(64) Out out[kChunk];
  for (uint64_t at = 0; at < count; at += kChunk) {
    const uint64_t n = std::min(kChunk, count - at);
    std::memcpy(in, src + at * sizeof(In), n * sizeof(In));
    for (uint64_t i = 0; i < n; ++i) out[i] = narrow(widen(in[i]));
    std::memcpy(dst + at * sizeof(Out), out, n * sizeof(Out));
  }
}

// As lambdas, so that they inline into the loops.
constexpr auto kFromBF16 = [](uint16_t b) { return BF16ToFloat(b); };
constexpr auto kFromF16 = [](uint16_t h) { return F16ToFloat(h); };
constexpr auto kToBF16 = [](float x) { return FloatToBF16(x); };
constexpr auto kToF16 = [](float x) { return FloatToF16(x); };
constexpr auto kSame = [](float x) { return x; };

WEIGHTD_VECTOR_CLONES
void CastFromBF16(const std::byte* s, DType to, std::byte* d, uint64_t count) {
  if (to == DType::kF16) return CastChunked<uint16_t, uint16_t>(s, d, count, kFromBF16, kToF16);
  CastChunked<uint16_t, float>(s, d, count, kFromBF16, kSame);
}

WEIGHTD_VECTOR_CLONES
void CastFromF16(const std::byte* s, DType to, std::byte* d, uint64_t count) {
  if (to == DType::kBF16) return CastChunked<uint16_t, uint16_t>(s, d, count, kFromF16, kToBF16);
  CastChunked<uint16_t, float>(s, d, count, kFromF16, kSame);
}

WEIGHTD_VECTOR_CLONES
void CastFromF32(const std::byte* s, DType to, std::byte* d, uint64_t count) {
  if (to == DType::kBF16) return CastChunked<float, uint16_t>(s, d, count, kSame, kToBF16);
  CastChunked<float, uint16_t>(s, d, count, kSame, kToF16);
}

}  // namespace

void Cast(DType from, std::span<const std::byte> src, DType to, std::span<std::byte> dst,
          uint64_t count) {
  const std::byte* s = src.data();
  std::byte* d = dst.data();
  if (from == to) {
    std::memcpy(d, s, src.size());
    return;
  }
  switch (from) {
    case DType::kBF16:
      return CastFromBF16(s, to, d, count);
    case DType::kF16:
      return CastFromF16(s, to, d, count);
    case DType::kF32:
      return CastFromF32(s, to, d, count);
    default:
      break;
  }
  // F64: rounded once, from the double itself (rare: no fast path).
  for (uint64_t i = 0; i < count; ++i) {
    const double v = Load<double>(s, i);
    switch (to) {
      case DType::kBF16:
        Store(d, i, DoubleToBF16(v));
        break;
      case DType::kF16:
        Store(d, i, DoubleToF16(v));
        break;
      default:
        Store(d, i, static_cast<float>(v));
        break;
    }
  }
}

namespace {

// |x| as bits, 0 for NaN and infinity: for finite non-negative floats the
// bit patterns order as the values do, so an integer max is the amax.
WEIGHTD_VECTOR_CLONES
void AmaxBits(const float* row, uint64_t cols, int32_t* block_max) {
  for (uint64_t b = 0; b * kFp8Block < cols; ++b) {
    int32_t m = block_max[b];
    const uint64_t end = std::min(cols, (b + 1) * kFp8Block);
    for (uint64_t c = b * kFp8Block; c < end; ++c) {
      const int32_t a = std::bit_cast<int32_t>(row[c]) & 0x7fffffff;
      m = std::max(m, a < 0x7f800000 ? a : 0);
    }
    block_max[b] = m;
  }
}

WEIGHTD_VECTOR_CLONES
void QuantizeRow(const float* row, uint64_t cols, const float* scale, uint8_t* out) {
  for (uint64_t b = 0; b * kFp8Block < cols; ++b) {
    const float s = scale[b];
    const uint64_t end = std::min(cols, (b + 1) * kFp8Block);
    for (uint64_t c = b * kFp8Block; c < end; ++c) out[c] = ToE4M3(row[c] / s);
  }
}

// The same two steps straight from BF16 bits (the common source), with no
// float row in between: |x| as BF16 bits orders as the values do too.
WEIGHTD_VECTOR_CLONES
void AmaxBF16(const uint16_t* row, uint64_t cols, int32_t* block_max) {
  for (uint64_t b = 0; b * kFp8Block < cols; ++b) {
    int16_t m = static_cast<int16_t>(block_max[b] >> 16);
    const uint64_t end = std::min(cols, (b + 1) * kFp8Block);
    for (uint64_t c = b * kFp8Block; c < end; ++c) {
      const auto a = static_cast<int16_t>(row[c] & 0x7fff);
      m = std::max(m, a < 0x7f80 ? a : int16_t{0});
    }
    block_max[b] = static_cast<int32_t>(m) << 16;  // as F32 bits
  }
}

WEIGHTD_VECTOR_CLONES
void QuantizeBF16Row(const uint16_t* row, uint64_t cols, const float* scale, uint8_t* out) {
  for (uint64_t b = 0; b * kFp8Block < cols; ++b) {
    const float s = scale[b];
    const uint64_t end = std::min(cols, (b + 1) * kFp8Block);
    for (uint64_t c = b * kFp8Block; c < end; ++c) out[c] = ToE4M3(BF16ToFloat(row[c]) / s);
  }
}

}  // namespace

void QuantizeFp8Block(DType from, std::span<const std::byte> src, uint64_t stride, uint64_t rows,
                      uint64_t cols, std::span<std::byte> dst, std::span<std::byte> scale_inv) {
  const uint64_t block_cols = CeilDiv(cols, kFp8Block);
  const bool bf16 = from == DType::kBF16;
  // One row at a time, copied to aligned memory (file bytes need not be).
  std::vector<float> row(bf16 ? 0 : cols);
  std::vector<uint16_t> raw(bf16 ? cols : 0);
  std::vector<int32_t> amax(block_cols);
  std::vector<float> scale(block_cols);
  auto load_row = [&](uint64_t r) {
    const uint64_t base = r * stride;
    if (bf16) {
      std::memcpy(raw.data(), src.data() + base * 2, cols * 2);
    } else {
      for (uint64_t c = 0; c < cols; ++c) row[c] = ToFloat(from, src.data(), base + c);
    }
  };
  for (uint64_t r0 = 0; r0 < rows; r0 += kFp8Block) {
    const uint64_t r1 = std::min(rows, r0 + kFp8Block);
    std::fill(amax.begin(), amax.end(), 0);
    for (uint64_t r = r0; r < r1; ++r) {
      load_row(r);
      if (bf16) {
        AmaxBF16(raw.data(), cols, amax.data());
      } else {
        AmaxBits(row.data(), cols, amax.data());
      }
    }
    for (uint64_t b = 0; b < block_cols; ++b) {
      const float m = std::bit_cast<float>(amax[b]);
      // A block whose largest value is under 448 times the least float
      // (F32 sources only) would get a scale of 0, and x / 0 is NaN: it
      // gets the least float instead, and its values still fit.
      scale[b] = m > 0.0f ? std::max(m / kE4M3Max, std::numeric_limits<float>::denorm_min()) : 1.0f;
      Store(scale_inv.data(), (r0 / kFp8Block) * block_cols + b, scale[b]);
    }
    for (uint64_t r = r0; r < r1; ++r) {
      load_row(r);
      auto* out = reinterpret_cast<uint8_t*>(dst.data() + r * cols);
      if (bf16) {
        QuantizeBF16Row(raw.data(), cols, scale.data(), out);
      } else {
        QuantizeRow(row.data(), cols, scale.data(), out);
      }
    }
  }
}

}  // namespace weightd::transform
