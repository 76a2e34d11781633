// Writing safetensors files that the reference implementation reads back:
// tensors laid out in its order (widest dtype first, then by name, so every
// tensor's data is aligned to its element size), the JSON padded with spaces
// so the data region starts at a multiple of 8, and the same bytes for the
// same input. Files appear under their final name only once complete
// (written to a temporary name, then renamed).
//
// Thread safety: functions are reentrant; concurrent writes to the same path
// leave one of the complete files.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "format/safetensors.h"

namespace weightd::format {

struct TensorSpec {
  std::string name;
  DType dtype = DType::kU8;
  std::vector<uint64_t> shape;
};

// Where everything goes in one file, decided before any data is written.
struct ShardLayout {
  std::string header_json;  // padded; its length is the file's N
  // In data order; begin/end relative to the data region.
  std::vector<TensorInfo> tensors;
  // The specs the tensors' names and shapes point into; copies share them.
  std::shared_ptr<const std::vector<TensorSpec>> specs;
  uint64_t data_bytes = 0;

  uint64_t data_offset() const { return kHeaderLengthBytes + header_json.size(); }
  uint64_t file_size() const { return data_offset() + data_bytes; }
};

// Fails on duplicate names, sizes that overflow, sub-byte tensors that do not
// end on a byte boundary, and headers over the format's limit.
Result<ShardLayout> LayoutShard(std::vector<TensorSpec> tensors,
                                const std::vector<std::pair<std::string, std::string>>& metadata);

// Produces the bytes of `tensor` from `offset` (within the tensor) into `dst`.
using TensorFiller =
    std::function<void(const TensorInfo& tensor, uint64_t offset, std::span<std::byte> dst)>;

struct WriteOptions {
  // When set, only the first `sparse_prefix` bytes of each tensor are
  // written; the rest is left as a hole (reads as zeros, takes no disk).
  std::optional<uint64_t> sparse_prefix;
  // When false, a file that is at `path` when the new one is moved into
  // place is an error, and is left as it was: checked in the same step as
  // the move, so that nothing written meanwhile is overwritten.
  bool replace = true;
};

Status WriteShard(const std::string& path, const ShardLayout& layout, const TensorFiller& fill,
                  const WriteOptions& options = {});

// Convenience for small files held in memory: each tensor with its bytes.
struct TensorData {
  TensorSpec spec;
  std::vector<std::byte> bytes;
};
Status WriteSafetensors(const std::string& path, const std::vector<TensorData>& tensors,
                        const std::vector<std::pair<std::string, std::string>>& metadata = {});

// A JSON string literal for `text`, with the escapes JSON requires.
std::string JsonQuote(std::string_view text);

}  // namespace weightd::format
