#include "memory/manifest.h"

#include <algorithm>
#include <cstddef>
#include <cstring>

namespace weightd::memory {
namespace {

constexpr char kMagic[8] = {'W', 'D', 'S', 'E', 'G', '0', '1', '\0'};
constexpr uint64_t kHeaderBytes = 64;
constexpr uint64_t kRecordBytes = 56;
constexpr uint64_t kDTypeField = 16;
constexpr uint64_t kPageBytes = 4096;

struct Header {
  char magic[8];
  uint64_t manifest_bytes;
  uint64_t tensor_count;
  uint64_t dims_count;
  uint64_t string_bytes;
  uint64_t data_offset;
  uint64_t data_bytes;
  uint64_t zero;
};
static_assert(sizeof(Header) == kHeaderBytes);

struct Record {
  uint64_t name_offset;
  uint32_t name_length;
  uint32_t rank;
  uint64_t first_dim;
  uint64_t offset;
  uint64_t bytes;
  char dtype[kDTypeField];
};
static_assert(sizeof(Record) == kRecordBytes);

// A dtype field: a name of letters, digits and '_', then zeros to the end.
bool ValidDTypeField(const char (&field)[kDTypeField]) {
  size_t n = 0;
  while (n < kDTypeField && field[n] != '\0') {
    const char c = field[n];
    if (!((c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_')) {
      return false;
    }
    ++n;
  }
  if (n == 0 || n == kDTypeField) return false;
  for (size_t i = n; i < kDTypeField; ++i) {
    if (field[i] != '\0') return false;
  }
  return true;
}

uint64_t RoundUp(uint64_t n, uint64_t to) { return (n + to - 1) / to * to; }

// a + b, or false on overflow.
bool Add(uint64_t a, uint64_t b, uint64_t* out) { return !__builtin_add_overflow(a, b, out); }
bool Mul(uint64_t a, uint64_t b, uint64_t* out) { return !__builtin_mul_overflow(a, b, out); }

Error Corrupt(const std::string& why) { return Error("segment manifest is corrupt: " + why); }

}  // namespace

uint64_t ManifestBytes(uint64_t tensors, uint64_t dims, uint64_t name_bytes) {
  return RoundUp(kHeaderBytes + tensors * kRecordBytes + dims * 8 + name_bytes, 8);
}

uint64_t DataOffsetAfter(uint64_t manifest_bytes) { return RoundUp(manifest_bytes, kPageBytes); }

namespace {

// Checks the names (each after the one before: sorted and unique) and the
// dtype names of `tensors`, and sizes their manifest in `plan`.
Status SizeManifest(const std::vector<TensorLayout>& tensors, SegmentPlan& plan) {
  uint64_t dims = 0, strings = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (i > 0 && !(tensors[i - 1].name < tensors[i].name)) {
      return Error("tensor `" + std::string(tensors[i].name) +
                   (tensors[i - 1].name == tensors[i].name ? "` twice in one segment"
                                                           : "` out of order by name"));
    }
    if (tensors[i].dtype.size() >= kDTypeField) {
      return Error("dtype name `" + std::string(tensors[i].dtype) +
                   "` is too long for a segment manifest");
    }
    dims += tensors[i].shape.size();
    strings += tensors[i].name.size();
  }
  plan.manifest_bytes = ManifestBytes(tensors.size(), dims, strings);
  plan.data_offset = DataOffsetAfter(plan.manifest_bytes);
  return OkStatus();
}

}  // namespace

Result<SegmentPlan> PlanPlacedSegment(std::vector<TensorLayout> tensors, uint64_t total_bytes) {
  SegmentPlan plan;
  WEIGHTD_RETURN_IF_ERROR(SizeManifest(tensors, plan));
  if (total_bytes < plan.data_offset) return Error("the segment is too small for its manifest");
  for (const TensorLayout& t : tensors) {
    uint64_t end;
    if (t.offset < plan.data_offset || t.offset % kTensorAlignment != 0 ||
        !Add(t.offset, t.bytes, &end) || end > total_bytes) {
      return Error("tensor `" + std::string(t.name) + "` is placed outside the segment's data");
    }
  }
  plan.total_bytes = total_bytes;
  plan.tensors = std::move(tensors);
  return plan;
}

Result<SegmentPlan> PlanSegment(std::vector<TensorLayout> tensors) {
  auto by_name = [](const TensorLayout& a, const TensorLayout& b) { return a.name < b.name; };
  if (!std::is_sorted(tensors.begin(), tensors.end(), by_name)) {
    std::sort(tensors.begin(), tensors.end(), by_name);
  }
  SegmentPlan plan;
  WEIGHTD_RETURN_IF_ERROR(SizeManifest(tensors, plan));
  uint64_t at = plan.data_offset;
  for (TensorLayout& t : tensors) {
    t.offset = at;
    // Sizes come from files: sparse ones can claim more than fits in 64 bits.
    if (!Add(at, t.bytes, &at) || !Add(at, kTensorAlignment - 1, &at)) {
      return Error("the tensors' sizes add up to more than a segment can hold");
    }
    at = at / kTensorAlignment * kTensorAlignment;
  }
  plan.total_bytes = at;
  plan.tensors = std::move(tensors);
  return plan;
}

namespace {

// Bytes handed on in order, a piece at a time.
class PieceWriter {
 public:
  PieceWriter(size_t piece_bytes,
              const std::function<Status(uint64_t, std::span<const std::byte>)>& put)
      : piece_bytes_(std::max<size_t>(piece_bytes, 1)), put_(put) {
    buffer_.reserve(piece_bytes_);
  }

  Status Add(const void* data, size_t n) {
    const auto* from = static_cast<const std::byte*>(data);
    while (n > 0) {
      const size_t take = std::min(n, piece_bytes_ - buffer_.size());
      buffer_.insert(buffer_.end(), from, from + take);
      from += take;
      n -= take;
      if (buffer_.size() == piece_bytes_) WEIGHTD_RETURN_IF_ERROR(Flush());
    }
    return OkStatus();
  }
  Status Zeros(uint64_t n) {
    static constexpr std::byte kZeros[256] = {};
    for (; n > 0; n -= std::min<uint64_t>(n, sizeof kZeros)) {
      WEIGHTD_RETURN_IF_ERROR(
          Add(kZeros, static_cast<size_t>(std::min<uint64_t>(n, sizeof kZeros))));
    }
    return OkStatus();
  }
  Status Flush() {
    if (buffer_.empty()) return OkStatus();
    WEIGHTD_RETURN_IF_ERROR(put_(at_, buffer_));
    at_ += buffer_.size();
    buffer_.clear();
    return OkStatus();
  }
  uint64_t written() const { return at_ + buffer_.size(); }

 private:
  const size_t piece_bytes_;
  const std::function<Status(uint64_t, std::span<const std::byte>)>& put_;
  std::vector<std::byte> buffer_;
  uint64_t at_ = 0;
};

}  // namespace

Status StreamManifest(const SegmentPlan& plan, size_t piece_bytes,
                      const std::function<Status(uint64_t, std::span<const std::byte>)>& put) {
  uint64_t dims = 0, strings = 0;
  for (const TensorLayout& t : plan.tensors) {
    dims += t.shape.size();
    strings += t.name.size();
  }
  Header h{};
  std::memcpy(h.magic, kMagic, sizeof kMagic);
  h.manifest_bytes = plan.manifest_bytes;
  h.tensor_count = plan.tensors.size();
  h.dims_count = dims;
  h.string_bytes = strings;
  h.data_offset = plan.data_offset;
  h.data_bytes = plan.total_bytes - plan.data_offset;
  // The header, the records, the dimensions, the names: back to back.
  PieceWriter out(piece_bytes, put);
  WEIGHTD_RETURN_IF_ERROR(out.Add(&h, sizeof h));
  uint64_t dim = 0, name_at = 0;
  for (const TensorLayout& t : plan.tensors) {
    Record r{};
    r.name_offset = name_at;
    r.name_length = static_cast<uint32_t>(t.name.size());
    r.rank = static_cast<uint32_t>(t.shape.size());
    r.first_dim = dim;
    r.offset = t.offset;
    r.bytes = t.bytes;
    std::memcpy(r.dtype, t.dtype.data(), t.dtype.size());
    WEIGHTD_RETURN_IF_ERROR(out.Add(&r, sizeof r));
    dim += t.shape.size();
    name_at += t.name.size();
  }
  for (const TensorLayout& t : plan.tensors) {
    WEIGHTD_RETURN_IF_ERROR(out.Add(t.shape.data(), t.shape.size() * sizeof(uint64_t)));
  }
  for (const TensorLayout& t : plan.tensors) {
    WEIGHTD_RETURN_IF_ERROR(out.Add(t.name.data(), t.name.size()));
  }
  WEIGHTD_RETURN_IF_ERROR(out.Zeros(plan.manifest_bytes - out.written()));
  return out.Flush();
}

void WriteManifest(const SegmentPlan& plan, std::span<std::byte> segment) {
  // Into memory the caller sized: nothing can fail.
  (void)StreamManifest(plan, 1 << 16, [&](uint64_t at, std::span<const std::byte> piece) {
    std::memcpy(segment.data() + at, piece.data(), piece.size());
    return OkStatus();
  });
}

namespace {

// A manifest's header, checked against its tables and a segment of `size`
// bytes, and where its tables are.
struct CheckedHeader {
  Header h;
  uint64_t dims_at = 0;
  uint64_t strings_at = 0;
  uint64_t data_end = 0;
  uint64_t tables_end = 0;
};

Result<CheckedHeader> CheckHeader(std::span<const std::byte> manifest, uint64_t size) {
  if (manifest.size() < kHeaderBytes) return Corrupt("shorter than its header");
  CheckedHeader c;
  Header& h = c.h;
  std::memcpy(&h, manifest.data(), sizeof h);
  if (std::memcmp(h.magic, kMagic, sizeof kMagic) != 0) return Corrupt("wrong magic");
  if (h.zero != 0) return Corrupt("a reserved field is set");
  uint64_t records_bytes, dims_bytes, end;
  if (!Mul(h.tensor_count, kRecordBytes, &records_bytes) || !Mul(h.dims_count, 8, &dims_bytes) ||
      !Add(kHeaderBytes, records_bytes, &end) || !Add(end, dims_bytes, &end) ||
      !Add(end, h.string_bytes, &end) || end > h.manifest_bytes ||
      h.manifest_bytes > manifest.size() || h.manifest_bytes > size) {
    return Corrupt("its tables do not fit");
  }
  if (h.data_offset < h.manifest_bytes || !Add(h.data_offset, h.data_bytes, &c.data_end) ||
      c.data_end > size) {
    return Corrupt("its data region does not fit");
  }
  c.dims_at = kHeaderBytes + records_bytes;
  c.strings_at = c.dims_at + dims_bytes;
  c.tables_end = end;
  return c;
}

}  // namespace

Result<ManifestSummary> ReadManifestSummary(std::span<const std::byte> manifest, uint64_t size) {
  WEIGHTD_ASSIGN_OR_RETURN(CheckedHeader c, CheckHeader(manifest, size));
  return ManifestSummary{c.h.tensor_count, c.h.data_offset, c.h.data_bytes, c.h.manifest_bytes,
                         c.tables_end};
}

Status VisitTensors(std::span<const std::byte> manifest, uint64_t size,
                    const std::function<Status(const TensorRecord&)>& visit) {
  WEIGHTD_ASSIGN_OR_RETURN(CheckedHeader c, CheckHeader(manifest, size));
  const Header& h = c.h;
  const std::byte* base = manifest.data();
  // The mapping is page aligned and every table starts at a multiple of 8.
  const auto* all_dims = reinterpret_cast<const uint64_t*>(base + c.dims_at);
  const auto* strings = reinterpret_cast<const char*>(base + c.strings_at);
  std::string_view previous;
  for (uint64_t i = 0; i < h.tensor_count; ++i) {
    Record r;
    std::memcpy(&r, base + kHeaderBytes + i * kRecordBytes, sizeof r);
    uint64_t name_end, dims_end, tensor_end;
    if (!Add(r.name_offset, r.name_length, &name_end) || name_end > h.string_bytes ||
        !Add(r.first_dim, r.rank, &dims_end) || dims_end > h.dims_count ||
        r.offset < h.data_offset || !Add(r.offset, r.bytes, &tensor_end) ||
        tensor_end > c.data_end || r.offset % 8 != 0 || !ValidDTypeField(r.dtype)) {
      return Corrupt("record " + std::to_string(i) + " points outside the segment");
    }
    TensorRecord t;
    t.name = std::string_view(strings + r.name_offset, r.name_length);
    // Views point into the segment, not into the copy on this stack frame.
    const auto* dtype = reinterpret_cast<const char*>(base + kHeaderBytes + i * kRecordBytes +
                                                      offsetof(Record, dtype));
    t.dtype = std::string_view(dtype, ::strnlen(dtype, kDTypeField));
    t.shape = std::span(all_dims + r.first_dim, r.rank);
    t.offset = r.offset;
    t.bytes = r.bytes;
    if (i > 0 && !(previous < t.name)) return Corrupt("tensor names are not sorted and unique");
    previous = t.name;
    WEIGHTD_RETURN_IF_ERROR(visit(t));
  }
  return OkStatus();
}

Result<ManifestView> ReadManifest(std::span<const std::byte> segment) {
  return ReadManifest(segment, segment.size());
}

Result<ManifestView> ReadManifest(std::span<const std::byte> manifest, uint64_t size) {
  WEIGHTD_ASSIGN_OR_RETURN(ManifestSummary summary, ReadManifestSummary(manifest, size));
  ManifestView view;
  view.data_offset = summary.data_offset;
  view.data_bytes = summary.data_bytes;
  // The count is untrusted, and a sparse memfd makes any size look backed.
  view.tensors.reserve(static_cast<size_t>(std::min(summary.tensor_count, kReserveRecords)));
  WEIGHTD_RETURN_IF_ERROR(VisitTensors(manifest, size, [&](const TensorRecord& t) {
    view.tensors.push_back(t);
    return OkStatus();
  }));
  return view;
}

}  // namespace weightd::memory
