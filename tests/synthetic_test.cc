#include "format/synthetic.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <stdexcept>

#include "format/checkpoint.h"
#include "test_util.h"

namespace weightd::format {
namespace {

using testing::TempDir;

Checkpoint Make(const std::string& dir, SyntheticOptions o) {
  auto plan = WriteSyntheticCheckpoint(dir, o);
  EXPECT_TRUE(plan.ok()) << (plan.ok() ? "" : plan.error().message());
  auto ckpt = OpenCheckpoint(io::PosixFileSystem(), dir);
  EXPECT_TRUE(ckpt.ok()) << (ckpt.ok() ? "" : ckpt.error().message());
  return ckpt.ok() ? std::move(ckpt).value() : Checkpoint{};
}

std::vector<std::byte> TensorBytes(const Shard& s, const TensorInfo& t, uint64_t max = UINT64_MAX) {
  auto file = io::PosixFileSystem().Open(s.path);
  std::vector<std::byte> out(std::min(max, t.bytes()));
  EXPECT_TRUE((*file)->ReadExactly(s.header.data_offset() + t.begin, out).ok());
  return out;
}

TEST(Synthetic, SameOptionsAndSeedGiveTheSameBytes) {
  TempDir dir;
  SyntheticOptions o{.preset = "llama", .seed = 3, .size_bytes = 8 << 20};
  Checkpoint a = Make(dir.Join("a"), o);
  Checkpoint b = Make(dir.Join("b"), o);
  ASSERT_EQ(a.shards.size(), b.shards.size());
  for (size_t i = 0; i < a.shards.size(); ++i) {
    EXPECT_EQ(testing::ReadFileBytes(a.shards[i].path), testing::ReadFileBytes(b.shards[i].path));
  }
  EXPECT_EQ(testing::ReadFileBytes(dir.Join("a/model.safetensors.index.json")),
            testing::ReadFileBytes(dir.Join("b/model.safetensors.index.json")));
}

TEST(Synthetic, FinetuneKeepsTheLayoutAndChangesEveryTensor) {
  TempDir dir;
  Checkpoint base = Make(dir.Join("base"), {.preset = "tiny"});
  Checkpoint tuned = Make(dir.Join("tuned"), {.preset = "tiny", .finetune = true});
  ASSERT_EQ(base.shards.size(), 1u);
  const auto& bt = base.shards[0].header.tensors;
  const auto& tt = tuned.shards[0].header.tensors;
  ASSERT_EQ(bt.size(), tt.size());
  for (size_t i = 0; i < bt.size(); ++i) {
    EXPECT_EQ(bt[i].name, tt[i].name);
    EXPECT_TRUE(std::ranges::equal(bt[i].shape, tt[i].shape));
    EXPECT_EQ(bt[i].begin, tt[i].begin);
    // Within the first 8 bytes: what a sampled fingerprint reads first.
    EXPECT_NE(TensorBytes(base.shards[0], bt[i], 8), TensorBytes(tuned.shards[0], tt[i], 8))
        << bt[i].name;
  }
  EXPECT_EQ(base.shards[0].header.header_bytes, tuned.shards[0].header.header_bytes);
}

TEST(Synthetic, FloatValuesAreFinite) {
  TempDir dir;
  Checkpoint c = Make(dir.Join("t"), {.preset = "tiny", .seed = 9});
  for (const TensorInfo& t : c.shards[0].header.tensors) {
    if (!IsFloatingPoint(t.dtype)) continue;
    auto bytes = TensorBytes(c.shards[0], t);
    for (uint64_t i = 0; i < t.elements; ++i) {
      EXPECT_TRUE(std::isfinite(std::get<double>(DecodeElement(t.dtype, bytes, i))))
          << t.name << "[" << i << "]";
    }
  }
}

TEST(Synthetic, FillDoesNotDependOnHowTheTensorIsCut) {
  static constexpr uint64_t kShape[] = {100};
  TensorInfo t{
      .name = "w", .dtype = DType::kBF16, .shape = kShape, .elements = 100, .begin = 0, .end = 200};
  std::vector<std::byte> whole(200), pieces(200);
  FillSyntheticTensor(5, false, t, 0, whole);
  for (size_t off = 0; off < 200;) {
    const size_t len = std::min<size_t>(200 - off, 1 + off % 13);
    FillSyntheticTensor(5, false, t, off, std::span(pieces).subspan(off, len));
    off += len;
  }
  EXPECT_EQ(whole, pieces);
}

TEST(Synthetic, LlamaIsShardedWithAnIndexAndNearItsSize) {
  TempDir dir;
  Checkpoint c = Make(dir.Join("m"), {.preset = "llama", .size_bytes = 64 << 20});
  EXPECT_TRUE(c.has_index);
  EXPECT_EQ(c.shards.size(), 4u);
  EXPECT_NEAR(static_cast<double>(c.data_bytes()), 64.0 * (1 << 20), 0.25 * 64 * (1 << 20));
  for (const char* name :
       {"model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.mlp.down_proj.weight", "model.norm.weight", "lm_head.weight"}) {
    bool found = false;
    for (const Shard& s : c.shards) found |= s.header.Find(name) != nullptr;
    EXPECT_TRUE(found) << name;
  }
}

TEST(Synthetic, LlamaLayersAndHiddenChooseTheShape) {
  auto plan = PlanSyntheticCheckpoint({.preset = "llama", .layers = 3, .hidden = 256});
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->tensor_count, 3u * 9 + 3);
}

TEST(Synthetic, ManyTensors) {
  TempDir dir;
  Checkpoint c = Make(dir.Join("m"), {.preset = "many-tensors", .tensors = 5000});
  EXPECT_EQ(c.tensor_count(), 5000u);
  EXPECT_EQ(c.shards.size(), 8u);
  EXPECT_EQ(PlanSyntheticCheckpoint({.preset = "many-tensors"})->tensor_count, 70'000u);
}

TEST(Synthetic, K3LayoutIsSparseAndFullSizeIsAboutSeventyThousandTensors) {
  auto full = PlanSyntheticCheckpoint({.preset = "k3-layout"});
  ASSERT_TRUE(full.ok());
  EXPECT_GT(full->tensor_count, 65'000u);
  EXPECT_LT(full->tensor_count, 75'000u);
  EXPECT_EQ(full->shards.size(), 50u);
  EXPECT_GT(full->data_bytes / 50, 10ull << 30);  // tens of GB per shard

  TempDir dir;
  Checkpoint c =
      Make(dir.Join("k3"), {.preset = "k3-layout", .layers = 1, .experts = 4, .shards = 3});
  ASSERT_EQ(c.shards.size(), 3u);
  uint64_t allocated = 0;
  for (const Shard& s : c.shards) {
    struct stat st;
    ASSERT_EQ(::stat(s.path.c_str(), &st), 0);
    allocated += static_cast<uint64_t>(st.st_blocks) * 512;
    for (const TensorInfo& t : s.header.tensors) {
      if (t.bytes() <= 8192) continue;
      auto head = TensorBytes(s, t, 8192);
      EXPECT_NE(std::count(head.begin(), head.begin() + 4096, std::byte{0}), 4096) << t.name;
      EXPECT_EQ(std::count(head.begin() + 4096, head.end(), std::byte{0}), 4096) << t.name;
    }
  }
  EXPECT_LT(allocated, c.file_bytes() / 100);
}

TEST(Synthetic, RefusesANonEmptyOutputAndLeavesNothingBehindOnError) {
  TempDir dir;
  testing::WriteFileText(dir.Join("keep"), "x");
  auto r = WriteSyntheticCheckpoint(dir.path(), {.preset = "tiny"});
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.error().message().find("not an empty directory"), std::string::npos);
  // A file there is not called a folder.
  auto onto_file = WriteSyntheticCheckpoint(dir.Join("keep"), {.preset = "tiny"});
  ASSERT_FALSE(onto_file.ok());
  EXPECT_NE(onto_file.error().message().find("exists and is not a directory"), std::string::npos)
      << onto_file.error().message();
  EXPECT_FALSE(WriteSyntheticCheckpoint(dir.Join("x"), {.preset = "nope"}).ok());
  auto entries = io::PosixFileSystem().ListDirectory(dir.path());
  ASSERT_TRUE(entries.ok());
  EXPECT_EQ(entries->size(), 1u);
}

TEST(Synthetic, AnExceptionLeavesNoStagingDirectoryBehind) {
  TempDir dir;
  const auto throwing_progress = [](size_t, size_t) { throw std::runtime_error("stop"); };
  EXPECT_THROW(
      (void)WriteSyntheticCheckpoint(dir.Join("out"), {.preset = "tiny"}, throwing_progress),
      std::runtime_error);
  auto entries = io::PosixFileSystem().ListDirectory(dir.path());
  ASSERT_TRUE(entries.ok());
  for (const auto& e : *entries) ADD_FAILURE() << "left behind: " << e.name;
}

// The staging folder is listed for removal before it is made (so that a
// signal as soon as it exists finds it): one that cannot be made, its name
// taken already by what is not this call's, is left alone.
TEST(Synthetic, AStagingNameTakenAlreadyIsNotRemoved) {
  TempDir dir;
  const std::string taken = dir.Join("out.partial-" + std::to_string(::getpid()));
  testing::WriteFileText(taken, "someone else's");
  auto r = WriteSyntheticCheckpoint(dir.Join("out"), {.preset = "tiny"});
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.error().message().find("cannot create it"), std::string::npos) << r.error().message();
  const std::vector<std::byte> left = testing::ReadFileBytes(taken);
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(left.data()), left.size()), "someone else's");
}

}  // namespace
}  // namespace weightd::format
