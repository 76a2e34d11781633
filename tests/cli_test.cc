// The weightd binary as a user runs it: a separate process, real files.
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>

#include "test_util.h"

namespace weightd {
namespace {

using testing::RunWeightd;
using testing::TempDir;

std::string ReadText(const std::string& path) {
  auto bytes = testing::ReadFileBytes(path);
  return std::string(reinterpret_cast<const char*>(bytes.data()), bytes.size());
}

TEST(Cli, InspectJsonMatchesTheDocumentedGoldenOutput) {
  TempDir dir;
  ASSERT_EQ(RunWeightd({"make-checkpoint", "tiny", "--preset", "tiny", "--seed", "1"}, dir.path())
                .exit_code,
            0);
  auto r = RunWeightd({"inspect", "tiny", "--json"}, dir.path());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, ReadText(testing::SourceDir() + "/tests/golden/inspect_tiny.json"))
      << "inspect --json changed: update docs/cli.md and tests/golden/inspect_tiny.json together";
}

TEST(Cli, InspectOfABrokenFileExitsOneNamingTheRule) {
  auto r =
      RunWeightd({"inspect", testing::ConformanceDir() + "/rules/overlapping_offsets.safetensors"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_EQ(r.out, "");
  EXPECT_EQ(r.err.rfind("weightd: error: inspect: ", 0), 0u) << r.err;
  EXPECT_NE(r.err.find("offsets must be contiguous and non-overlapping"), std::string::npos)
      << r.err;
}

TEST(Cli, UsageErrorsExitTwo) {
  EXPECT_EQ(RunWeightd({"inspect"}).exit_code, 2);
  auto unknown = RunWeightd({"frobnicate"});
  EXPECT_EQ(unknown.exit_code, 2);
  EXPECT_NE(unknown.err.find("`frobnicate` is not a command"), std::string::npos) << unknown.err;
  // Asking for its help does not make it one.
  unknown = RunWeightd({"frobnicate", "--help"});
  EXPECT_EQ(unknown.exit_code, 2);
  EXPECT_NE(unknown.err.find("`frobnicate` is not a command"), std::string::npos) << unknown.err;
  TempDir dir;
  auto r = RunWeightd({"make-checkpoint", dir.Join("x"), "--preset", "llama", "--size", "lots"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("weightd: error: "), std::string::npos);
  EXPECT_EQ(RunWeightd({"inspect", "--help"}).exit_code, 0);
  // A usage error points at its command's own help.
  r = RunWeightd({"load"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("(see weightd load --help)"), std::string::npos) << r.err;
  // Options that would be ignored are refused: a rank or a device for
  // inspect (which explains every rank), --limit without --values (or 0),
  // processing flags with --values (which prints the file's tensor),
  // a preset's option on another preset.
  const std::string overall =
      testing::ConformanceDir() + "/safetensors-samples/overall.safetensors";
  for (std::vector<std::string> ignored :
       {std::vector<std::string>{"inspect", overall, "--tp-rank", "1"},
        {"inspect", overall, "--device", "cuda:0"},
        {"inspect", overall, "--limit", "2"},
        {"inspect", overall, "--values", "e", "--limit", "0"},
        {"inspect", overall, "--values", "e", "--tp-size", "2"},
        {"make-checkpoint", dir.Join("y"), "--preset", "tiny", "--size", "1G"},
        {"make-checkpoint", dir.Join("y"), "--preset", "llama", "--tensors", "5"},
        {"make-checkpoint", dir.Join("y"), "--preset", "many-tensors", "--experts", "5"},
        {"make-checkpoint", dir.Join("y"), "--preset", "llama", "--layers", "2", "--hidden", "64",
         "--size", "10M"},
        {"serve", "--socket-dir", dir.Join("y"), "--budget", "4G", "--budget", "host=8G"}}) {
    r = RunWeightd(ignored);
    EXPECT_EQ(r.exit_code, 2) << ignored[2] << " " << ignored.back() << ": " << r.err;
  }
  EXPECT_FALSE(std::filesystem::exists(dir.Join("y")));
  // A size below one layer's is not met, and that is said.
  r = RunWeightd({"make-checkpoint", dir.Join("small"), "--preset", "llama", "--size", "1K"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.err.find("--size 1K is below what this shape takes"), std::string::npos) << r.err;
  // Seconds are finite and not negative: nan would wait forever, inf not
  // at all.
  for (const char* bad : {"nan", "inf", "-1", "1e308", "5x"}) {
    r = RunWeightd({"load", dir.path(), "--wait-for-daemon", bad});
    EXPECT_EQ(r.exit_code, 2) << bad << ": " << r.err;
    EXPECT_NE(r.err.find("--wait-for-daemon"), std::string::npos) << r.err;
    EXPECT_EQ(RunWeightd({"load", dir.path(), "--hold", bad}).exit_code, 2) << bad;
    EXPECT_EQ(RunWeightd({"serve", "--socket-dir", dir.Join("s"), "--stop-timeout", bad}).exit_code,
              2)
        << bad;
    EXPECT_EQ(RunWeightd({"serve", "--socket-dir", dir.Join("s"), "--idle-timeout", bad}).exit_code,
              2)
        << bad;
  }
  // A size that does not read says why.
  for (const auto& [size, why] : std::vector<std::pair<std::string, std::string>>{
           {"1.5G", "whole numbers only (1536M, not 1.5G)"},
           {"99999999T", "more than 64 bits of bytes"},
           {"18446744073709551616", "more than 64 bits of bytes"},
           {"lots", "a whole number of bytes, or of K, M, G or T"}}) {
    r = RunWeightd({"serve", "--socket-dir", dir.Join("s"), "--budget", size});
    EXPECT_EQ(r.exit_code, 2) << size << ": " << r.err;
    EXPECT_NE(r.err.find("`" + size + "` is not a size: " + why), std::string::npos) << r.err;
  }
  r = RunWeightd({"make-checkpoint", dir.Join("m"), "--preset", "llama", "--size", "1.5G"});
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("whole numbers only"), std::string::npos) << r.err;
  // A preload makes every rank: one rank asked for is refused, not ignored.
  r = RunWeightd({"preload", dir.path(), "--tp-size", "2", "--shard-plan", "llama", "--tp-rank",
                  "1", "--socket-dir", dir.Join("s")});
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("--tp-rank is for `load`"), std::string::npos) << r.err;
  // No grace at all would close an engine's connection between its requests.
  EXPECT_EQ(RunWeightd({"serve", "--socket-dir", dir.Join("s"), "--idle-timeout", "0"}).exit_code,
            2);
  // An empty WHAT (a script's unset variable) matches nothing: a usage error.
  r = RunWeightd({"evict", "", "--socket-dir", dir.Join("s")});
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("must not be empty"), std::string::npos) << r.err;
  // An empty socket directory (a script's unset variable) is not the
  // default one.
  for (const char* command : {"serve", "status", "preload", "evict", "load"}) {
    std::vector<std::string> args = {command};
    if (std::string(command) == "preload" || std::string(command) == "load") {
      args.push_back(dir.path());
    }
    if (std::string(command) == "evict") args.push_back("all");
    args.insert(args.end(), {"--socket-dir", ""});
    r = RunWeightd(args);
    EXPECT_EQ(r.exit_code, 2) << command << ": " << r.err;
    EXPECT_NE(r.err.find("--socket-dir: must not be empty"), std::string::npos) << r.err;
  }
}

// A socket directory whose socket path cannot fit is refused before it is
// made: nothing left behind.
TEST(Cli, ServeRefusesASocketPathTooLongWithoutMakingItsDirectory) {
  TempDir dir;
  const std::string deep = dir.Join(std::string(120, 'd'));
  auto r = RunWeightd({"serve", "--socket-dir", deep});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("too long for a Unix socket"), std::string::npos) << r.err;
  EXPECT_FALSE(std::filesystem::exists(deep));
}

TEST(Cli, ValuesPrintsTheReferenceSamplesNumbers) {
  const std::string overall =
      testing::ConformanceDir() + "/safetensors-samples/overall.safetensors";
  auto e = RunWeightd({"inspect", overall, "--values", "e"});
  EXPECT_EQ(e.exit_code, 0) << e.err;
  EXPECT_EQ(e.out, "-3 -2 -1 0 1 2\n");
  auto i = RunWeightd({"inspect", overall, "--values", "I", "--json"});
  EXPECT_EQ(i.out,
            "{\"name\":\"I\",\"shard\":\"overall.safetensors\",\"dtype\":\"U32\",\"shape\":[6],"
            "\"elements\":6,\"values\":[4294967293,4294967294,4294967295,0,1,2]}\n");
  auto missing = RunWeightd({"inspect", overall, "--values", "nope"});
  EXPECT_EQ(missing.exit_code, 1);
  EXPECT_NE(missing.err.find("no tensor named `nope`"), std::string::npos);
}

TEST(Cli, MakeCheckpointReportsWhatItWrote) {
  TempDir dir;
  auto r = RunWeightd(
      {"make-checkpoint", dir.Join("m"), "--preset", "many-tensors", "--tensors", "300", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("\"tensors\": 300"), std::string::npos) << r.out;
  auto again = RunWeightd({"make-checkpoint", dir.Join("m"), "--preset", "tiny"});
  EXPECT_EQ(again.exit_code, 1);
  EXPECT_NE(again.err.find("already exists"), std::string::npos);
  // So are shards asked for that the tensors cannot fill.
  auto shards =
      RunWeightd({"make-checkpoint", dir.Join("t"), "--preset", "tiny", "--shards", "20"});
  ASSERT_EQ(shards.exit_code, 0) << shards.err;
  EXPECT_NE(shards.err.find("--shards 20 is more than this model's 10 tensors fill"),
            std::string::npos)
      << shards.err;
  // A size the shape misses by far, either way, is said.
  auto small = RunWeightd(
      {"make-checkpoint", dir.Join("s"), "--preset", "llama", "--size", "1M", "--layers", "1"});
  ASSERT_EQ(small.exit_code, 0) << small.err;
  EXPECT_NE(small.err.find("--size 1M is below what this shape takes"), std::string::npos)
      << small.err;
  auto large = RunWeightd(
      {"make-checkpoint", dir.Join("l"), "--preset", "llama", "--size", "256M", "--layers", "1"});
  ASSERT_EQ(large.exit_code, 0) << large.err;
  EXPECT_NE(large.err.find("--size 256M is above what this shape makes"), std::string::npos)
      << large.err;
}

TEST(Cli, NamesFromFilesCannotCorruptTheOutput) {
  TempDir dir;
  // A tensor name holding a terminal escape, in a file whose name is not UTF-8.
  const std::string path = dir.Join("x\xff.safetensors");
  const std::string json = R"({"a\u001b[31m":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})";
  std::string file(8, '\0');
  file[0] = static_cast<char>(json.size());
  testing::WriteFileText(path, file + json + "z");
  auto text = RunWeightd({"inspect", path});
  ASSERT_EQ(text.exit_code, 0) << text.err;
  EXPECT_EQ(text.out.find('\x1b'), std::string::npos);
  EXPECT_NE(text.out.find("a\\x1b[31m"), std::string::npos) << text.out;
  auto json_out = RunWeightd({"inspect", path, "--json"});
  EXPECT_EQ(json_out.exit_code, 0) << json_out.err;
  EXPECT_NE(json_out.out.find("\"a\\u001b[31m\""), std::string::npos) << json_out.out;
  // That path, in every command's JSON, is its bytes, not a replacement.
  const nlohmann::json hex = {{"hex", [&] {
                                 std::string h;
                                 for (unsigned char c : path) {
                                   h += "0123456789abcdef"[c >> 4];
                                   h += "0123456789abcdef"[c & 0xf];
                                 }
                                 return h;
                               }()}};
  for (std::vector<std::string> args :
       {std::vector<std::string>{"inspect", path, "--json"},
        {"fingerprint", path, "--json", "--no-cache"},
        {"load", path, "--json", "--socket-dir", dir.Join("none")}}) {
    auto r = RunWeightd(args);
    ASSERT_EQ(r.exit_code, 0) << args[0] << ": " << r.err;
    EXPECT_EQ(nlohmann::json::parse(r.out)["path"], hex) << args[0] << ": " << r.out;
  }
  // A newline in a checkpoint's path keeps the engine's fallback line one line.
  const std::string odd = dir.Join("a\nb");
  ASSERT_TRUE(std::filesystem::create_directory(odd));
  std::filesystem::copy_file(path, odd + "/model.safetensors");
  auto load = RunWeightd({"load", odd, "--socket-dir", dir.Join("none")});
  ASSERT_EQ(load.exit_code, 0) << load.err;
  EXPECT_NE(load.err.find("a\\x0ab"), std::string::npos) << load.err;
  EXPECT_EQ(load.err.find("a\nb"), std::string::npos) << load.err;
}

TEST(Cli, TheDemoRemovesWhatItMadeAndNothingElse) {
  TempDir dir;
  namespace fs = std::filesystem;
  auto write = [](const std::string& path) {
    testing::WriteFileBytes(path, std::vector<std::byte>(5, std::byte{'k'}));
  };
  // A folder with a user's file in it, or a socket directory beside the
  // path given: refused before anything is made, and nothing removed.
  fs::create_directories(dir.Join("model"));
  write(dir.Join("model/notes.txt"));
  auto r = RunWeightd({"demo", "--size", "16M", "--dir", dir.Join("model")});
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("already exists"), std::string::npos) << r.err;
  EXPECT_TRUE(fs::exists(dir.Join("model/notes.txt")));
  EXPECT_FALSE(fs::exists(dir.Join("model.sock")));
  fs::create_directories(dir.Join("other.sock"));
  write(dir.Join("other.sock/daemon.lock"));
  r = RunWeightd({"demo", "--size", "16M", "--dir", dir.Join("other")});
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_TRUE(fs::exists(dir.Join("other.sock/daemon.lock")));
  EXPECT_FALSE(fs::exists(dir.Join("other")));
  // The whole story, on a small model: what it made is gone, its
  // neighbours stay.
  write(dir.Join("fresh.txt"));
  r = RunWeightd({"demo", "--size", "16M", "--dir", dir.Join("fresh")});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("the same bytes as from disk"), std::string::npos) << r.out;
  for (const char* made : {"fresh", "fresh.sock", "fresh.cache"}) {
    EXPECT_FALSE(fs::exists(dir.Join(made))) << made;
  }
  EXPECT_TRUE(fs::exists(dir.Join("fresh.txt")));
}

// Processes whose command line holds `text`.
int ProcessesNaming(const std::string& text) {
  int n = 0;
  for (const auto& e : std::filesystem::directory_iterator("/proc")) {
    std::ifstream in(e.path() / "cmdline", std::ios::binary);
    const std::string cmdline((std::istreambuf_iterator<char>(in)), {});
    n += cmdline.find(text) != std::string::npos;
  }
  return n;
}

// Ended by a signal (SIGTERM here), the demo stops its daemon and removes
// what it made, as at its end; make-checkpoint removes the folder it was
// writing. The signal still ends them: 128 + 15.
TEST(Cli, ASignalRemovesWhatTheDemoAndTheGeneratorWereMaking) {
  TempDir dir;
  namespace fs = std::filesystem;
  {
    testing::Process demo({"demo", "--size", "1G", "--dir", dir.Join("d")});
    // Its daemon starts once the model is generated: tens of seconds on a
    // slow machine under a sanitizer, so the wait ends when the demo does
    // (within the test's own time limit, so that a hang says what it saw).
    const std::string socket = dir.Join("d.sock/weightd.sock");
    ASSERT_TRUE(testing::Eventually([&] { return fs::exists(socket) || demo.Exits(0); }, 300));
    ASSERT_TRUE(fs::exists(socket)) << demo.out() << demo.err();
    demo.Signal(SIGTERM);
    EXPECT_EQ(demo.Wait(), 128 + SIGTERM) << demo.out() << demo.err();
    // What it told before the signal is there, not lost in a buffer.
    EXPECT_NE(demo.out().find("2. start the daemon"), std::string::npos) << demo.out();
    for (const char* made : {"d", "d.sock", "d.cache"}) {
      EXPECT_FALSE(fs::exists(dir.Join(made))) << made;
    }
    EXPECT_EQ(ProcessesNaming(dir.Join("d.sock")), 0) << "its daemon or engine is left running";
  }
  {
    testing::Process make({"make-checkpoint", dir.Join("m"), "--preset", "llama", "--size", "2G"});
    auto partial = [&] {
      for (const auto& e : fs::directory_iterator(dir.path())) {
        if (e.path().filename().string().starts_with("m.partial-")) return true;
      }
      return false;
    };
    ASSERT_TRUE(testing::Eventually(partial));
    make.Signal(SIGTERM);
    EXPECT_EQ(make.Wait(), 128 + SIGTERM) << make.err();
    EXPECT_FALSE(partial());
    EXPECT_FALSE(fs::exists(dir.Join("m")));
  }
}

TEST(Cli, OutOfRangeGeneratorOptionsAreUsageErrors) {
  TempDir dir;
  for (const char* flag : {"--layers", "--experts", "--tensors", "--shards"}) {
    auto r = RunWeightd({"make-checkpoint", dir.Join("m"), "--preset", "k3-layout", flag, "-1"});
    EXPECT_EQ(r.exit_code, 2) << flag << ": " << r.err;
  }
  // Seeds outside 64 bits are refused, not all taken as 2^64 - 1.
  for (const char* seed : {"-1", "18446744073709551616", "99999999999999999999", "+3", "1x"}) {
    auto r = RunWeightd({"make-checkpoint", dir.Join("m"), "--preset", "tiny", "--seed", seed});
    EXPECT_EQ(r.exit_code, 2) << seed << ": " << r.err;
  }
  EXPECT_FALSE(std::filesystem::exists(dir.Join("m")));
  auto r = RunWeightd(
      {"make-checkpoint", dir.Join("m"), "--preset", "tiny", "--seed", "18446744073709551615"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
}

// An empty value (a script's unset variable) is not taken for a flag left
// out: --save "" saves nothing and says so; --values "" asks for the
// tensor named "", which this checkpoint lacks.
TEST(Cli, EmptyValuesAreNotFlagsLeftOut) {
  TempDir dir;
  const std::string m = dir.Join("m");
  ASSERT_EQ(RunWeightd({"make-checkpoint", m, "--preset", "tiny"}).exit_code, 0);
  auto save = RunWeightd({"load", m, "--save", "", "--socket-dir", dir.Join("sock")});
  EXPECT_EQ(save.exit_code, 2) << save.err;
  EXPECT_NE(save.err.find("--save: must not be empty"), std::string::npos) << save.err;
  // Nor is an empty checkpoint or folder named: a usage error, saying so.
  for (const std::vector<std::string>& empty :
       {std::vector<std::string>{"load", ""},
        {"preload", ""},
        {"inspect", ""},
        {"fingerprint", ""},
        {"make-checkpoint", "", "--preset", "tiny"},
        {"demo", "--dir", ""},
        {"make-checkpoint", dir.Join("n"), "--preset", "llama", "--size", ""},
        {"demo", "--size", ""},
        {"serve", "--config", "", "--socket-dir", dir.Join("sock")},
        {"load", m, "--shard-plan", "", "--socket-dir", dir.Join("sock")}}) {
    auto r = RunWeightd(empty);
    EXPECT_EQ(r.exit_code, 2) << empty[0] << ": " << r.err;
    EXPECT_NE(r.err.find("must not be empty"), std::string::npos) << r.err;
  }
  auto values = RunWeightd({"inspect", m, "--values", ""});
  EXPECT_EQ(values.exit_code, 1) << values.out;
  EXPECT_NE(values.err.find("no tensor named ``"), std::string::npos) << values.err;
}

TEST(Cli, FingerprintPrintsTheDocumentedKeysAndUsesTheStatCache) {
  TempDir dir, cache;
  ::setenv("WEIGHTD_CACHE_DIR", cache.path().c_str(), 1);
  ASSERT_EQ(RunWeightd({"make-checkpoint", dir.Join("m"), "--preset", "tiny"}).exit_code, 0);
  // Files changed in the last 2 s are not cached (a rewrite in the same
  // timestamp tick would keep their signature): let the new ones age.
  ::sleep(3);
  auto cold = RunWeightd({"fingerprint", dir.Join("m"), "--json"});
  ASSERT_EQ(cold.exit_code, 0) << cold.err;
  for (const char* key : {"\"digest\": \"xxh3-128:", "\"mode\": \"sampled\"", "\"shards\": 1",
                          "\"shard_digests\":", "\"tensors\": 10",
                          "\"reads\":", "\"bytes_read\":", "\"seconds\":", "\"cache_hits\": 0"}) {
    EXPECT_NE(cold.out.find(key), std::string::npos) << key << " in " << cold.out;
  }
  auto warm = RunWeightd({"fingerprint", dir.Join("m"), "--json"});
  EXPECT_NE(warm.out.find("\"cache_hits\": 1"), std::string::npos) << warm.out;
  auto plain = RunWeightd({"fingerprint", dir.Join("m"), "--no-cache"});
  EXPECT_EQ(plain.out.substr(0, 9), "xxh3-128:");
  auto none = RunWeightd({"fingerprint", cache.Join("nothing-here")});
  EXPECT_EQ(none.exit_code, 1);
  EXPECT_NE(none.err.find("cannot fingerprint"), std::string::npos) << none.err;
  ::unsetenv("WEIGHTD_CACHE_DIR");
}

}  // namespace
}  // namespace weightd
