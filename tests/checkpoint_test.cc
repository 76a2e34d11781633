#include "format/checkpoint.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <deque>
#include <filesystem>
#include <fstream>
#include <set>
#include <thread>

#include "fingerprint/fingerprint.h"
#include "format/rules.h"
#include "format/writer.h"
#include "loader/loader.h"
#include "test_util.h"

namespace weightd::format {
namespace {

using testing::TempDir;

void WriteShardWith(const std::string& path, const std::vector<std::string>& names) {
  std::vector<TensorData> tensors;
  for (const auto& n : names) tensors.push_back({{n, DType::kU8, {4}}, std::vector<std::byte>(4)});
  ASSERT_TRUE(WriteSafetensors(path, tensors).ok());
}

void WriteIndex(const std::string& dir,
                const std::vector<std::pair<std::string, std::string>>& map) {
  std::string json = R"({"metadata":{"total_size":0},"weight_map":{)";
  for (size_t i = 0; i < map.size(); ++i) {
    json += (i ? "," : "") + JsonQuote(map[i].first) + ":" + JsonQuote(map[i].second);
  }
  testing::WriteFileText(dir + "/" + std::string(kIndexFileName), json + "}}");
}

void ExpectError(const std::string& path, std::string_view rule, const std::string& also = "") {
  auto ckpt = OpenCheckpoint(io::PosixFileSystem(), path);
  ASSERT_FALSE(ckpt.ok()) << "accepted, wanted: " << rule;
  EXPECT_NE(ckpt.error().message().find(rule), std::string::npos) << ckpt.error().message();
  if (!also.empty()) {
    EXPECT_NE(ckpt.error().message().find(also), std::string::npos) << ckpt.error().message();
  }
}

TEST(Checkpoint, WithoutIndexEveryShardInNameOrder) {
  TempDir dir;
  WriteShardWith(dir.Join("b.safetensors"), {"x"});
  WriteShardWith(dir.Join("a.safetensors"), {"y"});
  testing::WriteFileText(dir.Join("README.md"), "not a shard");
  auto ckpt = OpenCheckpoint(io::PosixFileSystem(), dir.path());
  ASSERT_TRUE(ckpt.ok()) << ckpt.error().message();
  EXPECT_FALSE(ckpt->has_index);
  ASSERT_EQ(ckpt->shards.size(), 2u);
  EXPECT_EQ(ckpt->shards[0].name, "a.safetensors");
  EXPECT_EQ(ckpt->tensor_count(), 2u);
}

TEST(Checkpoint, IndexDecidesWhichShardsBelong) {
  TempDir dir;
  WriteShardWith(dir.Join("m-1.safetensors"), {"a", "b"});
  WriteShardWith(dir.Join("m-2.safetensors"), {"c"});
  WriteShardWith(dir.Join("stale-copy.safetensors"), {"a"});  // unlisted: ignored
  WriteIndex(dir.path(),
             {{"a", "m-1.safetensors"}, {"b", "m-1.safetensors"}, {"c", "m-2.safetensors"}});
  auto ckpt = OpenCheckpoint(io::PosixFileSystem(), dir.path());
  ASSERT_TRUE(ckpt.ok()) << ckpt.error().message();
  EXPECT_TRUE(ckpt->has_index);
  ASSERT_EQ(ckpt->shards.size(), 2u);
  EXPECT_EQ(ckpt->shards[1].name, "m-2.safetensors");
}

TEST(Checkpoint, MissingShardIsAnError) {
  TempDir dir;
  WriteShardWith(dir.Join("m-1.safetensors"), {"a"});
  WriteIndex(dir.path(), {{"a", "m-1.safetensors"}, {"b", "m-2.safetensors"}});
  ExpectError(dir.path(), rules::kShardMissing, "m-2.safetensors");
}

// One file under two names is refused before any header is read: an index
// spelling a shard a thousand ways ("m", "./m", ".//m") would otherwise
// have it read and kept a thousand times. A symlink beside it is a second
// name too.
TEST(Checkpoint, AShardFileListedTwiceIsAnError) {
  TempDir dir;
  WriteShardWith(dir.Join("m.safetensors"), {"a", "b"});
  WriteIndex(dir.path(), {{"a", "m.safetensors"}, {"b", "./m.safetensors"}});
  ExpectError(dir.path(), rules::kShardListedTwice, "./m.safetensors");
  TempDir linked;
  WriteShardWith(linked.Join("a.safetensors"), {"a"});
  ASSERT_EQ(::symlink("a.safetensors", linked.Join("b.safetensors").c_str()), 0);
  ExpectError(linked.path(), rules::kShardListedTwice, "b.safetensors");
}

// Links to one file are as many shards, each with its header: six names
// for a file whose header is the largest a file may have (no tensors, and
// 100 MB of the spaces a writer pads a header with) would have the loader
// keep 600 MB of headers, from one file. What a checkpoint's headers add up to is bounded: the
// opening, the fingerprint and the load refuse it, naming the rule.
TEST(Checkpoint, TheShardsHeadersTogetherAreBounded) {
  TempDir dir;
  {
    const std::string json = "{}" + std::string(kMaxHeaderBytes - 2, ' ');
    ASSERT_EQ(json.size(), kMaxHeaderBytes);
    std::string file(8, '\0');
    const uint64_t n = json.size();
    for (int i = 0; i < 8; ++i) file[static_cast<size_t>(i)] = static_cast<char>(n >> (8 * i));
    std::ofstream(dir.Join("a.safetensors"), std::ios::binary) << file << json;
  }
  for (const char* link : {"b", "c", "d", "e", "f"}) {
    ASSERT_EQ(::link(dir.Join("a.safetensors").c_str(),
                     dir.Join(std::string(link) + ".safetensors").c_str()),
              0);
  }
  ExpectError(dir.path(), rules::kHeadersTooLarge);
  auto fp = fingerprint::FingerprintCheckpoint(io::PosixFileSystem(), dir.path(), {});
  ASSERT_FALSE(fp.ok());
  EXPECT_NE(fp.error().message().find(rules::kHeadersTooLarge), std::string::npos)
      << fp.error().message();
  auto loaded = loader::LoadCheckpoint(io::PosixFileSystem(), dir.path());
  ASSERT_FALSE(loaded.ok());
  EXPECT_NE(loaded.error().message().find(rules::kHeadersTooLarge), std::string::npos)
      << loaded.error().message();
  // The bound itself (five of these files' headers) is within it.
  HeaderAllowance allowance;
  EXPECT_TRUE(allowance.Take("x", kMaxCheckpointHeaderBytes).ok());
  const Status over = allowance.Take("y.safetensors", 1);
  ASSERT_FALSE(over.ok());
  EXPECT_NE(over.error().message().find("y.safetensors"), std::string::npos);
}

// The index named instead of its directory (a path completed one level too
// far) says what to name, not that a header is too long.
TEST(Checkpoint, AnIndexNamedAloneSaysToNameItsDirectory) {
  TempDir dir;
  WriteShardWith(dir.Join("m-1.safetensors"), {"a"});
  WriteIndex(dir.path(), {{"a", "m-1.safetensors"}});
  ExpectError(dir.Join(std::string(kIndexFileName)), "name the checkpoint's directory",
              "(" + dir.path() + ")");
}

TEST(Checkpoint, NamesThatLeaveTheDirectoryAreErrors) {
  TempDir outside;
  WriteShardWith(outside.Join("evil.safetensors"), {"a"});
  for (const std::string& name :
       {std::string("../") + std::filesystem::path(outside.path()).filename().string() +
            "/evil.safetensors",
        outside.Join("evil.safetensors"), std::string("sub/../../x.safetensors")}) {
    TempDir dir;
    WriteIndex(dir.path(), {{"a", name}});
    ExpectError(dir.path(), rules::kShardNameEscapes, name);
  }
}

TEST(Checkpoint, SymlinkPointingOutsideIsAnError) {
  TempDir outside, dir;
  WriteShardWith(outside.Join("evil.safetensors"), {"a"});
  ASSERT_EQ(::symlink(outside.Join("evil.safetensors").c_str(), dir.Join("m.safetensors").c_str()),
            0);
  ExpectError(dir.path(), rules::kShardNameEscapes, "m.safetensors");  // without an index
  WriteIndex(dir.path(), {{"a", "m.safetensors"}});
  ExpectError(dir.path(), rules::kShardNameEscapes, "m.safetensors");  // and with one
}

// A dangling symlink is named as one where no index named the shard, and as
// a missing shard where one did.
TEST(Checkpoint, ADanglingSymlinkSaysWhatItIs) {
  TempDir dir;
  ASSERT_EQ(::symlink("gone.bin", dir.Join("m.safetensors").c_str()), 0);
  ExpectError(dir.path(), "a symlink whose target is missing", "m.safetensors");
  WriteIndex(dir.path(), {{"a", "m.safetensors"}});
  ExpectError(dir.path(), rules::kShardMissing, "m.safetensors");
  // Listed, not a file: said so, not only that no shard was found.
  TempDir fifo;
  ASSERT_EQ(::mkfifo(fifo.Join("m.safetensors").c_str(), 0600), 0);
  ExpectError(fifo.path(), rules::kNoShards, "m.safetensors is not a regular file");
}

TEST(Checkpoint, SymlinkInsideAndHubCacheBlobsAreFine) {
  TempDir dir;
  WriteShardWith(dir.Join("real.bin"), {"a"});
  ASSERT_EQ(::symlink("real.bin", dir.Join("m.safetensors").c_str()), 0);
  EXPECT_TRUE(OpenCheckpoint(io::PosixFileSystem(), dir.path()).ok());

  // models--org--name/snapshots/REV/model.safetensors -> ../../blobs/SHA
  TempDir hub;
  const std::string repo = hub.Join("models--org--name");
  std::filesystem::create_directories(repo + "/blobs");
  std::filesystem::create_directories(repo + "/snapshots/rev1");
  WriteShardWith(repo + "/blobs/0123abcd", {"a"});
  ASSERT_EQ(::symlink("../../blobs/0123abcd", (repo + "/snapshots/rev1/model.safetensors").c_str()),
            0);
  auto ckpt = OpenCheckpoint(io::PosixFileSystem(), repo + "/snapshots/rev1");
  EXPECT_TRUE(ckpt.ok()) << ckpt.error().message();
}

// A file system on which someone who may write the checkpoint's directory
// wins the race between a shard's escape check and its open: right after
// the check resolves `swapped` (a path under the directory), that path
// becomes a symlink to `target`.
class SwapAfterCheckFileSystem final : public testing::PassThroughFileSystem {
 public:
  SwapAfterCheckFileSystem(std::string swapped, std::string target)
      : swapped_(std::move(swapped)), target_(std::move(target)) {}
  Result<std::string> RealPath(const std::string& p) override {
    auto real = base_.RealPath(p);
    if (p.starts_with(swapped_ + "/") || p == swapped_) {
      std::filesystem::rename(swapped_, swapped_ + ".moved");
      EXPECT_EQ(::symlink(target_.c_str(), swapped_.c_str()), 0);
    }
    return real;
  }

 private:
  const std::string swapped_, target_;
};

// The symlink swapped in after the check is not followed, whether it
// replaces the shard itself or a directory on its way: the weights outside
// are neither listed, fingerprinted nor loaded.
TEST(Checkpoint, ASymlinkSwappedInAfterTheEscapeCheckIsNotFollowed) {
  for (const bool whole_directory : {false, true}) {
    TempDir outside, dir;
    WriteShardWith(outside.Join("m.safetensors"), {"secret"});
    std::filesystem::create_directory(dir.Join("sub"));
    WriteShardWith(dir.Join("sub/m.safetensors"), {"a"});
    WriteIndex(dir.path(), {{"a", "sub/m.safetensors"}});
    const std::string swapped = whole_directory ? dir.Join("sub") : dir.Join("sub/m.safetensors");
    const std::string target = whole_directory ? outside.path() : outside.Join("m.safetensors");
    auto expect_refused = [&](const Status& s, const char* what) {
      // Put back for the next: the original, not the symlink.
      std::filesystem::remove(swapped);
      std::filesystem::rename(swapped + ".moved", swapped);
      ASSERT_FALSE(s.ok()) << what << (whole_directory ? ", directory" : ", file");
      EXPECT_NE(s.error().message().find("a symlink is in its way"), std::string::npos)
          << what << ": " << s.error().message();
    };
    {
      SwapAfterCheckFileSystem files(swapped, target);
      auto ckpt = OpenCheckpoint(files, dir.path());
      expect_refused(ckpt.ok() ? OkStatus() : Status(ckpt.error()), "open");
    }
    {
      SwapAfterCheckFileSystem files(swapped, target);
      auto fp = fingerprint::FingerprintCheckpoint(files, dir.path(), {});
      expect_refused(fp.ok() ? OkStatus() : Status(fp.error()), "fingerprint");
    }
    {
      SwapAfterCheckFileSystem files(swapped, target);
      auto loaded = loader::LoadCheckpoint(files, dir.path());
      expect_refused(loaded.ok() ? OkStatus() : Status(loaded.error()), "load");
    }
    {
      // The stat shortcut reaches the shard as the open would: a file the
      // cache knows (the one outside) answers for no shard it is not.
      TempDir cache_dir;
      auto cache = fingerprint::StatCache::Load(cache_dir.path());
      const fingerprint::Options cached{
          .cache = cache.get(), .cache_lookups = true, .racy_seconds = 0};
      ASSERT_TRUE(fingerprint::FingerprintCheckpoint(io::PosixFileSystem(),
                                                     outside.Join("m.safetensors"), cached)
                      .ok());
      ASSERT_TRUE(
          fingerprint::FingerprintCheckpoint(io::PosixFileSystem(), dir.path(), cached).ok());
      SwapAfterCheckFileSystem files(swapped, target);
      auto fp = fingerprint::FingerprintCheckpoint(files, dir.path(), cached);
      expect_refused(fp.ok() ? OkStatus() : Status(fp.error()), "cached fingerprint");
    }
  }
}

// A directory whose stat and index lookup each take a while: asleep (a
// network or FUSE round trip), or busy on the core (what a thread kept off
// a core on a loaded machine looks like to the clock), or some of each.
class SlowStatFileSystem final : public testing::PassThroughFileSystem {
 public:
  struct Wait {
    std::chrono::microseconds asleep{0}, busy{0};
  };
  SlowStatFileSystem(Wait directory, Wait index) : directory_(directory), index_(index) {}
  Result<bool> IsDirectory(const std::string& p) override {
    Take(directory_);
    return base_.IsDirectory(p);
  }
  Result<bool> Exists(const std::string& p) override {
    Take(index_);
    return base_.Exists(p);
  }

 private:
  static void Take(Wait w) {
    if (w.asleep.count() > 0) std::this_thread::sleep_for(w.asleep);
    for (const auto until = std::chrono::steady_clock::now() + w.busy;
         std::chrono::steady_clock::now() < until;) {
    }
  }
  Wait directory_, index_;
};

// Only a call that slept longer than a round trip's threshold is one:
// either probe's; not 3 ms on the core, nor a short sleep and then the
// core.
TEST(Checkpoint, AStatIsARoundTripWhenTheThreadSleptForIt) {
  using std::chrono::microseconds;
  TempDir dir;
  WriteShardWith(dir.Join("model.safetensors"), {"a"});
  const SlowStatFileSystem::Wait asleep{microseconds(3000), {}}, busy{{}, microseconds(3000)},
      nap_then_busy{microseconds(100), microseconds(3000)}, quick{};
  auto remote = [&](SlowStatFileSystem::Wait directory, SlowStatFileSystem::Wait index) {
    SlowStatFileSystem fs(directory, index);
    auto listing = ListShards(fs, dir.path());
    EXPECT_TRUE(listing.ok()) << listing.error().message();
    return listing.ok() && listing->remote;
  };
  EXPECT_TRUE(remote(asleep, quick)) << "the folder's stat slept";
  EXPECT_TRUE(remote(quick, asleep)) << "the index lookup slept";
  EXPECT_FALSE(remote(busy, busy)) << "both kept busy";
  // A 100 us sleep is itself over 500 us now and then on a virtual machine
  // (its timer), and is then a round trip's sleep: of five tries, one at
  // least must be taken for local. Counting the whole 3.1 ms as asleep
  // takes all five for remote.
  // Where the kernel keeps no schedstat, the sleep's length is unknown and
  // the switch alone decides.
  if (!std::ifstream("/proc/thread-self/schedstat")) return;
  int local = 0;
  for (int i = 0; i < 5; ++i) local += !remote(nap_then_busy, nap_then_busy);
  EXPECT_GT(local, 0) << "a short sleep, then the core";
}

TEST(Checkpoint, IndexedTensorMustBeInItsShard) {
  TempDir dir;
  WriteShardWith(dir.Join("m-1.safetensors"), {"a"});
  WriteShardWith(dir.Join("m-2.safetensors"), {"b"});
  WriteIndex(dir.path(),
             {{"a", "m-1.safetensors"}, {"b", "m-1.safetensors"}, {"c", "m-2.safetensors"}});
  ExpectError(dir.path(), rules::kIndexTensorMissing, "`b`");
}

TEST(Checkpoint, TensorInTwoShardsIsAnError) {
  TempDir dir;
  WriteShardWith(dir.Join("a.safetensors"), {"w"});
  WriteShardWith(dir.Join("b.safetensors"), {"w"});
  ExpectError(dir.path(), rules::kTensorInTwoShards, "`w`");
}

// The merge takes runs of one shard at once; whatever the runs, it must give
// every tensor once, in name order, and leave a name two shards share in
// neighbouring places (where the check above finds it).
TEST(Checkpoint, TensorsByNameMergesRunsOfEveryLength) {
  std::vector<Shard> shards(4);
  std::deque<std::string> names;  // what the tensors' names point into
  static constexpr uint64_t kShape[] = {1};
  uint32_t state = 12345;
  auto next = [&] { return state = state * 1103515245u + 12345u; };
  for (int i = 0; i < 2000; ++i) {
    // Runs of 1 to 40 neighbours, each in a shard drawn at random.
    Shard& shard = shards[(next() >> 8) % shards.size()];
    const int run = 1 + static_cast<int>((next() >> 8) % 40);
    for (int k = 0; k < run; ++k) {
      char name[32];
      std::snprintf(name, sizeof name, "t.%06d.%02d", i, k);
      shard.header.tensors.push_back({names.emplace_back(name), DType::kU8, kShape});
    }
  }
  shards[3].header.tensors.push_back({"u.shared", DType::kU8, kShape});
  shards[1].header.tensors.push_back({"u.shared", DType::kU8, kShape});
  shards[2].header.tensors.push_back({"v.last", DType::kU8, kShape});

  std::vector<std::string> expected;
  for (const Shard& s : shards) {
    for (const TensorInfo& t : s.header.tensors) expected.emplace_back(t.name);
  }
  std::sort(expected.begin(), expected.end());
  const std::vector<std::pair<size_t, size_t>> merged = TensorsByName(shards);
  std::vector<std::string> got;
  std::set<std::pair<size_t, size_t>> seen;
  for (const auto& [s, t] : merged) {
    got.emplace_back(shards[s].header.tensors[t].name);
    EXPECT_TRUE(seen.insert({s, t}).second) << "given twice: " << got.back();
  }
  EXPECT_EQ(got, expected);
  auto shared = std::find(got.begin(), got.end(), "u.shared");
  ASSERT_NE(shared, got.end());
  ASSERT_NE(shared + 1, got.end());
  EXPECT_EQ(*(shared + 1), "u.shared");
}

TEST(Checkpoint, EmptyDirectoryAndMalformedIndexAreErrors) {
  TempDir empty;
  ExpectError(empty.path(), rules::kNoShards);
  TempDir dir;
  WriteShardWith(dir.Join("a.safetensors"), {"w"});
  testing::WriteFileText(dir.Join(std::string(kIndexFileName)), R"({"weight_map":{"w":3}})");
  ExpectError(dir.path(), rules::kIndexNotJson, "`w`");
  testing::WriteFileText(dir.Join(std::string(kIndexFileName)), "{");
  ExpectError(dir.path(), rules::kIndexNotJson);
}

TEST(Index, TheWeightMapWhateverElseTheFileHolds) {
  WeightMap copy;
  {
    auto map =
        ParseIndex("i.json", R"({"metadata":{"total_size":3,"x":[{"a":[1,2.5,true,null]}]},)"
                             R"("weight_map":{"b":"s2.safetensors","a\u0062c":"s1.safetensors",)"
                             R"("a":"s1.safetens\u006frs"}})");
    ASSERT_TRUE(map.ok()) << map.error().message();
    copy = *map;  // the names are views: a copy keeps what they view
  }
  ASSERT_EQ(copy.entries().size(), 3u);
  EXPECT_EQ(copy.entries()[0].tensor, "a");
  EXPECT_EQ(copy.entries()[1].tensor, "abc");
  EXPECT_EQ(copy.entries()[2].tensor, "b");
  EXPECT_EQ(copy.shard_of(copy.entries()[0]), "s1.safetensors");
  EXPECT_EQ(copy.shard_of(copy.entries()[1]), "s1.safetensors");
  EXPECT_EQ(copy.shard_of(copy.entries()[2]), "s2.safetensors");
  EXPECT_EQ(copy.shards(), (std::vector<std::string>{"s2.safetensors", "s1.safetensors"}));
}

TEST(Index, BrokenJsonAnywhereAndAmbiguousMapsAreErrors) {
  for (const std::string json : {
           R"({"metadata":{"x":[01]},"weight_map":{"a":"s"}})",  // where no lookup goes
           R"({"weight_map":{"a":"s"},"z":tru})",
           R"({"weight_map":{"a":"s"}} x)",
           R"({"weight_map":{"a":"s","b":"\q"}})",
           R"({"weight_map":{"a":"s"},"weight_map":{"b":"t"}})",
           R"({"weight_map":{"a":"s","a":"t"}})",
           R"({"weight_map":[]})",
           R"({"metadata":{}})",
       }) {
    SCOPED_TRACE(json);
    auto map = ParseIndex("i.json", json);
    ASSERT_FALSE(map.ok());
    EXPECT_NE(map.error().message().find(rules::kIndexNotJson), std::string::npos)
        << map.error().message();
  }
  // The index's object and 1023 arrays are 1024 levels, the most; a value
  // in the last array is a level below it.
  auto nested = [](int depth, const std::string& inside = "") {
    return R"({"weight_map":{"a":"s"},"x":)" + std::string(static_cast<size_t>(depth), '[') +
           inside + std::string(static_cast<size_t>(depth), ']') + "}";
  };
  EXPECT_TRUE(ParseIndex("i.json", nested(1023)).ok());
  EXPECT_FALSE(ParseIndex("i.json", nested(1024)).ok());
  EXPECT_TRUE(ParseIndex("i.json", nested(1022, "0")).ok());
  EXPECT_FALSE(ParseIndex("i.json", nested(1023, "0")).ok());
  auto twice = ParseIndex("i.json", R"({"weight_map":{"a":"s"},"weight_map":{"b":"t"}})");
  ASSERT_FALSE(twice.ok());
  EXPECT_NE(twice.error().message().find("weight_map given twice"), std::string::npos)
      << twice.error().message();
}

// The raw bytes kept for the fingerprint are the file's own, its length
// prefix included.
TEST(Header, TheRawBytesAreTheFilesFirstBytes) {
  TempDir dir;
  WriteShardWith(dir.Join("a.safetensors"), {"w", "v"});
  auto file = io::PosixFileSystem().Open(dir.Join("a.safetensors"));
  ASSERT_TRUE(file.ok());
  HeaderBytes raw;
  auto header = ReadShardHeader(**file, "a.safetensors", &raw);
  ASSERT_TRUE(header.ok()) << header.error().message();
  const std::vector<std::byte> bytes = testing::ReadFileBytes(dir.Join("a.safetensors"));
  ASSERT_EQ(raw.raw().size(), header->data_offset());
  EXPECT_TRUE(std::equal(raw.raw().begin(), raw.raw().end(), bytes.begin()));
}

// Parsing an index takes about ten times its size: one over 64 MiB (real
// ones are a few MB) is refused before a byte of it is read.
TEST(Checkpoint, AnIndexOverItsLimitIsRefusedUnread) {
  TempDir dir;
  WriteShardWith(dir.Join("a.safetensors"), {"w"});
  const std::string index = dir.Join(std::string(kIndexFileName));
  testing::WriteFileText(index, "");
  ASSERT_EQ(::truncate(index.c_str(), (64 << 20) + 1), 0);  // sparse: nothing written
  ExpectError(dir.path(), "is over the limit of 67108864");
}

TEST(Checkpoint, ABadShardIsNamedInTheError) {
  TempDir dir;
  WriteShardWith(dir.Join("a.safetensors"), {"w"});
  testing::WriteFileText(dir.Join("b.safetensors"), "garbage!");
  ExpectError(dir.path(), "b.safetensors");
}

TEST(Checkpoint, ASingleFileIsACheckpointOfOneShard) {
  TempDir dir;
  WriteShardWith(dir.Join("x.safetensors"), {"w"});
  auto ckpt = OpenCheckpoint(io::PosixFileSystem(), dir.Join("x.safetensors"));
  ASSERT_TRUE(ckpt.ok());
  EXPECT_FALSE(ckpt->is_directory);
  EXPECT_EQ(ckpt->shards.size(), 1u);
}

}  // namespace
}  // namespace weightd::format
