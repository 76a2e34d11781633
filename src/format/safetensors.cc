#include "format/safetensors.h"

#include <simdjson.h>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <numeric>

#include "format/rules.h"

namespace weightd::format {
namespace {

// serde_json, which the reference implementation parses with, stops at 128
// levels; a valid header needs 3. Bounding the depth bounds the parser's
// stack and memory for hostile input.
constexpr size_t kMaxJsonDepth = 128;

constexpr size_t kLargeJsonBytes = 4 << 20;

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

Result<TensorInfo> ParseTensorEntry(std::string_view label, std::string_view name,
                                    simdjson::dom::element value) {
  simdjson::dom::object entry;
  if (value.get_object().get(entry) != simdjson::SUCCESS) {
    return TensorError(label, name, rules::kEntryNotObject);
  }
  TensorInfo info;
  info.name = std::string(name);
  bool have_dtype = false, have_shape = false, have_offsets = false;
  for (auto field : entry) {
    const std::string_view key = field.key;
    bool* seen = key == "dtype"          ? &have_dtype
                 : key == "shape"        ? &have_shape
                 : key == "data_offsets" ? &have_offsets
                                         : nullptr;
    if (seen == nullptr) continue;  // unknown fields are ignored, as by the reference
    if (*seen) return TensorError(label, name, rules::kDuplicateField, std::string(key));
    *seen = true;
    if (key == "dtype") {
      std::string_view dtype_name;
      if (field.value.get_string().get(dtype_name) != simdjson::SUCCESS) {
        return TensorError(label, name, rules::kUnknownDType, "dtype is not a string");
      }
      auto dtype = ParseDType(dtype_name);
      if (!dtype) return TensorError(label, name, rules::kUnknownDType, std::string(dtype_name));
      info.dtype = *dtype;
    } else if (key == "shape") {
      simdjson::dom::array dims;
      if (field.value.get_array().get(dims) != simdjson::SUCCESS) {
        return TensorError(label, name, rules::kBadShape);
      }
      info.shape.reserve(dims.size());
      for (auto dim : dims) {
        uint64_t d;
        if (dim.get_uint64().get(d) != simdjson::SUCCESS) {
          return TensorError(label, name, rules::kBadShape);
        }
        info.shape.push_back(d);
      }
    } else {
      simdjson::dom::array offsets;
      if (field.value.get_array().get(offsets) != simdjson::SUCCESS || offsets.size() != 2) {
        return TensorError(label, name, rules::kBadOffsets);
      }
      if (offsets.at(0).get_uint64().get(info.begin) != simdjson::SUCCESS ||
          offsets.at(1).get_uint64().get(info.end) != simdjson::SUCCESS) {
        return TensorError(label, name, rules::kBadOffsets);
      }
    }
  }
  if (!have_dtype) return TensorError(label, name, rules::kMissingField, "dtype");
  if (!have_shape) return TensorError(label, name, rules::kMissingField, "shape");
  if (!have_offsets) return TensorError(label, name, rules::kMissingField, "data_offsets");
  return info;
}

Status ParseMetadata(std::string_view label, simdjson::dom::element value,
                     std::vector<std::pair<std::string, std::string>>& out) {
  if (value.is_null()) return OkStatus();  // the reference reads a null map as none
  simdjson::dom::object map;
  if (value.get_object().get(map) != simdjson::SUCCESS) {
    return FileError(label, rules::kMetadataNotStringMap);
  }
  for (auto field : map) {
    std::string_view text;
    if (field.value.get_string().get(text) != simdjson::SUCCESS) {
      return FileError(label, rules::kMetadataNotStringMap,
                       "value of `" + std::string(field.key) + "` is not a string");
    }
    out.emplace_back(std::string(field.key), std::string(text));
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

Result<ShardHeader> ParsePadded(std::string_view label, const simdjson::padded_string& json,
                                uint64_t file_size) {
  if (!simdjson::validate_utf8(json.data(), json.size())) {
    return FileError(label, rules::kHeaderNotUtf8);
  }
  const std::unique_lock<std::mutex> turn = TurnToParse(json.size());
  simdjson::dom::parser parser;
  if (parser.allocate(std::max<size_t>(json.size(), 64), kMaxJsonDepth) != simdjson::SUCCESS) {
    return FileError(label, rules::kHeaderNotJson, "cannot allocate the parser");
  }
  simdjson::dom::element root;
  if (auto err = parser.parse(json).get(root); err != simdjson::SUCCESS) {
    return FileError(label, rules::kHeaderNotJson, simdjson::error_message(err));
  }
  simdjson::dom::object object;
  if (root.get_object().get(object) != simdjson::SUCCESS) {
    return FileError(label, rules::kHeaderNotObject);
  }

  ShardHeader header;
  header.header_bytes = json.size();
  header.tensors.reserve(object.size());
  bool have_metadata = false;
  for (auto field : object) {
    if (field.key == "__metadata__") {
      if (have_metadata) return FileError(label, rules::kDuplicateName, "__metadata__");
      have_metadata = true;
      WEIGHTD_RETURN_IF_ERROR(ParseMetadata(label, field.value, header.metadata));
      continue;
    }
    WEIGHTD_ASSIGN_OR_RETURN(TensorInfo info, ParseTensorEntry(label, field.key, field.value));
    header.tensors.push_back(std::move(info));
  }

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

std::unique_lock<std::mutex> TurnToParse(size_t bytes) {
  static std::mutex large;
  if (bytes < kLargeJsonBytes) return {};
  return std::unique_lock(large);
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
  simdjson::padded_string padded(reinterpret_cast<const char*>(json.data()), json.size());
  return ParsePadded(label, padded, file_size);
}

Result<ShardHeader> ReadShardHeader(const io::RandomAccessFile& file, std::string_view label,
                                    std::string* raw) {
  std::byte prefix[kHeaderLengthBytes] = {};
  const uint64_t size = file.size();
  if (size >= kHeaderLengthBytes) WEIGHTD_RETURN_IF_ERROR(file.ReadExactly(0, prefix));
  WEIGHTD_ASSIGN_OR_RETURN(uint64_t n, DecodeHeaderLength(label, prefix, size));
  // Read straight into simdjson's padded buffer: the header is copied once.
  simdjson::padded_string json(static_cast<size_t>(n));
  WEIGHTD_RETURN_IF_ERROR(file.ReadExactly(
      kHeaderLengthBytes, std::span(reinterpret_cast<std::byte*>(json.data()), json.size())));
  if (raw != nullptr) {
    raw->assign(reinterpret_cast<const char*>(prefix), sizeof prefix);
    raw->append(json.data(), json.size());
  }
  return ParsePadded(label, json, size);
}

}  // namespace weightd::format
