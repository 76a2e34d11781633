// What the format layer's JSON readers (shard headers, the index) share.
// They read with simdjson's On-Demand API, which builds no tape and copies
// no string: a 70,000-tensor checkpoint's headers and index are 14 MB of
// JSON, and the tape and string copies of a DOM parse took as much memory
// again, all of it fresh pages in a process that has just started.
//
// On-Demand checks only what it is asked to read, so the readers ask for
// everything: `CheckValue` walks the values they would otherwise skip, and
// `AtEnd` refuses trailing content. An error found while reading is then
// either the file's JSON (`DomError`, the verdict of a full parse, settles
// which) or a rule of the format, and is reported as the same one a full
// parse would have led to.
//
// Internal to src/format. Thread safety: pure functions; a PaddedText is
// one thread's to change, any thread's to read.
#pragma once

#include <simdjson.h>

#include <cstddef>
#include <optional>
#include <string_view>

#include "io/private_memory.h"

namespace weightd::format::json {

namespace od = simdjson::ondemand;

// How deep values nest at most, the root at level 1 and each container's
// values one level below it, as simdjson's full parse counts (an empty
// container may sit at the last level: nothing is below it). A header:
// serde_json, which the reference implementation parses with, stops at
// 128, and a valid header needs 4. An index: 1024, the full parse's
// default, which indexes were read with before. The bound also bounds
// CheckValue's recursion on hostile input.
inline constexpr int kMaxHeaderDepth = 128;
inline constexpr int kMaxIndexDepth = 1024;

// The depth to allocate an On-Demand parser for, values nesting at most
// `max_depth` deep: its own count starts at the document, one above the
// root, and it keeps a position for the level below the deepest container.
constexpr size_t ParserDepth(int max_depth) { return static_cast<size_t>(max_depth) + 2; }

// A string's text, where it holds no escape: the bytes from `raw` (just
// past its opening quote) to its closing quote, which are then the string
// itself. `end` is the end of the document (the quote is before it: the
// parser's first stage saw every string closed). nullopt where there is an
// escape: the caller unescapes.
std::optional<std::string_view> PlainText(const char* raw, const char* end);

// A key's text: its bytes where they hold no escape, else unescaped into
// the parser's buffer (valid until its next document). `end` as above.
simdjson::simdjson_result<std::string_view> KeyText(od::field& field, const char* end);

// A string value's text, as KeyText.
simdjson::simdjson_result<std::string_view> StringText(od::value& value);

// Reads `value` whole, whatever it holds, so that it is checked as JSON:
// every string, number and literal, nested at most `max_depth` deep, the
// container holding `value` being at level `depth`.
simdjson::error_code CheckValue(od::value value, int depth, int max_depth);

// Whether the document has been read to its end (no trailing content).
bool AtEnd(od::document& doc);

// JSON text with the parser's padding (zeros) after it, in this process's
// own memory: huge pages from 2 MiB up (io/private_memory.h), so that the
// 6 MB index of a 70,000-tensor model costs a process that has just started
// three page faults, not 1,500.
class PaddedText {
 public:
  PaddedText() = default;
  // `size` bytes for the caller to fill; throws std::bad_alloc where there
  // is no memory for them.
  explicit PaddedText(size_t size) : bytes_(size + simdjson::SIMDJSON_PADDING) {}

  char* data() { return reinterpret_cast<char*>(bytes_.data()); }
  const char* data() const { return reinterpret_cast<const char*>(bytes_.data()); }
  size_t size() const {
    return bytes_.size() == 0 ? 0 : bytes_.size() - simdjson::SIMDJSON_PADDING;
  }
  simdjson::padded_string_view view() const {
    return simdjson::padded_string_view(data(), size(), bytes_.size());
  }

 private:
  io::PrivateBuffer bytes_;  // moved from, empty
};

// The error a full (DOM) parse of `json` finds, values nesting at most
// `max_depth` deep, with `json` padded as simdjson needs; SUCCESS when it
// is valid JSON. For errors only: it costs ten times the document's size.
simdjson::error_code DomError(const char* json, size_t size, int max_depth);

}  // namespace weightd::format::json
