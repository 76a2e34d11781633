#include "transform/apply.h"

#include <algorithm>
#include <cstring>

#include "transform/convert.h"

namespace weightd::transform {

RowRange SourceRowsFor(const OutputTensor& out, int rank, uint64_t row0, uint64_t row1) {
  const uint64_t base = out.RowOffset(rank);
  RowRange r;
  r.first = std::min(base + row0, out.source_rows);
  r.last = std::min(base + row1, out.source_rows);
  return r;
}

uint64_t SourceRowBytes(const OutputTensor& out, format::DType source_dtype) {
  return out.source_row_elems * format::DTypeBits(source_dtype) / 8;
}

uint64_t OutputRowBytes(const OutputTensor& out) {
  return out.row_elems * format::DTypeBits(out.dtype) / 8;
}

void ApplyRows(const OutputTensor& out, format::DType source_dtype, int rank, uint64_t row0,
               uint64_t row1, std::span<const std::byte> src, std::span<std::byte> dst,
               std::span<std::byte> scales) {
  const RowRange have = SourceRowsFor(out, rank, row0, row1);
  const uint64_t data_rows = have.last - have.first;
  const uint64_t in_row = SourceRowBytes(out, source_dtype);
  const uint64_t out_row = OutputRowBytes(out);
  const uint64_t skip = out.ColOffset(rank) * format::DTypeBits(source_dtype) / 8;
  const std::byte* s = src.data();
  std::byte* d = dst.data();
  switch (out.op) {
    case Op::kCopy:
      if (skip == 0 && in_row == out_row) {
        std::memcpy(d, s, static_cast<size_t>(data_rows * in_row));
      } else {
        for (uint64_t i = 0; i < data_rows; ++i) {
          std::memcpy(d + i * out_row, s + i * in_row + skip, static_cast<size_t>(out_row));
        }
      }
      break;
    case Op::kCast: {
      const uint64_t in_elem = format::DTypeBits(source_dtype) / 8;
      for (uint64_t i = 0; i < data_rows; ++i) {
        Cast(source_dtype,
             std::span(s + i * in_row + skip, static_cast<size_t>(out.row_elems * in_elem)),
             out.dtype, std::span(d + i * out_row, static_cast<size_t>(out_row)), out.row_elems);
      }
      break;
    }
    case Op::kQuantize:
      QuantizeFp8Block(source_dtype, src.subspan(static_cast<size_t>(skip)), out.source_row_elems,
                       data_rows, out.row_elems, dst, scales);
      break;
    case Op::kScale:
      break;
  }
  // Vocab padding: rows past the source are zeros.
  if (data_rows < row1 - row0) {
    std::memset(d + data_rows * out_row, 0,
                static_cast<size_t>((row1 - row0 - data_rows) * out_row));
  }
}

}  // namespace weightd::transform
