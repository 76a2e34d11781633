#include "format/writer.h"

#include <gtest/gtest.h>
#include <sys/stat.h>

#include <filesystem>
#include <random>

#include "format/checkpoint.h"
#include "format/rules.h"
#include "test_util.h"

namespace weightd::format {
namespace {

using testing::TempDir;

std::vector<std::byte> RandomBytes(std::mt19937_64& rng, size_t n) {
  std::vector<std::byte> v(n);
  for (auto& b : v) b = static_cast<std::byte>(rng() & 0xff);
  return v;
}

uint64_t BytesOf(DType dtype, const std::vector<uint64_t>& shape) {
  uint64_t n = DTypeBits(dtype);
  for (uint64_t d : shape) n *= d;
  return n / 8;
}

// Reads back `path` and checks every tensor's header fields and bytes.
void ExpectReadsBack(const std::string& path, const std::vector<TensorData>& tensors,
                     const std::vector<std::pair<std::string, std::string>>& metadata) {
  auto file = io::PosixFileSystem().Open(path);
  ASSERT_TRUE(file.ok());
  auto header = ReadShardHeader(**file, path);
  ASSERT_TRUE(header.ok()) << header.error().message();
  EXPECT_EQ(header->data_offset() % 8, 0u);
  ASSERT_EQ(header->tensors.size(), tensors.size());
  auto sorted_meta = metadata;
  std::sort(sorted_meta.begin(), sorted_meta.end());
  EXPECT_EQ(header->metadata, sorted_meta);
  for (const TensorData& t : tensors) {
    const TensorInfo* info = header->Find(t.spec.name);
    ASSERT_NE(info, nullptr) << t.spec.name;
    EXPECT_EQ(info->dtype, t.spec.dtype);
    EXPECT_EQ(std::vector<uint64_t>(info->shape.begin(), info->shape.end()), t.spec.shape);
    if (DTypeBits(info->dtype) >= 8) {
      EXPECT_EQ((header->data_offset() + info->begin) % (DTypeBits(info->dtype) / 8), 0u)
          << t.spec.name << " is not aligned to its element size";
    }
    std::vector<std::byte> bytes(info->bytes());
    ASSERT_TRUE((*file)->ReadExactly(header->data_offset() + info->begin, bytes).ok());
    EXPECT_EQ(bytes, t.bytes) << t.spec.name;
  }
}

TEST(Writer, EveryDTypeRoundTripsBitForBit) {
  TempDir dir;
  std::mt19937_64 rng(1);
  std::vector<TensorData> tensors;
  for (int i = 0; i < kDTypeCount; ++i) {
    const auto dtype = static_cast<DType>(i);
    std::vector<uint64_t> shape = {3, 8};  // 24 elements: whole bytes even at 4 and 6 bits
    tensors.push_back({{"t_" + std::string(DTypeName(dtype)), dtype, shape},
                       RandomBytes(rng, BytesOf(dtype, shape))});
  }
  ASSERT_TRUE(WriteSafetensors(dir.Join("all.safetensors"), tensors, {{"k", "v"}}).ok());
  ExpectReadsBack(dir.Join("all.safetensors"), tensors, {{"k", "v"}});
}

TEST(Writer, RandomLayoutsRoundTrip) {
  TempDir dir;
  std::mt19937_64 rng(42);
  for (int round = 0; round < 150; ++round) {
    std::vector<TensorData> tensors;
    const int count = static_cast<int>(rng() % 12);
    for (int i = 0; i < count; ++i) {
      const auto dtype = static_cast<DType>(rng() % kDTypeCount);
      std::vector<uint64_t> shape(rng() % 4);
      for (auto& d : shape) d = rng() % 6;
      // Round sub-byte tensors up to whole bytes by giving them 8k elements.
      if (DTypeBits(dtype) < 8) shape = {8 * (rng() % 4)};
      std::string name = "t" + std::to_string(i);
      if (rng() % 4 == 0) name += " \"quoted\"\\ \x01 é";
      tensors.push_back({{name, dtype, shape}, RandomBytes(rng, BytesOf(dtype, shape))});
    }
    std::vector<std::pair<std::string, std::string>> metadata;
    if (rng() % 2) metadata.push_back({"format", "pt"});
    const std::string path = dir.Join("r" + std::to_string(round) + ".safetensors");
    ASSERT_TRUE(WriteSafetensors(path, tensors, metadata).ok());
    ExpectReadsBack(path, tensors, metadata);
  }
}

TEST(Writer, SameTensorsInAnyOrderGiveTheSameBytes) {
  TempDir dir;
  std::mt19937_64 rng(7);
  std::vector<TensorData> tensors;
  for (int i = 0; i < 20; ++i) {
    const auto dtype = static_cast<DType>(rng() % kDTypeCount);
    std::vector<uint64_t> shape = {8, 1 + rng() % 5};
    tensors.push_back(
        {{"w" + std::to_string(i), dtype, shape}, RandomBytes(rng, BytesOf(dtype, shape))});
  }
  ASSERT_TRUE(WriteSafetensors(dir.Join("a"), tensors, {{"a", "1"}, {"b", "2"}}).ok());
  std::shuffle(tensors.begin(), tensors.end(), rng);
  ASSERT_TRUE(WriteSafetensors(dir.Join("b"), tensors, {{"b", "2"}, {"a", "1"}}).ok());
  EXPECT_EQ(testing::ReadFileBytes(dir.Join("a")), testing::ReadFileBytes(dir.Join("b")));
}

TEST(Writer, ReferenceLayoutWidestDTypeFirstMetadataFirst) {
  auto layout =
      LayoutShard({{"b", DType::kU8, {3}}, {"a", DType::kF64, {1}}, {"c", DType::kF64, {1}}},
                  {{"format", "pt"}});
  ASSERT_TRUE(layout.ok());
  EXPECT_EQ(layout->tensors[0].name, "a");
  EXPECT_EQ(layout->tensors[1].name, "c");
  EXPECT_EQ(layout->tensors[2].name, "b");
  EXPECT_EQ(
      layout->header_json.rfind(
          R"({"__metadata__":{"format":"pt"},"a":{"dtype":"F64","shape":[1],"data_offsets":[0,8]})",
          0),
      0u)
      << layout->header_json;
  EXPECT_EQ(layout->header_json.size() % 8, 0u);
}

TEST(Writer, RefusesWhatTheReaderWouldReject) {
  EXPECT_FALSE(LayoutShard({{"a", DType::kU8, {1}}, {"a", DType::kU8, {1}}}, {}).ok());
  EXPECT_FALSE(LayoutShard({{"a", DType::kF4, {3}}}, {}).ok());
  EXPECT_FALSE(LayoutShard({{"a", DType::kU64, {1ull << 62, 8}}}, {}).ok());
  EXPECT_FALSE(LayoutShard({{"__metadata__", DType::kU8, {1}}}, {}).ok());
  TempDir dir;
  std::vector<TensorData> wrong = {{{"a", DType::kU16, {2}}, std::vector<std::byte>(3)}};
  EXPECT_FALSE(WriteSafetensors(dir.Join("x"), wrong).ok());
  EXPECT_FALSE(io::PosixFileSystem().Exists(dir.Join("x")).value());
}

TEST(Writer, SparsePrefixLeavesHoles) {
  TempDir dir;
  auto layout = LayoutShard({{"big", DType::kU8, {1 << 22}}}, {});
  ASSERT_TRUE(layout.ok());
  Status s = WriteShard(dir.Join("s"), *layout,
                        [](const TensorInfo&, uint64_t, std::span<std::byte> dst) {
                          std::fill(dst.begin(), dst.end(), std::byte{0xab});
                        },
                        {.sparse_prefix = 4096});
  ASSERT_TRUE(s.ok());
  auto bytes = testing::ReadFileBytes(dir.Join("s"));
  ASSERT_EQ(bytes.size(), layout->file_size());
  const size_t data = layout->data_offset();
  EXPECT_EQ(bytes[data + 4095], std::byte{0xab});
  EXPECT_EQ(bytes[data + 4096], std::byte{0});
  struct stat st;
  ASSERT_EQ(::stat(dir.Join("s").c_str(), &st), 0);
  EXPECT_LT(static_cast<uint64_t>(st.st_blocks) * 512, layout->file_size() / 4);
}

// Without `replace`, a file that took the name while ours was written is
// kept as it was, and ours is gone; a free name is taken as usual.
TEST(Writer, WithoutReplaceAFileAlreadyThereIsKept) {
  TempDir dir;
  auto layout = LayoutShard({{"a", DType::kU8, {4}}}, {});
  ASSERT_TRUE(layout.ok());
  const std::string path = dir.Join("s");
  auto fill = [](const TensorInfo&, uint64_t, std::span<std::byte> dst) {
    std::fill(dst.begin(), dst.end(), std::byte{7});
  };
  // The other file appears while ours is written, after any check before.
  auto fill_and_race = [&](const TensorInfo& t, uint64_t offset, std::span<std::byte> dst) {
    fill(t, offset, dst);
    testing::WriteFileText(path, "theirs");
  };
  Status s =
      WriteShard(path, *layout, fill_and_race, {.sparse_prefix = std::nullopt, .replace = false});
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.error().message().find("exists"), std::string::npos) << s.error().message();
  auto kept = testing::ReadFileBytes(path);
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(kept.data()), kept.size()), "theirs");
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(dir.path()),
                          std::filesystem::directory_iterator()),
            1);  // no temporary left beside it

  ASSERT_TRUE(
      WriteShard(dir.Join("t"), *layout, fill, {.sparse_prefix = std::nullopt, .replace = false})
          .ok());
  EXPECT_EQ(testing::ReadFileBytes(dir.Join("t")).size(), layout->file_size());
  // A name as long as a file's may be (85 characters of 3 bytes): its
  // temporary name is cut to fit, between characters.
  std::string longest;
  for (int i = 0; i < 85; ++i) longest += "\xe2\x82\xac";  // the euro sign
  ASSERT_EQ(longest.size(), 255u);
  for (bool replace : {false, true}) {
    std::filesystem::remove(dir.Join(longest));
    Status long_name = WriteShard(dir.Join(longest), *layout, fill,
                                  {.sparse_prefix = std::nullopt, .replace = replace});
    ASSERT_TRUE(long_name.ok()) << long_name.error().message();
    EXPECT_EQ(testing::ReadFileBytes(dir.Join(longest)).size(), layout->file_size());
  }
}

}  // namespace
}  // namespace weightd::format
