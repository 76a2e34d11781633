// The table at the start of every segment: which tensor lies where. An
// engine attaching to a 70,000-tensor model reads it straight from the
// mapping, fixed-size records and a string table, with no text to parse, so
// attaching costs microseconds per tensor.
//
// Layout (little-endian, every table 8-byte aligned):
//   header   64 bytes: magic "WDSEG01\0", manifest bytes, tensor count,
//            dimension count, string bytes, data offset, data bytes, 0
//   records  56 bytes each, by tensor name: name offset and length (into
//            the strings), rank, index of the first dimension, data offset
//            (from the segment's start), data bytes, dtype name (16 bytes,
//            NUL-padded)
//   dims     u64 each
//   strings  the names, back to back
//   data     from `data offset` (page aligned); each tensor at a multiple of
//            kTensorAlignment
//
// The reader trusts nothing: every offset, count and length is checked
// against the segment before use.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "weightd/result.h"

namespace weightd::memory {

inline constexpr uint64_t kTensorAlignment = 256;  // cache lines, and what GPU kernels like

// Views: whatever they point into must outlive the SegmentPlan made of them.
struct TensorLayout {
  std::string_view name;
  std::string_view dtype;  // safetensors spelling, e.g. "BF16"
  std::span<const uint64_t> shape;
  uint64_t bytes = 0;
  uint64_t offset = 0;  // set by PlanSegment; given to PlanPlacedSegment
};

struct SegmentPlan {
  std::vector<TensorLayout> tensors;  // by name
  uint64_t manifest_bytes = 0;
  uint64_t data_offset = 0;
  uint64_t total_bytes = 0;
};

// Places the tensors (sorted here by name; names must be unique and dtype
// names shorter than 16 bytes) and sizes the segment.
Result<SegmentPlan> PlanSegment(std::vector<TensorLayout> tensors);

// The bytes of a manifest of `tensors` records, `dims` dimensions in all and
// `name_bytes` of names, and where the data after one of `manifest_bytes`
// starts: what PlanSegment reserves, for a caller that places the tensors
// itself.
uint64_t ManifestBytes(uint64_t tensors, uint64_t dims, uint64_t name_bytes);
uint64_t DataOffsetAfter(uint64_t manifest_bytes);

// A plan of tensors placed already (sorted by name, each `offset` set, at a
// multiple of kTensorAlignment after the manifest) in a segment of
// `total_bytes`: checks that names are unique and in order, dtype names
// fit, and each tensor lies within the data (not that tensors do not
// overlap: the caller placed them), and sizes the manifest.
Result<SegmentPlan> PlanPlacedSegment(std::vector<TensorLayout> tensors, uint64_t total_bytes);

// Writes the manifest of `plan` into the start of `segment` (at least
// plan.manifest_bytes long).
void WriteManifest(const SegmentPlan& plan, std::span<std::byte> segment);

// Hands the manifest of `plan` to `put` in pieces of at most `piece_bytes`
// (at least 1), in order: offset 0 first, each piece where the one before
// ended, plan.manifest_bytes in all. The first error `put` returns ends it.
// The manifest of 70,000 tensors is 8 MB: written this way into a segment,
// it needs no buffer of its size.
Status StreamManifest(const SegmentPlan& plan, size_t piece_bytes,
                      const std::function<Status(uint64_t, std::span<const std::byte>)>& put);

struct TensorRecord {
  std::string_view name;
  std::string_view dtype;
  std::span<const uint64_t> shape;
  uint64_t offset = 0;
  uint64_t bytes = 0;
};

struct ManifestView {
  std::vector<TensorRecord> tensors;  // by name
  uint64_t data_offset = 0;
  uint64_t data_bytes = 0;
};

// Records a reader may make room for before it has checked them: a
// manifest's tensor count is only checked against its size, and a sparse
// memfd costs nothing for any size it claims.
inline constexpr uint64_t kReserveRecords = 1 << 20;

// What a manifest says of itself, checked: for callers that visit its
// tensors (VisitTensors) instead of collecting them.
struct ManifestSummary {
  uint64_t tensor_count = 0;
  uint64_t data_offset = 0;
  uint64_t data_bytes = 0;
  uint64_t manifest_bytes = 0;  // its tables' bytes, within the `manifest` given
  // What its header, records, dimensions and names take of that: all a
  // reader touches (manifest_bytes, the writer's word, may say more).
  uint64_t tables_bytes = 0;
};
// Checks a manifest's header and that its tables fit, for a segment of
// `segment_size` bytes (see ReadManifest for `manifest`).
Result<ManifestSummary> ReadManifestSummary(std::span<const std::byte> manifest,
                                            uint64_t segment_size);
// Hands every tensor to `visit`, by name, each record checked first: what
// ReadManifest collects, without a copy of the list (70,000 records are
// megabytes to fault in). The first error, a corrupt record's or one
// `visit` returns, ends it. The views point into `manifest`.
Status VisitTensors(std::span<const std::byte> manifest, uint64_t segment_size,
                    const std::function<Status(const TensorRecord&)>& visit);

// Reads and checks the manifest of a mapped segment. The views point into
// `segment`.
Result<ManifestView> ReadManifest(std::span<const std::byte> segment);
// The same for a segment of `segment_size` bytes that cannot be read here
// (a GPU's), from a copy of its manifest (at least the manifest's bytes).
Result<ManifestView> ReadManifest(std::span<const std::byte> manifest, uint64_t segment_size);

}  // namespace weightd::memory
