// The rules of the safetensors format and of checkpoint directories, in the
// words every format error uses. docs/format.md lists them; tests match
// errors against them, so changing a text is changing a contract.
#pragma once

#include <string_view>

namespace weightd::format::rules {

// The length prefix.
inline constexpr std::string_view kFileTooShort = "file shorter than the 8-byte length";
inline constexpr std::string_view kHeaderTooLarge = "header length over 100,000,000";
inline constexpr std::string_view kHeaderPastEof = "header length past end of file";

// The JSON header.
inline constexpr std::string_view kHeaderNotUtf8 = "header must be UTF-8";
inline constexpr std::string_view kHeaderNotJson = "header must be JSON";
inline constexpr std::string_view kHeaderNotObject = "header must be a JSON object";
inline constexpr std::string_view kMetadataNotStringMap =
    "__metadata__ must be a map of strings to strings";
inline constexpr std::string_view kDuplicateName = "names must be unique";
inline constexpr std::string_view kEntryNotObject =
    "entry must be an object with dtype, shape and data_offsets";
inline constexpr std::string_view kMissingField = "entry lacks a required field";
inline constexpr std::string_view kDuplicateField = "entry repeats a field";
inline constexpr std::string_view kUnknownDType = "dtype must be one the format defines";
inline constexpr std::string_view kBadShape = "shape must be a list of non-negative integers";
inline constexpr std::string_view kBadOffsets =
    "data_offsets must be two non-negative integers [BEGIN, END]";

// The layout of the data region.
inline constexpr std::string_view kOffsetsContiguous =
    "offsets must be contiguous and non-overlapping";
inline constexpr std::string_view kElementCountOverflow = "element count overflows";
inline constexpr std::string_view kByteCountOverflow = "byte count overflows";
inline constexpr std::string_view kSubByteBoundary =
    "a sub-byte tensor must end on a byte boundary";
inline constexpr std::string_view kSizeMismatch = "END-BEGIN must equal elements times dtype size";
inline constexpr std::string_view kDataRegionEnd = "data region must end at end of file";

// Checkpoint directories and model.safetensors.index.json.
inline constexpr std::string_view kIndexNotJson = "index must be a JSON object with a weight_map";
inline constexpr std::string_view kShardNameEscapes = "shard names must stay inside the checkpoint";
inline constexpr std::string_view kShardMissing = "a shard the index names must exist";
inline constexpr std::string_view kShardListedTwice = "a shard file must be listed once";
inline constexpr std::string_view kHeadersTooLarge =
    "the shards' headers together must not exceed 500,000,000 bytes";
inline constexpr std::string_view kIndexTensorMissing =
    "a tensor the index maps to a shard must be in that shard";
inline constexpr std::string_view kTensorInTwoShards = "a tensor must be in one shard only";
inline constexpr std::string_view kNoShards = "a checkpoint needs at least one .safetensors shard";

}  // namespace weightd::format::rules
