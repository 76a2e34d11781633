#include "format/safetensors.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <optional>
#include <thread>

#include "format/rules.h"
#include "test_util.h"

namespace weightd::format {
namespace {

// A whole file: the length prefix, `json`, then `data_bytes` zero bytes.
std::vector<std::byte> File(const std::string& json, size_t data_bytes = 0) {
  std::vector<std::byte> f(8 + json.size() + data_bytes, std::byte{0});
  uint64_t n = json.size();
  for (int i = 0; i < 8; ++i)
    f[static_cast<size_t>(i)] = static_cast<std::byte>((n >> (8 * i)) & 0xff);
  std::memcpy(f.data() + 8, json.data(), json.size());
  return f;
}

Result<ShardHeader> Parse(const std::vector<std::byte>& file) {
  auto n = DecodeHeaderLength("f.safetensors", file, file.size());
  if (!n.ok()) return n.error();
  return ParseHeader("f.safetensors", std::span(file).subspan(8, *n), file.size());
}

// Asserts that parsing fails and that the message names the file, the rule
// and (when given) the tensor.
void ExpectRule(const std::vector<std::byte>& file, std::string_view rule,
                const std::string& tensor = "") {
  auto h = Parse(file);
  ASSERT_FALSE(h.ok()) << "accepted, wanted: " << rule;
  const std::string& msg = h.error().message();
  EXPECT_NE(msg.find("f.safetensors"), std::string::npos) << msg;
  EXPECT_NE(msg.find(rule), std::string::npos) << msg;
  if (!tensor.empty()) {
    EXPECT_NE(msg.find("tensor `" + tensor + "`"), std::string::npos) << msg;
  }
}

TEST(Header, ParsesTensorsSortedByNameWithMetadata) {
  auto h = Parse(File(
      R"({"b":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
      R"("__metadata__":{"format":"pt","z":"1"},"a":{"dtype":"U8","shape":[3,1],"data_offsets":[8,11]}})",
      11));
  ASSERT_TRUE(h.ok()) << h.error().message();
  ASSERT_EQ(h->tensors.size(), 2u);
  EXPECT_EQ(h->tensors[0].name, "a");
  EXPECT_EQ(h->tensors[0].elements, 3u);
  EXPECT_EQ(h->tensors[0].begin, 8u);
  EXPECT_EQ(h->tensors[1].dtype, DType::kF32);
  EXPECT_EQ(h->data_bytes, 11u);
  ASSERT_EQ(h->metadata.size(), 2u);
  EXPECT_EQ(h->metadata[0], (std::pair<std::string, std::string>("format", "pt")));
  EXPECT_NE(h->Find("b"), nullptr);
  EXPECT_EQ(h->Find("c"), nullptr);
}

// A tensor's name and shape are views into what the header keeps: they
// must outlive the text parsed, and a copy of the header must keep them
// when the original goes (the test runs under ASan in CI).
TEST(Header, NamesAndShapesOutliveTheTextAndTheHeaderCopied) {
  std::vector<std::byte> file =
      File(R"({"long.name.a.of.many.bytes":{"dtype":"U8","shape":[1,1,1,1,1,1,1,1,1,2],)"
           R"("data_offsets":[0,2]},"b":{"dtype":"U8","shape":[],"data_offsets":[2,3]}})",
           3);
  auto parsed = std::make_optional(Parse(file));
  ASSERT_TRUE(parsed->ok()) << parsed->error().message();
  std::fill(file.begin(), file.end(), std::byte{'x'});
  const ShardHeader copy = **parsed;
  parsed.reset();
  ASSERT_EQ(copy.tensors.size(), 2u);
  EXPECT_EQ(copy.tensors[0].name, "b");
  EXPECT_TRUE(copy.tensors[0].shape.empty());
  EXPECT_EQ(copy.tensors[1].name, "long.name.a.of.many.bytes");
  EXPECT_EQ(ShapeString(copy.tensors[1].shape), "[1, 1, 1, 1, 1, 1, 1, 1, 1, 2]");
  EXPECT_EQ(copy.Find("long.name.a.of.many.bytes"), &copy.tensors[1]);
}

TEST(Header, UnknownFieldsAreIgnoredAsByTheReference) {
  auto h = Parse(File(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"extra":[[1]]}})", 1));
  EXPECT_TRUE(h.ok());
}

TEST(Header, NullMetadataIsNoMetadata) {
  EXPECT_TRUE(Parse(File(R"({"__metadata__":null})")).ok());
}

TEST(Header, RulesOfTheEntries) {
  ExpectRule(File(R"({"a":1})"), rules::kEntryNotObject, "a");
  ExpectRule(File(R"({"a":{"shape":[1],"data_offsets":[0,1]}})", 1), rules::kMissingField, "a");
  ExpectRule(File(R"({"a":{"dtype":"U8","dtype":"U8","shape":[1],"data_offsets":[0,1]}})", 1),
             rules::kDuplicateField, "a");
  ExpectRule(File(R"({"a":{"dtype":"Q4","shape":[1],"data_offsets":[0,1]}})", 1),
             rules::kUnknownDType, "a");
  ExpectRule(File(R"({"a":{"dtype":"U8","shape":[-1],"data_offsets":[0,1]}})", 1), rules::kBadShape,
             "a");
  ExpectRule(File(R"({"a":{"dtype":"U8","shape":[1.0],"data_offsets":[0,1]}})", 1),
             rules::kBadShape, "a");
  // -0 is a float to the reference's parser, not a size.
  ExpectRule(File(R"({"a":{"dtype":"U8","shape":[-0],"data_offsets":[0,0]}})", 0), rules::kBadShape,
             "a");
  ExpectRule(File(R"({"a":{"dtype":"U8","shape":[0],"data_offsets":[-0,0]}})", 0),
             rules::kBadOffsets, "a");
  ExpectRule(File(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1,2]}})", 1),
             rules::kBadOffsets, "a");
  ExpectRule(File(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,-1]}})", 1),
             rules::kBadOffsets, "a");
  ExpectRule(File(R"({"__metadata__":{"a":1}})"), rules::kMetadataNotStringMap);
  ExpectRule(File(R"({"__metadata__":[]})"), rules::kMetadataNotStringMap);
  ExpectRule(File(R"([])"), rules::kHeaderNotObject);
  ExpectRule(File(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}} x)", 1),
             rules::kHeaderNotJson);
}

// Names, keys and values may spell a character with an escape; the
// reference reads them unescaped.
TEST(Header, EscapesAreReadAsTheReferenceReadsThem) {
  auto h = Parse(File(R"({"a\u0062":{"dty\u0070e":"U\u0038","shape":[1],"data_offsets":[0,1]},)"
                      R"("__metadata__":{"k\u0031":"v\n"}})",
                      1));
  ASSERT_TRUE(h.ok()) << h.error().message();
  ASSERT_EQ(h->tensors.size(), 1u);
  EXPECT_EQ(h->tensors[0].name, "ab");
  EXPECT_EQ(h->tensors[0].dtype, DType::kU8);
  ASSERT_EQ(h->metadata.size(), 1u);
  EXPECT_EQ(h->metadata[0], (std::pair<std::string, std::string>("k1", "v\n")));
}

// The header is read field by field; broken JSON anywhere, in a field no
// rule looks at or after an entry that breaks a rule, is still the error.
TEST(Header, BrokenJsonAnywhereIsNotJson) {
  const std::string a = R"("a":{"dtype":"U8","shape":[1],"data_offsets":[0,1])";
  for (const std::string& json : {
           "{" + a + R"(,"x":[01]}})",       // a number no parse reads
           "{" + a + R"(,"x":{"k":tru}}})",  // a literal
           "{" + a + R"(,"x":"\q"}})",       // an escape
           "{" + a + R"(},"b":{"dtype":"Q4","shape":[1],"data_offsets":[1,2]},)",  // after a rule
           "{" + a + R"(}} {})",  // a second document
       }) {
    SCOPED_TRACE(json);
    ExpectRule(File(json, 1), rules::kHeaderNotJson);
  }
  // A rule broken in valid JSON is that rule.
  ExpectRule(File(R"({"a":{"dtype":"Q4","shape":[1],"data_offsets":[0,1]},"x":[1]})", 1),
             rules::kUnknownDType, "a");
}

TEST(Header, DuplicateNamesAreAnError) {
  ExpectRule(File(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},)"
                  R"("a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}})",
                  2),
             rules::kDuplicateName, "a");
}

TEST(Header, GapsAndOverlapsAreAnError) {
  ExpectRule(File(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}})", 2),
             rules::kOffsetsContiguous, "a");
  ExpectRule(File(R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},)"
                  R"("b":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}})",
                  2),
             rules::kOffsetsContiguous, "b");
  ExpectRule(File(R"({"a":{"dtype":"U8","shape":[0],"data_offsets":[3,2]}})", 2),
             rules::kOffsetsContiguous, "a");
}

TEST(Header, SubByteTensorsMustEndOnAByte) {
  ExpectRule(File(R"({"a":{"dtype":"F4","shape":[3],"data_offsets":[0,2]}})", 2),
             rules::kSubByteBoundary, "a");
  ExpectRule(File(R"({"a":{"dtype":"F6_E3M2","shape":[2],"data_offsets":[0,2]}})", 2),
             rules::kSubByteBoundary, "a");
  EXPECT_TRUE(Parse(File(R"({"a":{"dtype":"F4","shape":[4],"data_offsets":[0,2]}})", 2)).ok());
  EXPECT_TRUE(
      Parse(File(R"({"a":{"dtype":"F6_E2M3","shape":[2,2],"data_offsets":[0,3]}})", 3)).ok());
}

TEST(Header, LengthPrefixRules) {
  std::vector<std::byte> seven(7);
  ExpectRule(seven, rules::kFileTooShort);
  // A length just under the limit on a short file is refused before any
  // allocation of that size.
  auto near_limit = File("{}");
  const uint64_t n = kMaxHeaderBytes - 1;
  for (int i = 0; i < 8; ++i)
    near_limit[static_cast<size_t>(i)] = static_cast<std::byte>((n >> (8 * i)) & 0xff);
  ExpectRule(near_limit, rules::kHeaderPastEof);
  auto over = File("{}");
  over[4] = std::byte{1};
  ExpectRule(over, rules::kHeaderTooLarge);
}

TEST(Header, NestingIsCappedAt128Levels) {
  // 200 levels: over our cap, under simdjson's own default of 1024, so this
  // fails if the cap is lost. 100 levels (legal JSON, ignored field) pass.
  auto nested = [](int depth, const std::string& inside = "") {
    std::string json = R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"x":)";
    return json + std::string(static_cast<size_t>(depth), '[') + inside +
           std::string(static_cast<size_t>(depth), ']') + "}}";
  };
  ExpectRule(File(nested(200), 1), rules::kHeaderNotJson);
  EXPECT_TRUE(Parse(File(nested(100), 1)).ok());
  // The header's object, the entry's, and 126 arrays: 128 levels, the
  // most; one more is too deep. So is a value in the 126th array, a level
  // below it, as a full parse counts.
  EXPECT_TRUE(Parse(File(nested(126), 1)).ok());
  ExpectRule(File(nested(127), 1), rules::kHeaderNotJson);
  EXPECT_TRUE(Parse(File(nested(125, "0"), 1)).ok());
  ExpectRule(File(nested(126, "0"), 1), rules::kHeaderNotJson);
  ExpectRule(File(nested(126, "{}"), 1), rules::kHeaderNotJson);
}

TEST(Header, MillionsOfEntriesOnTheSameBytesCostLinearTime) {
  // 300,000 empty tensors all at offset 0, then one real one: legal, and
  // parsed in one pass plus a sort.
  std::string json = "{";
  for (int i = 0; i < 300'000; ++i) {
    json += "\"t" + std::to_string(i) + R"(":{"dtype":"U8","shape":[0],"data_offsets":[0,0]},)";
  }
  json += R"("last":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}})";
  auto h = Parse(File(json, 4));
  ASSERT_TRUE(h.ok()) << h.error().message();
  EXPECT_EQ(h->tensors.size(), 300'001u);
  // The same entries overlapping a non-empty tensor are refused.
  std::string bad = "{";
  for (int i = 0; i < 300'000; ++i) {
    bad += "\"t" + std::to_string(i) + R"(":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},)";
  }
  bad.back() = '}';
  ExpectRule(File(bad, 4), rules::kOffsetsContiguous);
}

// A file held in memory that counts its reads.
class CountingFile final : public io::RandomAccessFile {
 public:
  explicit CountingFile(std::vector<std::byte> bytes) : bytes_(std::move(bytes)) {}
  const std::string& path() const override { return path_; }
  uint64_t size() const override { return bytes_.size(); }
  Status ReadExactly(uint64_t offset, std::span<std::byte> dst) const override {
    ++reads_;
    if (offset > bytes_.size() || dst.size() > bytes_.size() - offset) return Error("past the end");
    std::memcpy(dst.data(), bytes_.data() + offset, dst.size());
    return OkStatus();
  }
  Result<io::StatSignature> Stat() const override { return io::StatSignature{}; }
  int reads() const { return reads_; }

 private:
  std::string path_ = "f.safetensors";
  std::vector<std::byte> bytes_;
  mutable std::atomic<int> reads_{0};
};

TEST(ParseTurn, ADocumentWaitsForRoomAndOneOverTheBudgetRunsAlone) {
  std::optional<ParseTurn> held(std::in_place, kParseBudgetBytes - 10);
  {
    const ParseTurn fits(10);  // exactly what is left
    EXPECT_EQ(fits.bytes(), 10u);
  }
  std::atomic<bool> in{false};
  std::thread over([&] {
    const ParseTurn one_more(11);
    in = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_FALSE(in.load());
  held.reset();
  over.join();
  EXPECT_TRUE(in.load());
  // Nothing held: a document over the budget by itself is parsed, alone.
  ParseTurn huge(kParseBudgetBytes * 3);
  EXPECT_EQ(huge.bytes(), kParseBudgetBytes * 3);
  ParseTurn moved = std::move(huge);
  EXPECT_EQ(huge.bytes(), 0u);  // NOLINT: a moved-from turn holds nothing
  EXPECT_EQ(moved.bytes(), kParseBudgetBytes * 3);
}

// A header's text is allocated and read only once its turn is taken: many
// threads reading crafted headers of up to 100 MB each wait first.
TEST(ParseTurn, AShardsHeaderIsReadOnlyOnceItsTurnIsTaken) {
  CountingFile file(File(R"({"a":{"dtype":"U8","shape":[3],"data_offsets":[0,3]}})", 3));
  std::optional<ParseTurn> all(std::in_place, kParseBudgetBytes);
  Result<ShardHeader> header = Error("not run");
  std::atomic<bool> done{false};
  std::thread reader([&] {
    header = ReadShardHeader(file, "f.safetensors", nullptr);
    done = true;
  });
  EXPECT_TRUE(testing::Eventually([&] { return file.reads() >= 1; }, 10));
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_EQ(file.reads(), 1);  // the length prefix alone
  EXPECT_FALSE(done.load());
  all.reset();
  reader.join();
  ASSERT_TRUE(header.ok()) << header.error().message();
  EXPECT_EQ(header->tensors.size(), 1u);
  EXPECT_EQ(file.reads(), 2);
}

}  // namespace
}  // namespace weightd::format
