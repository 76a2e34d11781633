// Reading safetensors files: the 8-byte header length, the JSON header, and
// the validation rules of the reference implementation. A file is
//
//   [u64 little-endian N][N bytes of UTF-8 JSON][data region]
//
// where the JSON object maps tensor names to {dtype, shape, data_offsets}
// (offsets relative to the data region) plus an optional "__metadata__"
// string-to-string map. Everything read from a file is untrusted: every rule
// broken produces an Error naming the file, the tensor where there is one,
// and the rule, in the words of docs/format.md. Parsing costs time and memory
// linear in the header's size, whatever the header holds.
//
// Thread safety: pure functions; safe from any thread.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "format/dtype.h"
#include "io/file.h"
#include "weightd/result.h"

namespace weightd::format {

inline constexpr uint64_t kHeaderLengthBytes = 8;
inline constexpr uint64_t kMaxHeaderBytes = 100'000'000;

// A tensor's entry. `name` and `shape` are views into what holds the entry
// (a ShardHeader's storage, a ShardLayout's specs), valid while it or a copy
// of it lives: 70,000 tensors parsed are a few blocks of memory, not
// 140,000 allocations, which threads parsing headers at once would take
// turns for on the allocator's locks.
struct TensorInfo {
  std::string_view name;
  DType dtype = DType::kU8;
  std::span<const uint64_t> shape;
  uint64_t elements = 0;
  // [begin, end) relative to the start of the data region.
  uint64_t begin = 0;
  uint64_t end = 0;

  uint64_t bytes() const { return end - begin; }
};

struct ShardHeader {
  // The JSON's length N, as the file's first 8 bytes say.
  uint64_t header_bytes = 0;
  // Bytes of tensor data after the header; the file is exactly
  // data_offset() + data_bytes long.
  uint64_t data_bytes = 0;
  // Sorted by name.
  std::vector<TensorInfo> tensors;
  // "__metadata__", sorted by key.
  std::vector<std::pair<std::string, std::string>> metadata;
  // What the tensors' names and shapes point into; copies share it.
  std::shared_ptr<const void> storage;

  uint64_t data_offset() const { return kHeaderLengthBytes + header_bytes; }
  uint64_t file_size() const { return data_offset() + data_bytes; }

  // nullptr when absent. O(log n).
  const TensorInfo* Find(std::string_view name) const;
};

// "[2, 3]": a shape as errors and listings print it.
std::string ShapeString(std::span<const uint64_t> shape);

// Checks the 8-byte prefix against the file's size and returns N.
// `label` names the file in errors.
Result<uint64_t> DecodeHeaderLength(std::string_view label, std::span<const std::byte> prefix,
                                    uint64_t file_size);

// What one checkpoint's headers may add up to. The loader and the
// fingerprint keep every shard's header (its text, its entries) until all
// are read, so the sum is what they hold; a real checkpoint's is tens of
// MB (a 70,000-tensor shard's header is 8 MB), while shards that are
// links to one crafted file, or sparse files, cost nothing to make.
inline constexpr uint64_t kMaxCheckpointHeaderBytes = 500'000'000;

// The headers read of one checkpoint so far, for the threads that read
// them: each takes its length before its text is read, and the one that
// would pass kMaxCheckpointHeaderBytes gets an error instead.
class HeaderAllowance {
 public:
  // `label` names the shard in the error.
  Status Take(std::string_view label, uint64_t header_bytes);

 private:
  std::atomic<uint64_t> taken_{0};
};

// A parse reserves about six times a document's size (the parser's index
// of its structure and string buffer), and the header it makes keeps its
// tensors' entries (64 bytes each, their names, 8 bytes a dimension); an
// invalid one is parsed a second time, whole, at ten times its size, to
// tell which error it is.
// Many headers (and indexes) are read and parsed at once, by up to hundreds
// of threads: the JSON they hold for it, read or being parsed, stays within
// kParseBudgetBytes for the whole process, and a document larger than that
// (a real 70,000-tensor shard's header is about 8 MB, a hostile one up to
// 100 MB) is parsed alone. So a directory of crafted files cannot multiply
// that peak by the thread count.
//
// A ParseTurn holds a document's share of the budget: take it for the
// document's size before its text is allocated, and keep it until its
// parse ends. The constructor waits for room, kParseTurnWaitLimit at most:
// a turn is held across the document's read, and reads that never return
// (a hung network mount) must not stop every other parse in the process,
// a local disk's included. Past the limit the document goes ahead over the
// budget; memory still grows only as reads return. A thread holding a turn
// must not take another (it could wait for itself).
inline constexpr uint64_t kParseBudgetBytes = uint64_t{32} << 20;
inline constexpr std::chrono::seconds kParseTurnWaitLimit{10};

class ParseTurn {
 public:
  ParseTurn() = default;  // holds nothing
  explicit ParseTurn(uint64_t bytes);
  ParseTurn(const ParseTurn&) = delete;
  ParseTurn& operator=(const ParseTurn&) = delete;
  ParseTurn(ParseTurn&& other) noexcept : bytes_(std::exchange(other.bytes_, 0)) {}
  ParseTurn& operator=(ParseTurn&& other) noexcept;
  ~ParseTurn() { Release(); }

  uint64_t bytes() const { return bytes_; }

 private:
  void Release();
  uint64_t bytes_ = 0;
};

// Parses and validates the N JSON bytes that follow the prefix of a file of
// `file_size` bytes (taking a ParseTurn for them, and for its copy).
Result<ShardHeader> ParseHeader(std::string_view label, std::span<const std::byte> json,
                                uint64_t file_size);

// Readable bytes the parser may look at past the JSON's end.
inline constexpr size_t kParsePaddingBytes = 64;

// The same, where the caller's buffer has kParsePaddingBytes readable bytes
// (of any value) after `json`: parsed where it lies, not copied. The caller
// holds `turn` for at least json.size() bytes, taken before the buffer was.
Result<ShardHeader> ParsePaddedHeader(std::string_view label, std::span<const std::byte> json,
                                      uint64_t file_size, const ParseTurn& turn);

// A shard's first bytes exactly as in the file: the length prefix and the
// JSON header, which the sampled fingerprint hashes. They are the buffer the
// header was read into and parsed from, kept: not a copy.
class HeaderBytes {
 public:
  HeaderBytes() = default;
  HeaderBytes(const HeaderBytes&) = delete;
  HeaderBytes& operator=(const HeaderBytes&) = delete;
  HeaderBytes(HeaderBytes&&) = default;
  HeaderBytes& operator=(HeaderBytes&&) = default;

  std::span<const std::byte> raw() const { return {bytes_.get(), size_}; }

 private:
  friend Result<ShardHeader> ReadShardHeader(const io::RandomAccessFile&, std::string_view,
                                             HeaderBytes*, HeaderAllowance*);
  std::unique_ptr<std::byte[]> bytes_;  // and the parser's padding after size_
  size_t size_ = 0;
};

// Reads the prefix and the header of an open file and validates them.
// `raw` (optional) receives the bytes read, when they are valid. With
// `allowance`, the header's length is taken from it before its text is read.
Result<ShardHeader> ReadShardHeader(const io::RandomAccessFile& file, std::string_view label,
                                    HeaderBytes* raw = nullptr,
                                    HeaderAllowance* allowance = nullptr);

}  // namespace weightd::format
