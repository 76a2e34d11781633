// The shared conformance files: samples written by the reference
// implementation must decode to the values its README lists, and every rule
// file must be accepted or rejected as cases.tsv says, naming the rule.
#include <gtest/gtest.h>

#include <fstream>
#include <map>
#include <sstream>

#include "format/checkpoint.h"
#include "format/dtype.h"
#include "test_util.h"

namespace weightd::format {
namespace {

std::vector<std::string> DecodeAll(const std::string& path, const std::string& tensor) {
  auto ckpt = OpenCheckpoint(io::PosixFileSystem(), path);
  EXPECT_TRUE(ckpt.ok()) << (ckpt.ok() ? "" : ckpt.error().message());
  if (!ckpt.ok()) return {};
  const Shard& shard = ckpt->shards.at(0);
  const TensorInfo* t = shard.header.Find(tensor);
  EXPECT_NE(t, nullptr) << tensor;
  if (t == nullptr) return {};
  auto file = io::PosixFileSystem().Open(path);
  std::vector<std::byte> bytes(t->bytes());
  EXPECT_TRUE((*file)->ReadExactly(shard.header.data_offset() + t->begin, bytes).ok());
  std::vector<std::string> out;
  for (uint64_t i = 0; i < t->elements; ++i)
    out.push_back(FormatElement(DecodeElement(t->dtype, bytes, i)));
  EXPECT_EQ(shard.header.metadata.size(), 1u);
  if (!shard.header.metadata.empty()) {
    EXPECT_EQ(shard.header.metadata[0], (std::pair<std::string, std::string>("test", "a")));
  }
  return out;
}

TEST(Conformance, ReferenceSamplesDecodeToTheirListedValues) {
  const std::string dir = testing::ConformanceDir() + "/safetensors-samples/";
  const std::vector<std::string> small = {"-3", "-2", "-1", "0", "1", "2"};
  const std::map<std::string, std::vector<std::string>> expected = {
      {"B", {"253", "254", "255", "0", "1", "2"}},
      {"H", {"65533", "65534", "65535", "0", "1", "2"}},
      {"I", {"4294967293", "4294967294", "4294967295", "0", "1", "2"}},
      {"b", small},
      {"h", small},
      {"i", small},
      {"e", small},
      {"f", small},
      {"d", small},
  };
  for (const auto& [name, values] : expected) {
    EXPECT_EQ(DecodeAll(dir + name + ".safetensors", name), values) << name;
    EXPECT_EQ(DecodeAll(dir + "overall.safetensors", name), values) << "overall: " << name;
  }
}

TEST(Conformance, EveryRuleCaseIsAcceptedOrRejectedAsListed) {
  const std::string dir = testing::ConformanceDir() + "/rules/";
  std::ifstream tsv(dir + "cases.tsv");
  ASSERT_TRUE(tsv) << "missing " << dir << "cases.tsv (set WEIGHTD_CONFORMANCE_DIR)";
  std::string line;
  std::getline(tsv, line);  // column names
  int cases = 0;
  while (std::getline(tsv, line)) {
    if (line.empty()) continue;
    std::istringstream fields(line);
    std::string file, expect, rule;
    std::getline(fields, file, '\t');
    std::getline(fields, expect, '\t');
    std::getline(fields, rule);
    ++cases;
    auto ckpt = OpenCheckpoint(io::PosixFileSystem(), dir + file);
    if (expect == "ok") {
      EXPECT_TRUE(ckpt.ok()) << file << " (" << rule << "): " << ckpt.error().message();
    } else {
      ASSERT_FALSE(ckpt.ok()) << file << " accepted, should break: " << rule;
      EXPECT_NE(ckpt.error().message().find(rule), std::string::npos)
          << file << ": error does not name the rule `" << rule << "`: " << ckpt.error().message();
      EXPECT_NE(ckpt.error().message().find(file), std::string::npos) << ckpt.error().message();
    }
  }
  EXPECT_GE(cases, 16);
}

}  // namespace
}  // namespace weightd::format
