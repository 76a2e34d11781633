// Applying a tensor's plan to its bytes, a band of output rows of one rank
// at a time: the loader reads the source rows a band needs (SourceRowsFor)
// and hands them here. Pure functions; safe from any thread.
#pragma once

#include <cstdint>
#include <span>

#include "format/dtype.h"
#include "transform/plan.h"

namespace weightd::transform {

// Source rows [first, last): empty where the band is all padding.
struct RowRange {
  uint64_t first = 0;
  uint64_t last = 0;
};

// The source rows that output rows [row0, row1) of `rank` come from.
RowRange SourceRowsFor(const OutputTensor& out, int rank, uint64_t row0, uint64_t row1);

// Bytes of one source row, and of one output row.
uint64_t SourceRowBytes(const OutputTensor& out, format::DType source_dtype);
uint64_t OutputRowBytes(const OutputTensor& out);

// Writes output rows [row0, row1) of `rank` into `dst` (that many output
// rows) from `src` (the rows SourceRowsFor gives, as the file has them).
// kQuantize: row0 is a multiple of 128, and `scales` receives the rows
// [row0 / 128, ceil(row1 / 128)) of the kScale output that follows it.
// REQUIRES: out.op != kScale; spans of the sizes above.
void ApplyRows(const OutputTensor& out, format::DType source_dtype, int rank, uint64_t row0,
               uint64_t row1, std::span<const std::byte> src, std::span<std::byte> dst,
               std::span<std::byte> scales);

}  // namespace weightd::transform
