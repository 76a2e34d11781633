#include "format/json.h"

#include <algorithm>
#include <cstring>

namespace weightd::format::json {

std::optional<std::string_view> PlainText(const char* raw, const char* end) {
  const void* quote = std::memchr(raw, '"', static_cast<size_t>(end - raw));
  if (quote == nullptr) return std::nullopt;
  const auto size = static_cast<size_t>(static_cast<const char*>(quote) - raw);
  if (std::memchr(raw, '\\', size) != nullptr) return std::nullopt;
  return std::string_view(raw, size);
}

simdjson::simdjson_result<std::string_view> KeyText(od::field& field, const char* end) {
  if (auto plain = PlainText(field.key().raw(), end)) return std::string_view(*plain);
  return field.unescaped_key();
}

simdjson::simdjson_result<std::string_view> StringText(od::value& value) {
  const std::string_view token = value.raw_json_token();
  if (token.size() >= 2 && token.front() == '"') {
    if (auto plain = PlainText(token.data() + 1, token.data() + token.size())) {
      od::raw_json_string consumed;
      if (auto err = value.get_raw_json_string().get(consumed)) return err;
      return std::string_view(*plain);
    }
  }
  return value.get_string();
}

simdjson::error_code CheckValue(od::value value, int depth, int max_depth) {
  if (depth >= max_depth) return simdjson::DEPTH_ERROR;  // `value` is a level below
  od::json_type type;
  if (auto err = value.type().get(type)) return err;
  switch (type) {
    case od::json_type::array: {
      od::array array;
      if (auto err = value.get_array().get(array)) return err;
      for (auto element : array) {
        od::value v;
        if (auto err = std::move(element).get(v)) return err;
        if (auto err = CheckValue(v, depth + 1, max_depth)) return err;
      }
      return simdjson::SUCCESS;
    }
    case od::json_type::object: {
      od::object object;
      if (auto err = value.get_object().get(object)) return err;
      for (auto field : object) {
        od::field f;
        if (auto err = std::move(field).get(f)) return err;
        std::string_view key;
        if (auto err = f.unescaped_key().get(key)) return err;
        if (auto err = CheckValue(f.value(), depth + 1, max_depth)) return err;
      }
      return simdjson::SUCCESS;
    }
    case od::json_type::number:
      return value.get_number().error();
    case od::json_type::string:
      return value.get_string().error();
    case od::json_type::boolean:
      return value.get_bool().error();
    case od::json_type::null: {
      bool null = false;
      if (auto err = value.is_null().get(null)) return err;
      return null ? simdjson::SUCCESS : simdjson::N_ATOM_ERROR;
    }
  }
  return simdjson::INCORRECT_TYPE;
}

bool AtEnd(od::document& doc) { return doc.current_location().error() == simdjson::OUT_OF_BOUNDS; }

simdjson::error_code DomError(const char* json, size_t size, int max_depth) {
  simdjson::dom::parser parser;
  if (auto err = parser.allocate(std::max<size_t>(size, 64), static_cast<size_t>(max_depth))) {
    return err;
  }
  simdjson::dom::element root;
  return parser.parse(json, size, /*realloc_if_needed=*/false).get(root);
}

}  // namespace weightd::format::json
