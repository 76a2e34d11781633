// Element conversions: dtype casts and FP8 block quantization. Pure
// functions over little-endian byte spans; safe from any thread.
//
// Every narrowing conversion rounds to nearest, ties to even, with the
// specials IEEE 754 gives them: NaN stays NaN (sign kept), infinities stay
// infinite where the target has them, values past the largest finite
// number become infinity (F16, BF16) or saturate (F8_E4M3, which has no
// infinity), and subnormals in source and target are exact or rounded like
// any other value. Widening conversions are exact.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "format/dtype.h"

namespace weightd::transform {

// The floating-point types a cast reads and writes.
bool IsCastSource(format::DType dtype);  // F16, BF16, F32, F64
bool IsCastTarget(format::DType dtype);  // F16, BF16, F32

// Rounds a float to the target encodings (the bits, in the low bits).
uint16_t FloatToBF16(float x);
uint16_t FloatToF16(float x);
// Saturating: beyond ±448 (infinities included) gives ±448; NaN gives the
// E4M3 NaN with x's sign.
uint8_t FloatToE4M3(float x);
// The same from a double, rounded once (not through float): for F64 sources.
uint16_t DoubleToBF16(double x);
uint16_t DoubleToF16(double x);

// Converts `count` elements of `from` in `src` into `to` in `dst`.
// REQUIRES: IsCastSource(from), IsCastTarget(to) or to == from;
// src.size() == count * size(from), dst.size() == count * size(to).
void Cast(format::DType from, std::span<const std::byte> src, format::DType to,
          std::span<std::byte> dst, uint64_t count);

inline constexpr uint64_t kFp8Block = 128;

// How many pieces of `per` cover `n`, the last one partial: without the
// wrap of (n + per - 1) / per, for sizes from files (a tensor of no bytes
// may claim a dimension of 2^64 - 1).
inline constexpr uint64_t CeilDiv(uint64_t n, uint64_t per) { return n / per + (n % per != 0); }
inline constexpr float kE4M3Max = 448.0f;

// Quantizes a [rows, cols] matrix of `from` (F16, BF16 or F32) into
// F8_E4M3 with one F32 scale per 128x128 block, the blocks counted from
// the matrix's first row and column: scale_inv[i][j] = amax / 448 over the
// block's finite values (1 for a block with none, or all zero), and
// q = E4M3(x / scale_inv), so x ≈ q * scale_inv.
// Row r of the matrix is `cols` elements of `src` from element r * stride
// (stride >= cols: a matrix cut out of a wider one); `dst` is rows * cols
// bytes and `scale_inv` ceil(rows/128) * ceil(cols/128) floats, row-major.
void QuantizeFp8Block(format::DType from, std::span<const std::byte> src, uint64_t stride,
                      uint64_t rows, uint64_t cols, std::span<std::byte> dst,
                      std::span<std::byte> scale_inv);

}  // namespace weightd::transform
