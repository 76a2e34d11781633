// weightd fingerprint through a real latencyfs mount: the digest must equal
// the one computed on the source directly, and every read the plan counts
// must be one read the file system served.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "fingerprint/fingerprint.h"
#include "format/synthetic.h"
#include "io/file.h"
#include "protocol/cache_key.h"
#include "protocol/channel.h"
#include "test_util.h"

namespace weightd {
namespace {

using testing::TempDir;

// A latencyfs process serving `src` at `mnt`, stopped (and its statistics
// read) by Stop() or the destructor.
class Mount {
 public:
  Mount(const std::string& src, const std::string& mnt, const std::string& stats,
        const std::string& latency, const std::string& bandwidth = "0")
      : mnt_(mnt) {
    struct stat outer;
    ::stat(mnt.c_str(), &outer);
    pid_ = ::fork();
    if (pid_ == 0) {
      ::execl(LATENCYFS_BINARY, "latencyfs", src.c_str(), mnt.c_str(), "--latency", latency.c_str(),
              "--bandwidth", bandwidth.c_str(), "--stats-file", stats.c_str(),
              static_cast<char*>(nullptr));
      ::_exit(127);
    }
    for (int i = 0; i < 500 && !mounted_; ++i) {
      struct stat st;
      mounted_ = ::stat(mnt.c_str(), &st) == 0 && st.st_dev != outer.st_dev;
      if (!mounted_) ::usleep(10'000);
    }
  }
  Mount(const Mount&) = delete;
  Mount& operator=(const Mount&) = delete;
  ~Mount() { Stop(); }

  bool mounted() const { return mounted_; }

  void Stop() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGTERM);
    int status = 0;
    ::waitpid(pid_, &status, 0);
    pid_ = -1;
  }

 private:
  std::string mnt_;
  pid_t pid_ = -1;
  bool mounted_ = false;
};

bool HaveFuse() { return ::access("/dev/fuse", R_OK | W_OK) == 0; }

// A checkpoint (tiny unless `model` says otherwise) at mnt()/m, served
// through latencyfs at `latency` per operation and `bandwidth`, beside a
// socket directory and a stat cache of its own.
class SlowCheckpoint {
 public:
  explicit SlowCheckpoint(const std::string& latency, const std::string& bandwidth = "0",
                          const format::SyntheticOptions& model = {.preset = "tiny"}) {
    ::mkdir(src().c_str(), 0700);
    ::mkdir(mnt().c_str(), 0700);
    written_ = format::WriteSyntheticCheckpoint(src() + "/m", model).ok();
    mount_ = std::make_unique<Mount>(src(), mnt(), dir_.Join("stats.json"), latency, bandwidth);
    ::setenv("WEIGHTD_CACHE_DIR", dir_.Join("cache").c_str(), 1);
  }
  bool ready() const { return written_ && mount_->mounted(); }
  std::string src() const { return dir_.Join("src"); }
  std::string mnt() const { return dir_.Join("mnt"); }
  std::string sock() const { return dir_.Join("sock"); }
  // Beside the rest, for files of the test's own.
  std::string Join(const std::string& name) const { return dir_.Join(name); }

 private:
  TempDir dir_;
  bool written_ = false;
  std::unique_ptr<Mount> mount_;
};

TEST(Latencyfs, FingerprintThroughTheMountMatchesAndReadsAreCounted) {
  if (!HaveFuse()) GTEST_SKIP() << "/dev/fuse is not available here";
  TempDir dir;
  const std::string src = dir.Join("src"), mnt = dir.Join("mnt"), stats = dir.Join("stats.json");
  ASSERT_TRUE(
      format::WriteSyntheticCheckpoint(src, {.preset = "llama", .size_bytes = 8 << 20}).ok());
  ::mkdir(mnt.c_str(), 0700);

  auto direct = testing::RunWeightd({"fingerprint", src, "--no-cache", "--json"});
  ASSERT_EQ(direct.exit_code, 0) << direct.err;

  nlohmann::json through;
  {
    Mount mount(src, mnt, stats, "1ms");
    ASSERT_TRUE(mount.mounted()) << "latencyfs did not mount";
    auto r = testing::RunWeightd({"fingerprint", mnt, "--no-cache", "--json"});
    ASSERT_EQ(r.exit_code, 0) << r.err;
    through = nlohmann::json::parse(r.out);
    mount.Stop();
  }
  const auto expected = nlohmann::json::parse(direct.out);
  EXPECT_EQ(through["digest"], expected["digest"]);
  EXPECT_EQ(through["reads"], expected["reads"]);

  std::ifstream in(stats);
  ASSERT_TRUE(in) << "latencyfs wrote no statistics";
  const auto served = nlohmann::json::parse(in);
  EXPECT_EQ(served["read"], through["reads"]) << served.dump();
  EXPECT_EQ(served["read_bytes"], through["bytes_read"]) << served.dump();
  // One open per shard and the index.
  EXPECT_EQ(served["open"], through["shards"].get<int>() + 1) << served.dump();
  EXPECT_EQ(through["shard_digests"].size(), through["shards"].get<size_t>());
}

// Where a stat costs a round trip, each wave of reads costs one too: the
// fingerprint's samples all go out at once there, whatever a local file
// system's window would be.
TEST(Latencyfs, OnASlowMountEverySampleReadGoesOutAtOnce) {
  if (!HaveFuse()) GTEST_SKIP() << "/dev/fuse is not available here";
  TempDir dir;
  const std::string src = dir.Join("src"), mnt = dir.Join("mnt"), stats = dir.Join("stats.json");
  ASSERT_TRUE(
      format::WriteSyntheticCheckpoint(src, {.preset = "many-tensors", .tensors = 600, .shards = 2})
          .ok());
  ::mkdir(mnt.c_str(), 0700);
  // A sample a read, none in the first read, a window of one read where
  // the file system is local.
  const fingerprint::Options one_by_one{
      .coalesce = false, .speculative_bytes = 8, .local_window_bytes = 1};
  auto direct = fingerprint::FingerprintCheckpoint(io::PosixFileSystem(), src, one_by_one);
  ASSERT_TRUE(direct.ok()) << direct.error().message();
  Mount mount(src, mnt, stats, "1ms");
  ASSERT_TRUE(mount.mounted()) << "latencyfs did not mount";
  auto through = fingerprint::FingerprintCheckpoint(io::PosixFileSystem(), mnt, one_by_one);
  ASSERT_TRUE(through.ok()) << through.error().message();
  EXPECT_EQ(through->digest, direct->digest);
  ASSERT_GE(through->reads, 600u);
  // The listing's and each shard's few, and 600 sample reads in two waves
  // of at most 512: not one per read.
  EXPECT_LT(through->round_trips, 20u) << through->reads << " reads";
}

// On a slow mount the fingerprint opens the shards it sees in the listing
// while the index is still being read. What the index does not name, and
// shards reached through a symlink, must not leak into the digest; the reads
// spent on them are still counted.
TEST(Latencyfs, ShardsOpenedFromTheListingGiveTheSameDigest) {
  if (!HaveFuse()) GTEST_SKIP() << "/dev/fuse is not available here";
  TempDir dir;
  const std::string bucket = dir.Join("bucket"), src = bucket + "/model", mnt = dir.Join("mnt");
  ::mkdir(bucket.c_str(), 0700);
  ASSERT_TRUE(
      format::WriteSyntheticCheckpoint(src, {.preset = "llama", .size_bytes = 8 << 20, .shards = 3})
          .ok());
  ::mkdir(mnt.c_str(), 0700);
  // An unlisted copy of a shard, and a listed shard that is a symlink.
  auto first = testing::ReadFileBytes(src + "/model-00001-of-00003.safetensors");
  testing::WriteFileBytes(src + "/stray.safetensors", first);
  ASSERT_EQ(
      ::rename((src + "/model-00003-of-00003.safetensors").c_str(), (src + "/third.bin").c_str()),
      0);
  ASSERT_EQ(::symlink("third.bin", (src + "/model-00003-of-00003.safetensors").c_str()), 0);

  auto direct = testing::RunWeightd({"fingerprint", src, "--no-cache", "--json"});
  ASSERT_EQ(direct.exit_code, 0) << direct.err;
  nlohmann::json through;
  const std::string stats = dir.Join("stats.json");
  {
    Mount mount(bucket, mnt, stats, "20ms");
    ASSERT_TRUE(mount.mounted()) << "latencyfs did not mount";
    auto r = testing::RunWeightd({"fingerprint", mnt + "/model", "--no-cache", "--json"});
    ASSERT_EQ(r.exit_code, 0) << r.err;
    through = nlohmann::json::parse(r.out);
    mount.Stop();
  }
  const auto expected = nlohmann::json::parse(direct.out);
  EXPECT_EQ(through["digest"], expected["digest"]);
  EXPECT_EQ(through["shards"], 3);
  // The stray shard's head was read early and dropped.
  EXPECT_GT(through["reads"].get<int>(), expected["reads"].get<int>());
  std::ifstream in(stats);
  ASSERT_TRUE(in) << "latencyfs wrote no statistics";
  const auto served = nlohmann::json::parse(in);
  EXPECT_EQ(served["read"], through["reads"]) << served.dump();
  EXPECT_EQ(served["read_bytes"], through["bytes_read"]) << served.dump();
}

TEST(Latencyfs, IsReadOnlyAndPassesBytesThrough) {
  if (!HaveFuse()) GTEST_SKIP() << "/dev/fuse is not available here";
  TempDir dir;
  const std::string src = dir.Join("src"), mnt = dir.Join("mnt");
  ::mkdir(src.c_str(), 0700);
  ::mkdir(mnt.c_str(), 0700);
  testing::WriteFileText(src + "/f", "hello, latency");
  ASSERT_EQ(::symlink("f", (src + "/link").c_str()), 0);
  Mount mount(src, mnt, dir.Join("stats.json"), "0");
  ASSERT_TRUE(mount.mounted());
  auto bytes = testing::ReadFileBytes(mnt + "/link");
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(bytes.data()), bytes.size()),
            "hello, latency");
  EXPECT_THROW(testing::WriteFileText(mnt + "/f", "x"), std::runtime_error);
}

// A preload that moves no bytes for a while (here its fingerprint and
// headers: some twenty operations one after another, each 0.5 s) still tells its asker the daemon
// is alive: heartbeats come before the answer, and the operator's command waits through them.
TEST(Latencyfs, ASlowPreloadSendsHeartbeats) {
  if (!HaveFuse()) GTEST_SKIP() << "/dev/fuse is not available here";
  SlowCheckpoint slow("500ms");
  ASSERT_TRUE(slow.ready());
  const std::string mnt = slow.mnt(), sock = slow.sock();
  testing::Process daemon({"serve", "--socket-dir", sock});
  ASSERT_TRUE(daemon.WaitForOutput("ready")) << daemon.err();

  auto ch = protocol::ConnectToDaemon(sock);
  ASSERT_TRUE(ch.ok()) << ch.error().message();
  ASSERT_TRUE(ch->Send({{"type", "preload"},
                        {"path", mnt + "/m"},
                        {"processing", protocol::ToJson(protocol::Processing{})}})
                  .ok());
  int heartbeats = 0;
  std::string last;
  for (int i = 0; i < 1000; ++i) {
    auto m = ch->Receive(60'000);
    ASSERT_TRUE(m.ok()) << m.error().message();
    last = m->type();
    if (last != "progress") break;
    if (m->body.value("heartbeat", false)) ++heartbeats;
  }
  EXPECT_EQ(last, "preloaded") << daemon.err();
  EXPECT_GE(heartbeats, 1);
  daemon.Signal(SIGTERM);
  EXPECT_EQ(daemon.Wait(), 0) << daemon.err();
}

// An engine asking for a model the daemon is loading right now (its
// config's preloads at start) waits for that load when it is willing to
// wait for the daemon, instead of reading the same files itself; without
// --wait-for-daemon, its miss says why.
TEST(Latencyfs, AnEngineMayWaitForTheLoadOfItsModelInFlight) {
  if (!HaveFuse()) GTEST_SKIP() << "/dev/fuse is not available here";
  // Its 23 MB come through at 4 MB/s: a load of some seconds.
  SlowCheckpoint slow("0", "4M", {.preset = "llama", .size_bytes = 16 << 20});
  ASSERT_TRUE(slow.ready());
  const std::string src = slow.src(), mnt = slow.mnt(), sock = slow.sock();
  testing::Process daemon({"serve", "--socket-dir", sock});
  ASSERT_TRUE(daemon.WaitForOutput("ready")) << daemon.err();
  testing::Process preload({"preload", mnt + "/m", "--socket-dir", sock});
  auto reserved = [&] {
    auto r = testing::RunWeightd({"status", "--json", "--socket-dir", sock});
    return r.exit_code == 0 &&
           nlohmann::json::parse(r.out)["devices"][0]["reserved"].get<uint64_t>() > 0;
  };
  ASSERT_TRUE(testing::Eventually(reserved)) << daemon.err();  // the load is under way

  // The same checkpoint, read by the engines where it lies.
  auto impatient =
      testing::RunWeightd({"load", src + "/m", "--json", "--socket-dir", sock, "--checksum"});
  ASSERT_EQ(impatient.exit_code, 0) << impatient.err;
  auto j = nlohmann::json::parse(impatient.out);
  EXPECT_EQ(j["source"], "disk");
  EXPECT_NE(j["reason"].get<std::string>().find("loading this very model right now"),
            std::string::npos)
      << j.dump();
  auto patient = testing::RunWeightd({"load", src + "/m", "--json", "--socket-dir", sock,
                                      "--checksum", "--wait-for-daemon", "600"});
  ASSERT_EQ(patient.exit_code, 0) << patient.err;
  auto k = nlohmann::json::parse(patient.out);
  EXPECT_EQ(k["source"], "daemon") << k.dump() << daemon.err();
  EXPECT_EQ(k["checksum"], j["checksum"]);
  // It waited for the load, rather than coming after it, and says so.
  EXPECT_TRUE(testing::Logged(daemon, ", after waiting for its load")) << daemon.err();
  EXPECT_GT(k["waited_seconds"].get<double>(), 0) << k.dump();
  EXPECT_EQ(preload.Wait(), 0) << preload.err();
  daemon.Signal(SIGTERM);
  EXPECT_EQ(daemon.Wait(), 0) << daemon.err();
}

// How many of the process's threads are its read pool's (`weightd-io`).
int ReadThreadsOf(int pid) {
  int n = 0;
  std::error_code ec;
  for (const auto& task :
       std::filesystem::directory_iterator("/proc/" + std::to_string(pid) + "/task", ec)) {
    std::ifstream comm(task.path() / "comm");
    std::string name;
    n += std::getline(comm, name) && name == "weightd-io";
  }
  return n;
}

// A daemon in a small container keeps its reads in flight, a pool thread
// each, within what it keeps of the group's memory for its own work. On a
// mount that answers in round trips a fingerprint asks for 512 threads at
// once, about 18 MiB in a release build: more than half of the 32 MiB a
// 256 MiB group leaves it, and not counted in the room for segments.
TEST(Latencyfs, ADaemonInASmallGroupKeepsItsReadsInFlightWithinWhatItKeeps) {
  if (!HaveFuse()) GTEST_SKIP() << "/dev/fuse is not available here";
  testing::MemoryGroup group(256ull << 20);
  if (!group.skip.empty()) GTEST_SKIP() << group.skip;
  ASSERT_EQ(group.error, "");
  // 1 ms an operation: the listing's stat is a round trip, so the
  // checkpoint is taken for remote and the pool is grown for it.
  SlowCheckpoint slow("1ms", "0", {.preset = "many-tensors", .tensors = 2000, .shards = 2});
  ASSERT_TRUE(slow.ready());
  const std::string sock = slow.sock();
  testing::Process daemon({"serve", "--socket-dir", sock, "--budget", "host=64M"}, group.Prefix());
  ASSERT_TRUE(daemon.WaitForOutput("ready")) << daemon.err();
  // A quarter of the 32 MiB kept, at 64 KiB a read; the buffers the rest,
  // 24 MiB, of which a fingerprint's first reads, one a shard in flight,
  // take a quarter (48 KiB each, not 256: 6 MiB for 128 shards at once).
  EXPECT_TRUE(testing::Logged(daemon, "reads in flight: at most 128 per preload")) << daemon.err();
  EXPECT_TRUE(testing::Logged(daemon,
                              "a fingerprint's first read of each shard 48.00 KiB, its "
                              "window 18.00 MiB"))
      << daemon.err();
  auto preload = testing::RunWeightd({"preload", slow.mnt() + "/m", "--socket-dir", sock});
  ASSERT_EQ(preload.exit_code, 0) << preload.err << daemon.err();
  // The pool grows in the background, a thread at a time: its most over
  // a while after the preload.
  int most = 0;
  for (int i = 0; i < 30; ++i) {
    most = std::max(most, ReadThreadsOf(daemon.pid()));
    ::usleep(100'000);
  }
  EXPECT_GT(most, 0);
  EXPECT_LE(most, 128) << group.Describe();
  EXPECT_EQ(group.OomKills(), 0) << group.Describe();
  daemon.Signal(SIGTERM);
  EXPECT_EQ(daemon.Wait(), 0) << daemon.err();
}

// Two preloads at once, in a control group with room for both: the second
// is weighed against what the first has still to take, not against all of
// its reservation again, since the pages it has written are out of the
// kernel's figure already. (In a group of 768 MiB, of which 96 are kept
// for the daemon: once the first, of 400 MiB, has written 60% of it, its
// pages counted twice would leave no room at all for the second, of 80
// MiB; counted once, 192 MiB less the daemon's own memory, about 40 MiB,
// and 140 under AddressSanitizer.)
TEST(Latencyfs, APreloadBesideAnotherInProgressCountsItsWrittenPagesOnce) {
  if (!HaveFuse()) GTEST_SKIP() << "/dev/fuse is not available here";
  testing::MemoryGroup group(768ull << 20);
  if (!group.skip.empty()) GTEST_SKIP() << group.skip;
  ASSERT_EQ(group.error, "");
  // 400 MiB through at 48 MB/s: a load of some nine seconds, three and a
  // half of them left for the second preload.
  SlowCheckpoint slow("0", "48M", {.preset = "llama", .size_bytes = 393 << 20});
  ASSERT_TRUE(slow.ready());
  const std::string second_model = slow.Join("second"), sock = slow.sock();
  ASSERT_TRUE(format::WriteSyntheticCheckpoint(
                  second_model, {.preset = "llama", .seed = 2, .size_bytes = 78 << 20})
                  .ok());
  // A budget above the group's limit: only the kernel's figure can refuse.
  testing::Process daemon({"serve", "--socket-dir", sock, "--budget", "host=2G"}, group.Prefix());
  ASSERT_TRUE(daemon.WaitForOutput("ready")) << daemon.err();
  testing::Process first({"preload", slow.mnt() + "/m", "--socket-dir", sock});
  auto loading = [&] {
    auto r = testing::RunWeightd({"status", "--json", "--socket-dir", sock});
    return r.exit_code == 0 ? nlohmann::json::parse(r.out).value("loading", nlohmann::json())
                            : nlohmann::json();
  };
  ASSERT_TRUE(testing::Eventually([&] {
    const nlohmann::json l = loading();
    return l.is_array() && !l.empty() && l[0].value("total", 0ull) > 0 &&
           l[0].value("done", 0ull) * 10 >= l[0].value("total", 0ull) * 6;
  })) << daemon.err();
  auto second = testing::RunWeightd({"preload", second_model, "--socket-dir", sock});
  EXPECT_EQ(second.exit_code, 0) << second.err << daemon.err();
  EXPECT_FALSE(loading().empty()) << "the first load ended first: the test proves nothing";
  EXPECT_EQ(first.Wait(), 0) << first.err();
  EXPECT_EQ(group.OomKills(), 0);
  daemon.Signal(SIGTERM);
  EXPECT_EQ(daemon.Wait(), 0) << daemon.err();
}

// An engine that waits for a load and is killed meanwhile frees the
// daemon's thread at once, not when the load ends (up to an hour of wait).
TEST(Latencyfs, AnEngineKilledWhileItWaitsForALoadEndsItsWait) {
  if (!HaveFuse()) GTEST_SKIP() << "/dev/fuse is not available here";
  // Its 23 MB come through at 1 MB/s: a load of some twenty seconds.
  SlowCheckpoint slow("0", "1M", {.preset = "llama", .size_bytes = 16 << 20});
  ASSERT_TRUE(slow.ready());
  const std::string src = slow.src(), mnt = slow.mnt(), sock = slow.sock();
  testing::Process daemon({"serve", "--socket-dir", sock});
  ASSERT_TRUE(daemon.WaitForOutput("ready")) << daemon.err();
  testing::Process preload({"preload", mnt + "/m", "--socket-dir", sock});
  auto status = [&] {
    auto r = testing::RunWeightd({"status", "--json", "--socket-dir", sock});
    return r.exit_code == 0 ? nlohmann::json::parse(r.out) : nlohmann::json::object();
  };
  ASSERT_TRUE(testing::Eventually([&] {
    return !status().value("loading", nlohmann::json()).empty();
  })) << daemon.err();
  testing::Process engine({"load", src + "/m", "--socket-dir", sock, "--wait-for-daemon", "600"});
  // The preload's, the engine's, and the status's own.
  ASSERT_TRUE(testing::Eventually([&] { return status().value("connections", 0) == 3; }))
      << daemon.err();
  ::usleep(500'000);  // its acquire, sent as it connected, is waiting
  engine.Signal(SIGKILL);
  engine.Wait();
  EXPECT_TRUE(testing::Eventually(
      [&] {
        return daemon.err().find("the engine went away while it waited for a load") !=
               std::string::npos;
      },
      10))
      << daemon.err();
  EXPECT_FALSE(status()["loading"].empty()) << "the load ended first: the test proves nothing";
  daemon.Signal(SIGTERM);
  EXPECT_EQ(daemon.Wait(), 0) << daemon.err();
  preload.Wait();
}

// An engine that trusts the name a config's model will be pinned as,
// started with the daemon: willing to wait for the daemon, it waits for
// that model's load and takes it on trust, rather than being told the
// name is not served and checking its checkpoint's content instead.
TEST(Latencyfs, AnEngineTrustingAConfigModelsPinWaitsForItsLoad) {
  if (!HaveFuse()) GTEST_SKIP() << "/dev/fuse is not available here";
  // Its 23 MB come through at 4 MB/s: a load of some seconds.
  SlowCheckpoint slow("0", "4M", {.preset = "llama", .size_bytes = 16 << 20});
  ASSERT_TRUE(slow.ready());
  const std::string src = slow.src(), mnt = slow.mnt(), sock = slow.sock();
  const std::string config = slow.Join("c.toml");
  testing::WriteFileText(config, "[[model]]\npath = \"" + mnt + "/m\"\npin = \"prod\"\n");
  testing::Process daemon({"serve", "--socket-dir", sock, "--config", config});
  ASSERT_TRUE(daemon.WaitForOutput("ready")) << daemon.err();

  // Not willing to wait: the name is not served yet, nor the content's
  // key (coming, or not keyed yet), and the model is read from disk.
  auto impatient = testing::RunWeightd(
      {"load", src + "/m", "--trust", "prod", "--json", "--socket-dir", sock, "--checksum"});
  ASSERT_EQ(impatient.exit_code, 0) << impatient.err;
  auto j = nlohmann::json::parse(impatient.out);
  EXPECT_EQ(j["source"], "disk");
  EXPECT_NE(impatient.err.find("trusted name `prod` not served"), std::string::npos)
      << impatient.err;
  auto patient =
      testing::RunWeightd({"load", src + "/m", "--trust", "prod", "--json", "--socket-dir", sock,
                           "--checksum", "--wait-for-daemon", "600"});
  ASSERT_EQ(patient.exit_code, 0) << patient.err;
  auto k = nlohmann::json::parse(patient.out);
  EXPECT_EQ(k["source"], "daemon") << k.dump() << daemon.err();
  EXPECT_EQ(k["trusted"], "prod") << k.dump() << patient.err;
  EXPECT_EQ(k["checksum"], j["checksum"]);
  EXPECT_TRUE(testing::Logged(daemon, ", after waiting for its load")) << daemon.err();
  daemon.Signal(SIGTERM);
  EXPECT_EQ(daemon.Wait(), 0) << daemon.err();
}

// The config's models load one after another; an engine started with the
// daemon, willing to wait for it, waits for its model even while it is
// queued behind another, and an engine whose model is not in the config is
// not held up by their loads: every config model is keyed at once.
TEST(Latencyfs, EnginesWaitForQueuedConfigModelsButNotForOthers) {
  if (!HaveFuse()) GTEST_SKIP() << "/dev/fuse is not available here";
  // The first model's 23 MB come through at 4 MB/s: a load of some seconds.
  SlowCheckpoint slow("0", "4M", {.preset = "llama", .size_bytes = 16 << 20});
  ASSERT_TRUE(slow.ready());
  const std::string mnt = slow.mnt(), sock = slow.sock();
  const std::string queued = slow.Join("queued"), other = slow.Join("other");
  ASSERT_TRUE(format::WriteSyntheticCheckpoint(queued, {.preset = "tiny"}).ok());
  ASSERT_TRUE(format::WriteSyntheticCheckpoint(other, {.preset = "tiny", .seed = 7}).ok());
  const std::string config = slow.Join("c.toml");
  testing::WriteFileText(
      config, "[[model]]\npath = \"" + mnt + "/m\"\n[[model]]\npath = \"" + queued + "\"\n");
  testing::Process daemon({"serve", "--socket-dir", sock, "--config", config});
  ASSERT_TRUE(daemon.WaitForOutput("ready")) << daemon.err();

  auto slow_resident = [&] {
    auto r = testing::RunWeightd({"status", "--json", "--socket-dir", sock});
    if (r.exit_code != 0) return false;
    const nlohmann::json status = nlohmann::json::parse(r.out);
    for (const auto& m : status["models"]) {
      if (m["path"] == mnt + "/m") return true;
    }
    return false;
  };
  auto unrelated = testing::RunWeightd(
      {"load", other, "--json", "--socket-dir", sock, "--wait-for-daemon", "600"});
  ASSERT_EQ(unrelated.exit_code, 0) << unrelated.err;
  EXPECT_EQ(nlohmann::json::parse(unrelated.out)["source"], "disk");
  EXPECT_FALSE(slow_resident()) << "the unrelated engine waited for the first model's load";

  auto patient = testing::RunWeightd(
      {"load", queued, "--json", "--socket-dir", sock, "--wait-for-daemon", "600"});
  ASSERT_EQ(patient.exit_code, 0) << patient.err;
  EXPECT_EQ(nlohmann::json::parse(patient.out)["source"], "daemon") << patient.out << daemon.err();
  EXPECT_TRUE(testing::Logged(daemon, ", after waiting for its load")) << daemon.err();
  // In the config's order: the first was loaded before the second.
  const std::string log = daemon.err();
  EXPECT_LT(log.find("preloaded " + mnt + "/m"), log.find("preloaded " + queued)) << log;
  daemon.Signal(SIGTERM);
  EXPECT_EQ(daemon.Wait(), 0) << daemon.err();
}

// A GPU engine started with the daemon, whose model the config loads into
// host memory: it waits for that load and copies the model up from there
// (the host-tier reload), instead of reading the files itself. On the
// emulated CUDA driver (tools/emulated_cuda).
TEST(Latencyfs, AGpuEngineWaitsForItsModelComingIntoHostMemory) {
  if (!HaveFuse()) GTEST_SKIP() << "/dev/fuse is not available here";
#ifndef WEIGHTD_EMULATED_CUDA_DIR
  GTEST_SKIP() << "built without the CUDA driver header: no emulated driver";
#else
  ::setenv("LD_LIBRARY_PATH", WEIGHTD_EMULATED_CUDA_DIR, 1);
  // Its 23 MB come through at 4 MB/s: a load of some seconds.
  SlowCheckpoint slow("0", "4M", {.preset = "llama", .size_bytes = 16 << 20});
  ASSERT_TRUE(slow.ready());
  const std::string config = slow.Join("c.toml");
  testing::WriteFileText(config, "[[model]]\npath = \"" + slow.mnt() + "/m\"\n");
  testing::Process daemon({"serve", "--socket-dir", slow.sock(), "--config", config});
  ASSERT_TRUE(daemon.WaitForOutput("ready")) << daemon.err();
  auto engine = testing::RunWeightd({"load", slow.src() + "/m", "--device", "cuda:0", "--json",
                                     "--socket-dir", slow.sock(), "--wait-for-daemon", "600"});
  ASSERT_EQ(engine.exit_code, 0) << engine.err;
  const nlohmann::json j = nlohmann::json::parse(engine.out);
  EXPECT_EQ(j["source"], "daemon") << j.dump() << daemon.err();
  EXPECT_NE(j["reason"].get<std::string>().find("resident in the daemon's host memory, copied to"),
            std::string::npos)
      << j.dump();
  daemon.Signal(SIGTERM);
  EXPECT_EQ(daemon.Wait(), 0) << daemon.err();
#endif
}

// The same model twice in the config (here a byte-identical copy, pinned):
// the second is keyed first (its files are local) and must not hold the
// load the first is waiting for its turn to start. Both end, once loaded.
TEST(Latencyfs, AModelNamedTwiceInTheConfigLoadsOnceWithoutDeadlock) {
  if (!HaveFuse()) GTEST_SKIP() << "/dev/fuse is not available here";
  SlowCheckpoint slow("300ms");  // the first's fingerprint: seconds
  ASSERT_TRUE(slow.ready());
  const std::string mnt = slow.mnt(), sock = slow.sock();
  const std::string copy = slow.Join("copy");
  std::filesystem::copy(slow.src() + "/m", copy);
  const std::string config = slow.Join("c.toml");
  testing::WriteFileText(config, "[[model]]\npath = \"" + mnt + "/m\"\n[[model]]\npath = \"" +
                                     copy + "\"\npin = \"copy\"\n");
  testing::Process daemon({"serve", "--socket-dir", sock, "--config", config});
  ASSERT_TRUE(daemon.WaitForOutput("ready")) << daemon.err();
  // One model, loaded once, named by the second entry.
  EXPECT_TRUE(
      testing::Eventually([&] { return daemon.err().find("pinned") != std::string::npos; }, 60))
      << daemon.err();
  auto r = testing::RunWeightd({"status", "--json", "--socket-dir", sock});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const nlohmann::json status = nlohmann::json::parse(r.out);
  ASSERT_EQ(status["models"].size(), 1u) << status.dump(1);
  EXPECT_EQ(status["models"][0]["name"], "copy");
  daemon.Signal(SIGTERM);
  EXPECT_EQ(daemon.Wait(), 0) << daemon.err();
  EXPECT_EQ(daemon.err().find("still busy"), std::string::npos) << daemon.err();
}

// `status` lists a preload under way; SIGTERM cancels it even when its
// reads are all under way (a model of a few jobs, each megabytes from a
// slow file system): the stop does not wait for the load to end, publishes
// nothing, and tells the preload's asker so.
TEST(Latencyfs, StatusListsAPreloadUnderWayAndSigtermCancelsIt) {
  if (!HaveFuse()) GTEST_SKIP() << "/dev/fuse is not available here";
  // Its 23 MB come through at 1 MB/s, in fewer jobs than reads in flight.
  SlowCheckpoint slow("0", "1M", {.preset = "llama", .size_bytes = 16 << 20});
  ASSERT_TRUE(slow.ready());
  const std::string mnt = slow.mnt(), sock = slow.sock();
  // A grace as long as the load: only the cancel can end the stop early.
  testing::Process daemon({"serve", "--socket-dir", sock, "--stop-timeout", "600"});
  ASSERT_TRUE(daemon.WaitForOutput("ready")) << daemon.err();
  testing::Process preload({"preload", mnt + "/m", "--socket-dir", sock});
  // status lists the load under way: what, for whom, how far.
  nlohmann::json load;
  auto reading = [&] {
    auto r = testing::RunWeightd({"status", "--json", "--socket-dir", sock});
    if (r.exit_code != 0) return false;
    const nlohmann::json loads = nlohmann::json::parse(r.out)["loading"];
    if (loads.size() != 1 || loads[0]["done"].get<uint64_t>() == 0) return false;
    load = loads[0];
    return true;
  };
  ASSERT_TRUE(testing::Eventually(reading)) << daemon.err();
  EXPECT_EQ(load["path"], mnt + "/m") << load.dump();
  EXPECT_EQ(load["asked_by"], "pid " + std::to_string(preload.pid())) << load.dump();
  EXPECT_LT(load["done"].get<uint64_t>(), load["total"].get<uint64_t>()) << load.dump();
  auto text = testing::RunWeightd({"status", "--socket-dir", sock});
  EXPECT_NE(text.out.find("loading " + mnt + "/m (asked by pid "), std::string::npos) << text.out;
  daemon.Signal(SIGTERM);
  EXPECT_EQ(daemon.Wait(), 0) << daemon.err();
  EXPECT_NE(preload.Wait(), 0) << preload.out();
  // Its asker hears why, not a connection closed on it.
  EXPECT_NE(preload.err().find("the daemon is stopping: "), std::string::npos) << preload.err();
  EXPECT_NE(preload.err().find("cancelled"), std::string::npos) << preload.err();
  EXPECT_TRUE(testing::Logged(daemon, "the load was cancelled")) << daemon.err();
  EXPECT_EQ(daemon.err().find("preloaded "), std::string::npos) << daemon.err();
  EXPECT_EQ(daemon.err().find("still busy"), std::string::npos) << daemon.err();
}

// Preloads of a model asked while it loads wait for that load and find the
// model resident: it is loaded once. The model's 11 MiB come through at
// 4 MB/s, so its load takes seconds, while a fingerprint reads a quarter of
// a MiB: the later preloads are asked, and must be keyed, while more than
// half of the first load is still to come.
TEST(Latencyfs, PreloadsAskedWhileTheModelLoadsWaitForThatLoad) {
  if (!HaveFuse()) GTEST_SKIP() << "/dev/fuse is not available here";
  SlowCheckpoint slow("0", "4M", {.preset = "llama", .layers = 2, .hidden = 256});
  ASSERT_TRUE(slow.ready());
  const std::string mnt = slow.mnt(), sock = slow.sock();
  testing::Process daemon({"serve", "--socket-dir", sock});
  ASSERT_TRUE(daemon.WaitForOutput("ready")) << daemon.err();
  auto preload = [&] {
    return std::make_unique<testing::Process>(
        std::vector<std::string>{"preload", mnt + "/m", "--json", "--socket-dir", sock});
  };
  // How far the load under way is, as status says: done and total bytes.
  auto under_way = [&]() -> std::optional<std::pair<uint64_t, uint64_t>> {
    auto r = testing::RunWeightd({"status", "--json", "--socket-dir", sock});
    if (r.exit_code != 0) return std::nullopt;
    const nlohmann::json loads = nlohmann::json::parse(r.out)["loading"];
    if (loads.size() != 1) return std::nullopt;
    return std::pair(loads[0]["done"].get<uint64_t>(), loads[0]["total"].get<uint64_t>());
  };
  std::vector<std::unique_ptr<testing::Process>> preloads;
  preloads.push_back(preload());
  ASSERT_TRUE(testing::Eventually([&] {
    auto load = under_way();
    return load && load->first > 0;
  })) << daemon.err();
  preloads.push_back(preload());
  preloads.push_back(preload());
  auto asked = [&] {
    size_t n = 0;
    const std::string err = daemon.err(), line = "preload of " + mnt + "/m requested";
    for (size_t at = 0; (at = err.find(line, at)) != std::string::npos; at += line.size()) ++n;
    return n;
  };
  ASSERT_TRUE(testing::Eventually([&] { return asked() == 3; })) << daemon.err();
  const auto load = under_way();
  ASSERT_TRUE(load) << "the first load ended before the others were asked: " << daemon.err();
  EXPECT_LT(load->first, load->second / 2) << "too little of the load left to show the overlap";
  int loaded = 0;
  for (auto& p : preloads) {
    ASSERT_EQ(p->Wait(), 0) << p->err();
    if (!nlohmann::json::parse(p->out())["already_resident"].get<bool>()) ++loaded;
  }
  EXPECT_EQ(loaded, 1) << daemon.err();
  daemon.Signal(SIGTERM);
  EXPECT_EQ(daemon.Wait(), 0) << daemon.err();
}

// A preload stuck in a file system call (a hung network mount, here every
// operation delayed 2 s) must not keep a stopping daemon, and its lock,
// alive: SIGTERM gives busy connections --stop-timeout, then exits.
TEST(Latencyfs, SigtermDoesNotWaitForAPreloadStuckOnTheFileSystem) {
  if (!HaveFuse()) GTEST_SKIP() << "/dev/fuse is not available here";
  SlowCheckpoint slow("2s");
  ASSERT_TRUE(slow.ready());
  const std::string mnt = slow.mnt(), sock = slow.sock();

  testing::Process daemon({"serve", "--socket-dir", sock, "--stop-timeout", "0.2"});
  ASSERT_TRUE(daemon.WaitForOutput("ready")) << daemon.err();
  testing::Process preload({"preload", mnt + "/m", "--socket-dir", sock});
  ASSERT_TRUE(testing::Eventually([&] {
    return daemon.err().find("preload of " + mnt + "/m requested") != std::string::npos;
  })) << daemon.err();
  daemon.Signal(SIGTERM);
  ASSERT_TRUE(testing::Eventually([&] {
    return daemon.err().find("still busy") != std::string::npos;
  })) << daemon.err();
  // The directory is free for the next daemon at once, while the stuck
  // thread may still hold the old process.
  testing::Process next({"serve", "--socket-dir", sock});
  EXPECT_TRUE(next.WaitForOutput("ready")) << next.err();
  // Not a clean stop: a supervisor is told work was left behind.
  EXPECT_EQ(daemon.Wait(), 4) << daemon.err();
  // Its engine is told, not left waiting, and told why.
  EXPECT_NE(preload.Wait(), 0) << preload.err();
  EXPECT_TRUE(testing::Logged(preload, "the daemon closed the connection before it answered"))
      << preload.err();
  next.Signal(SIGTERM);
  EXPECT_EQ(next.Wait(), 0) << next.err();
}

// The same for a preload the config file asked for: the stop's one
// --stop-timeout covers it with the connections, not a second wait after.
TEST(Latencyfs, SigtermCountsAConfigPreloadStuckOnTheFileSystemWithTheConnections) {
  if (!HaveFuse()) GTEST_SKIP() << "/dev/fuse is not available here";
  SlowCheckpoint slow("2s");
  ASSERT_TRUE(slow.ready());
  const std::string config = slow.sock() + ".toml";
  testing::WriteFileText(config, "[[model]]\npath = \"" + slow.mnt() + "/m\"\n");

  testing::Process daemon(
      {"serve", "--socket-dir", slow.sock(), "--config", config, "--stop-timeout", "0.2"});
  ASSERT_TRUE(daemon.WaitForOutput("ready")) << daemon.err();
  ASSERT_TRUE(testing::Eventually([&] {
    return daemon.err().find("preload of " + slow.mnt() + "/m requested by the config") !=
           std::string::npos;
  })) << daemon.err();
  daemon.Signal(SIGTERM);
  ASSERT_TRUE(testing::Eventually([&] {
    return daemon.err().find("0 request(s), 1 preload(s) from the config and ") !=
           std::string::npos;
  })) << daemon.err();
  testing::Process next({"serve", "--socket-dir", slow.sock()});
  EXPECT_TRUE(next.WaitForOutput("ready")) << next.err();
  EXPECT_EQ(daemon.Wait(), 4) << daemon.err();
  next.Signal(SIGTERM);
  EXPECT_EQ(next.Wait(), 0) << next.err();
}

}  // namespace
}  // namespace weightd
