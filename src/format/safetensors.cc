#include "format/safetensors.h"

#include <simdjson.h>

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <numeric>

#include "format/json.h"
#include "format/rules.h"

namespace weightd::format {
namespace {

std::string Quote(std::string_view name) { return "tensor `" + std::string(name) + "`"; }

Error FileError(std::string_view label, std::string_view rule, const std::string& detail = "") {
  std::string msg = std::string(label) + ": " + std::string(rule);
  if (!detail.empty()) msg += " (" + detail + ")";
  return Error(msg);
}

Error TensorError(std::string_view label, std::string_view name, std::string_view rule,
                  const std::string& detail = "") {
  return FileError(label, Quote(name) + ": " + std::string(rule), detail);
}

Error NotJson(std::string_view label, simdjson::error_code err) {
  return FileError(label, rules::kHeaderNotJson, simdjson::error_message(err));
}

// What a field of a tensor's entry is.
enum class EntryField { kDType, kShape, kOffsets, kOther };

Result<EntryField> FieldOf(std::string_view label, json::od::field& field, const char* end) {
  // Keys are compared as the file spells them; one that escapes a
  // character is compared unescaped, as the reference reads it.
  const json::od::raw_json_string key = field.key();
  if (key == "dtype") return EntryField::kDType;
  if (key == "shape") return EntryField::kShape;
  if (key == "data_offsets") return EntryField::kOffsets;
  if (json::PlainText(key.raw(), end)) return EntryField::kOther;
  std::string_view text;
  if (auto err = field.unescaped_key().get(text)) return NotJson(label, err);
  return text == "dtype"          ? EntryField::kDType
         : text == "shape"        ? EntryField::kShape
         : text == "data_offsets" ? EntryField::kOffsets
                                  : EntryField::kOther;
}

// Hands each integer of the array `value` holds to `take`; false where it
// is not an array of unsigned integers.
template <typename Take>
bool ReadUnsigned(json::od::value& value, Take&& take) {
  json::od::array array;
  if (value.get_array().get(array) != simdjson::SUCCESS) return false;
  for (auto element : array) {
    uint64_t n;
    if (std::move(element).get_uint64().get(n) != simdjson::SUCCESS) return false;
    take(n);
  }
  return true;
}

// Where one header's tensor names and shapes are kept: the names back to
// back in one string, the dimensions one after another in one vector. Both
// grow while the header is parsed, so each entry's views are set once
// every entry is read.
struct EntryStorage {
  std::string names;
  std::vector<uint64_t> dims;
};

// Where one entry's name and shape lie in EntryStorage.
struct EntryAt {
  size_t name_first = 0;
  size_t name_bytes = 0;
  size_t dims_first = 0;
  size_t dims_count = 0;
};

// The fewest bytes of JSON a tensor's entry takes:
// "":{"dtype":"U8","shape":[],"data_offsets":[0,0]}
constexpr size_t kShortestEntryBytes = 49;

Result<TensorInfo> ParseTensorEntry(std::string_view label, std::string_view name,
                                    json::od::value value, const char* end, EntryStorage& storage,
                                    EntryAt& at) {
  json::od::object entry;
  if (value.get_object().get(entry) != simdjson::SUCCESS) {
    return TensorError(label, name, rules::kEntryNotObject);
  }
  TensorInfo info;
  at.name_first = storage.names.size();
  at.name_bytes = name.size();
  storage.names.append(name);
  bool have_dtype = false, have_shape = false, have_offsets = false;
  for (auto item : entry) {
    json::od::field field;
    if (auto err = std::move(item).get(field)) return NotJson(label, err);
    WEIGHTD_ASSIGN_OR_RETURN(const EntryField which, FieldOf(label, field, end));
    if (which == EntryField::kOther) {  // ignored, as by the reference, once read as JSON
      if (auto err = json::CheckValue(field.value(), 2, json::kMaxHeaderDepth))
        return NotJson(label, err);
      continue;
    }
    bool* seen = which == EntryField::kDType   ? &have_dtype
                 : which == EntryField::kShape ? &have_shape
                                               : &have_offsets;
    const char* key = which == EntryField::kDType   ? "dtype"
                      : which == EntryField::kShape ? "shape"
                                                    : "data_offsets";
    if (*seen) return TensorError(label, name, rules::kDuplicateField, key);
    *seen = true;
    if (which == EntryField::kDType) {
      std::string_view dtype_name;
      if (json::StringText(field.value()).get(dtype_name) != simdjson::SUCCESS) {
        return TensorError(label, name, rules::kUnknownDType, "dtype is not a string");
      }
      auto dtype = ParseDType(dtype_name);
      if (!dtype) return TensorError(label, name, rules::kUnknownDType, std::string(dtype_name));
      info.dtype = *dtype;
    } else if (which == EntryField::kShape) {
      at.dims_first = storage.dims.size();
      if (!ReadUnsigned(field.value(), [&](uint64_t d) { storage.dims.push_back(d); })) {
        return TensorError(label, name, rules::kBadShape);
      }
      at.dims_count = storage.dims.size() - at.dims_first;
    } else {
      uint64_t offsets[2];
      size_t n = 0;
      const bool ok = ReadUnsigned(field.value(), [&](uint64_t o) {
        if (n < 2) offsets[n] = o;
        ++n;
      });
      if (!ok || n != 2) return TensorError(label, name, rules::kBadOffsets);
      info.begin = offsets[0];
      info.end = offsets[1];
    }
  }
  if (!have_dtype) return TensorError(label, name, rules::kMissingField, "dtype");
  if (!have_shape) return TensorError(label, name, rules::kMissingField, "shape");
  if (!have_offsets) return TensorError(label, name, rules::kMissingField, "data_offsets");
  return info;
}

Status ParseMetadata(std::string_view label, json::od::value value, const char* end,
                     std::vector<std::pair<std::string, std::string>>& out) {
  bool null = false;
  if (value.is_null().get(null) == simdjson::SUCCESS && null) {
    return OkStatus();  // the reference reads a null map as none
  }
  json::od::object map;
  if (value.get_object().get(map) != simdjson::SUCCESS) {
    return FileError(label, rules::kMetadataNotStringMap);
  }
  for (auto item : map) {
    json::od::field field;
    if (auto err = std::move(item).get(field)) return NotJson(label, err);
    std::string_view key;
    if (auto err = json::KeyText(field, end).get(key)) return NotJson(label, err);
    std::string_view text;
    if (json::StringText(field.value()).get(text) != simdjson::SUCCESS) {
      return FileError(label, rules::kMetadataNotStringMap,
                       "value of `" + std::string(key) + "` is not a string");
    }
    out.emplace_back(std::string(key), std::string(text));
  }
  std::sort(out.begin(), out.end());
  for (size_t i = 1; i < out.size(); ++i) {
    if (out[i].first == out[i - 1].first) {
      return FileError(label, rules::kMetadataNotStringMap, "key `" + out[i].first + "` repeated");
    }
  }
  return OkStatus();
}

// The reference's validation: in offset order, every tensor starts where the
// previous one ended, its byte count follows from shape and dtype with no
// overflow, sub-byte tensors end on a byte boundary.
Result<uint64_t> ValidateLayout(std::string_view label, std::vector<TensorInfo>& tensors) {
  std::vector<uint32_t> order(tensors.size());
  std::iota(order.begin(), order.end(), 0u);
  auto by_offset = [&](uint32_t a, uint32_t b) {
    return std::pair(tensors[a].begin, tensors[a].end) <
           std::pair(tensors[b].begin, tensors[b].end);
  };
  if (!std::is_sorted(order.begin(), order.end(), by_offset)) {
    std::sort(order.begin(), order.end(), by_offset);
  }
  uint64_t expected_begin = 0;
  for (uint32_t i : order) {
    TensorInfo& t = tensors[i];
    if (t.begin != expected_begin || t.end < t.begin) {
      return TensorError(label, t.name, rules::kOffsetsContiguous,
                         "data_offsets [" + std::to_string(t.begin) + ", " + std::to_string(t.end) +
                             "], expected to begin at " + std::to_string(expected_begin));
    }
    uint64_t elements = 1;
    for (uint64_t d : t.shape) {
      if (__builtin_mul_overflow(elements, d, &elements)) {
        return TensorError(label, t.name, rules::kElementCountOverflow,
                           "shape " + ShapeString(t.shape));
      }
    }
    uint64_t bits;
    if (__builtin_mul_overflow(elements, uint64_t{DTypeBits(t.dtype)}, &bits)) {
      return TensorError(
          label, t.name, rules::kByteCountOverflow,
          "shape " + ShapeString(t.shape) + " of " + std::string(DTypeName(t.dtype)));
    }
    if (bits % 8 != 0) {
      return TensorError(
          label, t.name, rules::kSubByteBoundary,
          std::to_string(elements) + " elements of " + std::string(DTypeName(t.dtype)));
    }
    if (bits / 8 != t.end - t.begin) {
      return TensorError(label, t.name, rules::kSizeMismatch,
                         "shape " + ShapeString(t.shape) + " of " +
                             std::string(DTypeName(t.dtype)) + " is " + std::to_string(bits / 8) +
                             " bytes, data_offsets span " + std::to_string(t.end - t.begin));
    }
    t.elements = elements;
    expected_begin = t.end;
  }
  return expected_begin;
}

// The entries of the header `json` (`size` bytes, then at least
// SIMDJSON_PADDING readable ones), in the file's order.
Result<ShardHeader> ReadEntries(std::string_view label, const char* json, size_t size) {
  json::od::parser parser;
  if (parser.allocate(std::max<size_t>(size, 64), json::ParserDepth(json::kMaxHeaderDepth)) !=
      simdjson::SUCCESS) {
    return FileError(label, rules::kHeaderNotJson, "cannot allocate the parser");
  }
  json::od::document doc;
  if (auto err = parser.iterate(json, size, size + simdjson::SIMDJSON_PADDING).get(doc)) {
    return NotJson(label, err);
  }
  json::od::object object;
  if (doc.get_object().get(object) != simdjson::SUCCESS) {
    return FileError(label, rules::kHeaderNotObject);
  }
  ShardHeader header;
  header.header_bytes = size;
  size_t fields = 0;
  if (auto err = object.count_fields().get(fields)) return NotJson(label, err);
  // Room for the entries the text can hold: a hostile header's fields
  // may be far shorter than any tensor's.
  const size_t entries = std::min(fields, size / kShortestEntryBytes);
  header.tensors.reserve(entries);
  auto storage = std::make_shared<EntryStorage>();
  storage->names.reserve(entries * 48);  // a long name, about
  storage->dims.reserve(2 * entries);    // most tensors are matrices
  std::vector<EntryAt> places;
  places.reserve(entries);
  const char* end = json + size;
  bool have_metadata = false;
  for (auto item : object) {
    json::od::field field;
    if (auto err = std::move(item).get(field)) return NotJson(label, err);
    std::string_view name;
    if (auto err = json::KeyText(field, end).get(name)) return NotJson(label, err);
    if (name == "__metadata__") {
      if (have_metadata) return FileError(label, rules::kDuplicateName, "__metadata__");
      have_metadata = true;
      WEIGHTD_RETURN_IF_ERROR(ParseMetadata(label, field.value(), end, header.metadata));
      continue;
    }
    EntryAt& at = places.emplace_back();
    WEIGHTD_ASSIGN_OR_RETURN(TensorInfo info,
                             ParseTensorEntry(label, name, field.value(), end, *storage, at));
    header.tensors.push_back(info);
  }
  if (!json::AtEnd(doc)) return NotJson(label, simdjson::TRAILING_CONTENT);
  // Kept as long as the header: not twice what the names take.
  if (storage->names.capacity() > 2 * storage->names.size()) storage->names.shrink_to_fit();
  const std::string_view names = storage->names;
  const uint64_t* dims = storage->dims.data();
  for (size_t i = 0; i < places.size(); ++i) {
    header.tensors[i].name = names.substr(places[i].name_first, places[i].name_bytes);
    header.tensors[i].shape = std::span(dims + places[i].dims_first, places[i].dims_count);
  }
  header.storage = std::move(storage);
  return header;
}

// Parses and validates the header `json` (`size` bytes, then at least
// SIMDJSON_PADDING readable ones) of a file of `file_size` bytes. The caller
// holds a ParseTurn for it.
Result<ShardHeader> ParseJson(std::string_view label, const char* json, size_t size,
                              uint64_t file_size) {
  if (!simdjson::validate_utf8(json, size)) {
    return FileError(label, rules::kHeaderNotUtf8);
  }
  auto entries = ReadEntries(label, json, size);
  if (!entries.ok()) {
    // Reading stops at the first thing amiss, which is the JSON itself
    // where a full parse finds it broken anywhere: then that is the error.
    if (auto err = json::DomError(json, size, json::kMaxHeaderDepth)) return NotJson(label, err);
    return entries.error();
  }
  ShardHeader header = std::move(entries).value();

  // Writers mostly list tensors by name already; checking is cheaper than
  // sorting 70,000 names again.
  auto by_name = [](const TensorInfo& a, const TensorInfo& b) { return a.name < b.name; };
  if (!std::is_sorted(header.tensors.begin(), header.tensors.end(), by_name)) {
    std::sort(header.tensors.begin(), header.tensors.end(), by_name);
  }
  for (size_t i = 1; i < header.tensors.size(); ++i) {
    if (header.tensors[i].name == header.tensors[i - 1].name) {
      return TensorError(label, header.tensors[i].name, rules::kDuplicateName);
    }
  }

  WEIGHTD_ASSIGN_OR_RETURN(header.data_bytes, ValidateLayout(label, header.tensors));
  if (header.file_size() != file_size) {
    return FileError(label, rules::kDataRegionEnd,
                     "tensors end at byte " + std::to_string(header.file_size()) + ", file has " +
                         std::to_string(file_size));
  }
  return header;
}

}  // namespace

// What the ParseTurns held add up to, process-wide.
struct ParseBudget {
  std::mutex mu;
  std::condition_variable room;
  uint64_t held = 0;
};

ParseBudget& TheParseBudget() {
  static ParseBudget budget;
  return budget;
}

ParseTurn::ParseTurn(uint64_t bytes) {
  if (bytes == 0) return;
  ParseBudget& b = TheParseBudget();
  std::unique_lock lock(b.mu);
  // Alone where it is over the budget by itself; past the wait's limit,
  // whatever is held.
  b.room.wait_for(lock, kParseTurnWaitLimit,
                  [&] { return b.held == 0 || b.held + bytes <= kParseBudgetBytes; });
  b.held += bytes;
  bytes_ = bytes;
}

ParseTurn& ParseTurn::operator=(ParseTurn&& other) noexcept {
  if (this != &other) {
    Release();
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

void ParseTurn::Release() {
  if (bytes_ == 0) return;
  ParseBudget& b = TheParseBudget();
  {
    const std::lock_guard lock(b.mu);
    b.held -= bytes_;
  }
  bytes_ = 0;
  b.room.notify_all();
}

std::string ShapeString(std::span<const uint64_t> shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

const TensorInfo* ShardHeader::Find(std::string_view name) const {
  auto it = std::lower_bound(tensors.begin(), tensors.end(), name,
                             [](const TensorInfo& t, std::string_view n) { return t.name < n; });
  if (it == tensors.end() || it->name != name) return nullptr;
  return &*it;
}

Result<uint64_t> DecodeHeaderLength(std::string_view label, std::span<const std::byte> prefix,
                                    uint64_t file_size) {
  if (file_size < kHeaderLengthBytes || prefix.size() < kHeaderLengthBytes) {
    return FileError(
        label, rules::kFileTooShort,
        "file has " + std::to_string(std::min<uint64_t>(file_size, prefix.size())) + " bytes");
  }
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<uint64_t>(prefix[static_cast<size_t>(i)]);
  if (n > kMaxHeaderBytes) {
    return FileError(label, rules::kHeaderTooLarge, "the file says " + std::to_string(n));
  }
  if (n > file_size - kHeaderLengthBytes) {
    return FileError(label, rules::kHeaderPastEof,
                     "header of " + std::to_string(n) + " bytes, file has " +
                         std::to_string(file_size - kHeaderLengthBytes) + " after the length");
  }
  return n;
}

Result<ShardHeader> ParseHeader(std::string_view label, std::span<const std::byte> json,
                                uint64_t file_size) {
  const ParseTurn turn(json.size());
  const simdjson::padded_string padded(reinterpret_cast<const char*>(json.data()), json.size());
  return ParseJson(label, padded.data(), padded.size(), file_size);
}

static_assert(kParsePaddingBytes >= simdjson::SIMDJSON_PADDING);

Result<ShardHeader> ParsePaddedHeader(std::string_view label, std::span<const std::byte> json,
                                      uint64_t file_size, const ParseTurn& /*turn*/) {
  return ParseJson(label, reinterpret_cast<const char*>(json.data()), json.size(), file_size);
}

Status HeaderAllowance::Take(std::string_view label, uint64_t header_bytes) {
  // Each length is at most 100,000,000 (DecodeHeaderLength): the sum of a
  // checkpoint's, which stops growing past the limit, cannot overflow.
  const uint64_t before = taken_.fetch_add(header_bytes);
  if (before + header_bytes <= kMaxCheckpointHeaderBytes) return OkStatus();
  taken_.fetch_sub(header_bytes);
  return FileError(label, rules::kHeadersTooLarge,
                   "its header of " + std::to_string(header_bytes) + " bytes, after " +
                       std::to_string(before) + " in the others read so far");
}

Result<ShardHeader> ReadShardHeader(const io::RandomAccessFile& file, std::string_view label,
                                    HeaderBytes* raw, HeaderAllowance* allowance) {
  std::byte prefix[kHeaderLengthBytes] = {};
  const uint64_t size = file.size();
  if (size >= kHeaderLengthBytes) WEIGHTD_RETURN_IF_ERROR(file.ReadExactly(0, prefix));
  WEIGHTD_ASSIGN_OR_RETURN(uint64_t n, DecodeHeaderLength(label, prefix, size));
  if (allowance != nullptr) WEIGHTD_RETURN_IF_ERROR(allowance->Take(label, n));
  const ParseTurn turn(n);
  // The prefix and the JSON in one buffer, with the parser's padding after
  // them: read once, parsed where they lie, and kept as the raw bytes.
  HeaderBytes bytes;
  bytes.size_ = static_cast<size_t>(kHeaderLengthBytes + n);
  bytes.bytes_ = std::make_unique_for_overwrite<std::byte[]>(bytes.size_ + kParsePaddingBytes);
  std::memcpy(bytes.bytes_.get(), prefix, sizeof prefix);
  std::memset(bytes.bytes_.get() + bytes.size_, 0, kParsePaddingBytes);
  WEIGHTD_RETURN_IF_ERROR(
      file.ReadExactly(kHeaderLengthBytes,
                       std::span(bytes.bytes_.get() + kHeaderLengthBytes, static_cast<size_t>(n))));
  auto header =
      ParseJson(label, reinterpret_cast<const char*>(bytes.bytes_.get()) + kHeaderLengthBytes,
                static_cast<size_t>(n), size);
  if (header.ok() && raw != nullptr) *raw = std::move(bytes);
  return header;
}

}  // namespace weightd::format
