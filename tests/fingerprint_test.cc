#include "fingerprint/fingerprint.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <openssl/sha.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <optional>
#include <sstream>
#include <thread>
#include <tuple>

#include "format/checkpoint.h"
#include "format/safetensors.h"
#include "format/synthetic.h"
#include "io/file.h"
#include "test_util.h"

namespace weightd::fingerprint {
namespace {

using testing::TempDir;
namespace fs = std::filesystem;

std::string Make(const TempDir& dir, const std::string& name, format::SyntheticOptions o) {
  const std::string path = dir.Join(name);
  auto plan = format::WriteSyntheticCheckpoint(path, o);
  EXPECT_TRUE(plan.ok()) << (plan.ok() ? "" : plan.error().message());
  return path;
}

Fingerprint Fp(const std::string& path, Options o = {}) {
  auto fp = FingerprintCheckpoint(io::PosixFileSystem(), path, o);
  EXPECT_TRUE(fp.ok()) << (fp.ok() ? "" : fp.error().message());
  return fp.ok() ? std::move(fp).value() : Fingerprint{};
}

std::string Digest(const std::string& path, Options o = {}) { return Fp(path, o).digest; }

void FlipByte(const std::string& path, uint64_t offset) {
  int fd = ::open(path.c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  unsigned char b;
  ASSERT_EQ(::pread(fd, &b, 1, static_cast<off_t>(offset)), 1);
  b ^= 0x5a;
  ASSERT_EQ(::pwrite(fd, &b, 1, static_cast<off_t>(offset)), 1);
  ::close(fd);
}

TEST(Sampled, DigestIsTaggedXxh3) {
  TempDir dir;
  const std::string d = Digest(Make(dir, "m", {.preset = "tiny"}));
  EXPECT_EQ(d.rfind("xxh3-128:", 0), 0u);
  EXPECT_EQ(d.size(), 9u + 32);
}

TEST(Sampled, ByteIdenticalCopyInAnotherDirHasTheSameDigest) {
  TempDir dir;
  const std::string a = Make(dir, "a", {.preset = "llama", .size_bytes = 4 << 20});
  fs::copy(a, dir.Join("elsewhere"), fs::copy_options::recursive);
  EXPECT_EQ(Digest(a), Digest(dir.Join("elsewhere")));
}

TEST(Sampled, AChangeInAnyTensorsFirstKiBChangesTheDigest) {
  TempDir dir;
  const std::string m = Make(dir, "m", {.preset = "llama", .size_bytes = 4 << 20});
  auto ckpt = format::OpenCheckpoint(io::PosixFileSystem(), m);
  ASSERT_TRUE(ckpt.ok());
  std::string previous = Digest(m);
  int i = 0;
  for (const auto& shard : ckpt->shards) {
    for (const auto& t : shard.header.tensors) {
      const uint64_t within = static_cast<uint64_t>(i++ * 37) % std::min<uint64_t>(1024, t.bytes());
      FlipByte(shard.path, shard.header.data_offset() + t.begin + within);
      const std::string now = Digest(m);
      EXPECT_NE(now, previous) << t.name << " byte " << within;
      previous = now;
    }
  }
}

TEST(Sampled, BytesPastTheFirstKiBAreNotSampled) {
  TempDir dir;
  const std::string m = Make(dir, "m", {.preset = "llama", .size_bytes = 4 << 20});
  auto ckpt = format::OpenCheckpoint(io::PosixFileSystem(), m);
  ASSERT_TRUE(ckpt.ok());
  const std::string before = Digest(m);
  const auto& shard = ckpt->shards[0];
  const auto& t = shard.header.tensors[0];
  ASSERT_GT(t.bytes(), 2048u);
  FlipByte(shard.path, shard.header.data_offset() + t.begin + 2000);
  EXPECT_EQ(Digest(m), before);  // what `full` is for
}

TEST(Sampled, FinetuneOfTheSameLayoutDiffers) {
  TempDir dir;
  EXPECT_NE(
      Digest(Make(dir, "base", {.preset = "llama", .size_bytes = 4 << 20})),
      Digest(Make(dir, "tuned", {.preset = "llama", .finetune = true, .size_bytes = 4 << 20})));
}

TEST(Sampled, RenamingOrSwappingShardsChangesTheDigest) {
  TempDir dir;
  const std::string m = Make(dir, "m", {.preset = "many-tensors", .tensors = 40, .shards = 2});
  fs::remove(dir.Join("m/model.safetensors.index.json"));  // let the names alone decide
  const std::string original = Digest(m);
  fs::rename(dir.Join("m/model-00002-of-00002.safetensors"),
             dir.Join("m/model-00003-of-00002.safetensors"));
  const std::string renamed = Digest(m);
  EXPECT_NE(renamed, original);
  // Same names, contents swapped.
  fs::rename(dir.Join("m/model-00003-of-00002.safetensors"), dir.Join("m/tmp"));
  fs::rename(dir.Join("m/model-00001-of-00002.safetensors"),
             dir.Join("m/model-00002-of-00002.safetensors"));
  fs::rename(dir.Join("m/tmp"), dir.Join("m/model-00001-of-00002.safetensors"));
  EXPECT_NE(Digest(m), original);
  EXPECT_NE(Digest(m), renamed);
}

TEST(Sampled, ShardsTheIndexDoesNotNameAreLeftOut) {
  TempDir dir;
  const std::string m = Make(dir, "m", {.preset = "llama", .size_bytes = 4 << 20});
  const std::string before = Digest(m);
  fs::copy(dir.Join("m/model-00001-of-00004.safetensors"), dir.Join("m/stale.safetensors"));
  EXPECT_EQ(Digest(m), before);
}

TEST(Sampled, DigestDoesNotDependOnScheduling) {
  TempDir dir;
  // Small tensors (coalescible samples) and large ones (separate reads).
  for (const std::string& m :
       {Make(dir, "many", {.preset = "many-tensors", .tensors = 3000, .shards = 3}),
        Make(dir, "llama", {.preset = "llama", .size_bytes = 8 << 20})}) {
    const Fingerprint reference = Fp(m, {.max_inflight = 1, .coalesce = false});
    for (int inflight : {1, 8, 512}) {
      for (bool coalesce : {false, true}) {
        for (uint64_t speculative : {uint64_t{8}, uint64_t{4096}, uint64_t{1} << 20}) {
          Fingerprint fp = Fp(
              m,
              {.max_inflight = inflight, .coalesce = coalesce, .speculative_bytes = speculative});
          EXPECT_EQ(fp.digest, reference.digest) << m << " inflight " << inflight << " coalesce "
                                                 << coalesce << " speculative " << speculative;
          EXPECT_EQ(fp.tensors, reference.tensors);
        }
      }
    }
  }
}

// A checkpoint's shard files, in name order.
std::vector<std::string> ShardFiles(const std::string& dir) {
  std::vector<std::string> shards;
  for (const auto& e : fs::directory_iterator(dir)) {
    if (e.path().extension() == ".safetensors") shards.push_back(e.path().filename());
  }
  std::sort(shards.begin(), shards.end());
  return shards;
}

// Where a shard's header ends, and its samples begin.
uint64_t HeaderEnd(const std::string& shard) {
  const std::vector<std::byte> bytes = testing::ReadFileBytes(shard);
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), sizeof n);  // little-endian, as here
  return format::kHeaderLengthBytes + n;
}

// A file system whose directory stat is slow enough for the listing to take
// it as remote. Each read takes `read_delay`, and counts while it is out.
// With `hold_first`, that shard's first read is held until a read of
// `release_by` at `release_from` or past goes out (or 10 s pass).
class SlowLookingFileSystem final : public testing::PassThroughFileSystem {
 public:
  struct Hold {
    std::string hold_first, release_by;
    uint64_t release_from = 0;
  };
  explicit SlowLookingFileSystem(std::chrono::microseconds read_delay) : read_delay_(read_delay) {}
  SlowLookingFileSystem(std::chrono::microseconds read_delay, Hold hold)
      : read_delay_(read_delay), hold_(std::move(hold)) {}

  using PassThroughFileSystem::Open;
  Result<std::unique_ptr<io::RandomAccessFile>> Open(const std::string& path,
                                                     io::Symlinks symlinks) override {
    WEIGHTD_ASSIGN_OR_RETURN(auto file, base_.Open(path, symlinks));
    return std::unique_ptr<io::RandomAccessFile>(new File(std::move(file), this));
  }
  Result<bool> IsDirectory(const std::string& p) override {
    ::usleep(5000);  // a round trip
    return base_.IsDirectory(p);
  }

  // Whether the held read was let go by the read it waited for, not by the
  // clock.
  bool released_by_read() {
    std::lock_guard lock(mu_);
    return released_by_read_;
  }
  int most_reads_out() {
    std::lock_guard lock(mu_);
    return most_out_;
  }
  int reads_of(const std::string& name) {
    std::lock_guard lock(mu_);
    return reads_of_[name];
  }

 private:
  class File final : public testing::PassThroughFile {
   public:
    File(std::unique_ptr<io::RandomAccessFile> f, SlowLookingFileSystem* fs)
        : PassThroughFile(std::move(f)), fs_(fs) {}
    Status ReadExactly(uint64_t offset, std::span<std::byte> dst) const override {
      const std::string name = io::BaseName(path());
      {
        std::unique_lock lock(fs_->mu_);
        fs_->most_out_ = std::max(fs_->most_out_, ++fs_->out_);
        ++fs_->reads_of_[name];
        const Hold& hold = fs_->hold_;
        if (name == hold.hold_first && offset == 0) {
          fs_->released_by_read_ =
              fs_->cv_.wait_for(lock, std::chrono::seconds(10), [&] { return fs_->released_; });
        } else if (name == hold.release_by && offset >= hold.release_from) {
          fs_->released_ = true;
          fs_->cv_.notify_all();
        }
      }
      std::this_thread::sleep_for(fs_->read_delay_);
      Status s = PassThroughFile::ReadExactly(offset, dst);
      std::lock_guard lock(fs_->mu_);
      --fs_->out_;
      return s;
    }

   private:
    SlowLookingFileSystem* fs_;
  };

  const std::chrono::microseconds read_delay_;
  const Hold hold_{};
  std::mutex mu_;
  std::condition_variable cv_;
  bool released_ = false;
  bool released_by_read_ = false;
  int out_ = 0, most_out_ = 0;
  std::map<std::string, int> reads_of_;
};

// Where each read costs a round trip, a shard's samples are read as soon as
// its own header is in: they do not wait for the slowest shard's first read
// (here, one held until they have gone out). Shards that are files of the
// directory are opened from its listing, while the index is read; shards
// that are symlinks (as in Hugging Face's cache) after it.
TEST(Sampled, OnASlowFileSystemEachShardsSamplesFollowItsOwnHeader) {
  TempDir dir;
  const std::string m = Make(dir, "many", {.preset = "many-tensors", .tensors = 600, .shards = 2});
  const std::vector<std::string> shards = ShardFiles(m);
  ASSERT_EQ(shards.size(), 2u);
  const uint64_t second_header_end = HeaderEnd(m + "/" + shards[1]);
  // A first read of the length alone: every sample is past it.
  const Options o{.speculative_bytes = 8};
  const std::string reference = Digest(m, o);

  // The hub's cache: a snapshot's files are symlinks into the model's blobs.
  const std::string hub = dir.Join("models--org--many"), linked = hub + "/snapshots/rev",
                    blobs = hub + "/blobs";
  fs::create_directories(linked);
  fs::create_directories(blobs);
  fs::copy_file(m + "/model.safetensors.index.json", linked + "/model.safetensors.index.json");
  for (size_t i = 0; i < shards.size(); ++i) {
    fs::copy_file(m + "/" + shards[i], blobs + "/blob" + std::to_string(i));
    fs::create_symlink("../../blobs/blob" + std::to_string(i), linked + "/" + shards[i]);
  }
  using Layout = std::tuple<std::string, std::string, std::string>;  // dir, first, second
  for (const auto& [path, first, later] :
       {Layout(m, shards[0], shards[1]), Layout(linked, "blob0", "blob1")}) {
    SlowLookingFileSystem held(std::chrono::microseconds(0), {first, later, second_header_end});
    auto fp = FingerprintCheckpoint(held, path, o);
    ASSERT_TRUE(fp.ok()) << fp.error().message();
    EXPECT_TRUE(held.released_by_read()) << path;
    EXPECT_EQ(fp->digest, reference) << path;
  }
}

// On a slow mount the directory's shard files are opened before the index
// is in; one the index does not name (a consolidated copy beside the
// shards, as some model repositories ship) costs its first reads, not its
// samples.
TEST(Sampled, OnASlowFileSystemAFileTheIndexLeavesOutCostsOnlyItsHead) {
  TempDir dir;
  const std::string m = Make(dir, "many", {.preset = "many-tensors", .tensors = 600, .shards = 2});
  // A first read of the length alone: the header is a second read.
  const Options o{.coalesce = false, .speculative_bytes = 8};
  const std::string reference = Digest(m, o);
  fs::copy_file(m + "/model-00001-of-00002.safetensors", m + "/consolidated.safetensors");
  SlowLookingFileSystem slow(std::chrono::microseconds(0));
  auto fp = FingerprintCheckpoint(slow, m, o);
  ASSERT_TRUE(fp.ok()) << fp.error().message();
  EXPECT_EQ(fp->digest, reference);
  EXPECT_EQ(slow.reads_of("consolidated.safetensors"), 2);
  EXPECT_GT(slow.reads_of("model-00001-of-00002.safetensors"), 100);
}

// A header longer than the first read waits for its share of the parsing
// budget before it takes memory for the rest and reads it: hundreds of
// shards of crafted headers cannot each hold one at once. With the whole
// budget held here, nothing past each shard's first read goes out.
TEST(Sampled, AHeaderWaitsForItsParseTurnBeforeReadingPastTheFirstRead) {
  TempDir dir;
  const std::string m = Make(dir, "many", {.preset = "many-tensors", .tensors = 60, .shards = 2});
  const Options o{.speculative_bytes = 8};
  const std::string reference = Digest(m, o);
  SlowLookingFileSystem slow(std::chrono::microseconds(0));
  std::optional<format::ParseTurn> all(std::in_place, format::kParseBudgetBytes);
  Result<Fingerprint> fp = Error("not run");
  std::thread fingerprint([&] { fp = FingerprintCheckpoint(slow, m, o); });
  const std::string first = "model-00001-of-00002.safetensors";
  const std::string second = "model-00002-of-00002.safetensors";
  EXPECT_TRUE(testing::Eventually(
      [&] { return slow.reads_of(first) >= 1 && slow.reads_of(second) >= 1; }, 10));
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_EQ(slow.reads_of(first), 1);
  EXPECT_EQ(slow.reads_of(second), 1);
  all.reset();
  fingerprint.join();
  ASSERT_TRUE(fp.ok()) << fp.error().message();
  EXPECT_EQ(fp->digest, reference);
  EXPECT_GT(slow.reads_of(first), 1);
}

// The most memory this process has held since ResetPeakMemory, in bytes.
uint64_t PeakMemory() {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("VmHWM:", 0) == 0) return std::stoull(line.substr(6)) * 1024;
  }
  return 0;
}
bool ResetPeakMemory() { return std::ofstream("/proc/self/clear_refs") << "5" && true; }

// A shard of 4096 U8 tensors of 256 KiB each, 1 GiB of holes on disk, its
// tensors named in the reverse of their order in the file: every sample
// waits for the last read. The reads merge samples across the gaps (most of
// every byte read); the memory held must be the samples', not the reads'.
TEST(Sampled, ACraftedShardCannotMakeTheSampleReadsHoldItsSize) {
  TempDir dir;
  const std::string m = dir.Join("crafted");
  ASSERT_EQ(::mkdir(m.c_str(), 0755), 0);
  constexpr uint64_t kTensors = 4096, kBytes = 256 << 10;
  std::string json = "{";
  for (uint64_t i = 0; i < kTensors; ++i) {
    const uint64_t at = (kTensors - 1 - i) * kBytes;
    char name[16];
    std::snprintf(name, sizeof name, "t%04llu", static_cast<unsigned long long>(i));
    json += std::string(i ? "," : "") + "\"" + name + "\":{\"dtype\":\"U8\",\"shape\":[" +
            std::to_string(kBytes) + "],\"data_offsets\":[" + std::to_string(at) + "," +
            std::to_string(at + kBytes) + "]}";
  }
  json += "}";
  std::string file(8, '\0');
  for (int i = 0; i < 8; ++i)
    file[static_cast<size_t>(i)] = static_cast<char>(json.size() >> (8 * i));
  file += json;
  const std::string shard = m + "/model.safetensors";
  testing::WriteFileText(shard, file);
  ASSERT_EQ(::truncate(shard.c_str(), static_cast<off_t>(file.size() + kTensors * kBytes)), 0);

  const std::string reference = Digest(m, {.coalesce = false});
  for (const bool remote : {false, true}) {
    SlowLookingFileSystem slow(std::chrono::microseconds(0));
    io::FileSystem& fs = remote ? static_cast<io::FileSystem&>(slow) : io::PosixFileSystem();
    if (!ResetPeakMemory()) GTEST_SKIP() << "no /proc/self/clear_refs";
    const uint64_t before = PeakMemory();
    auto fp = FingerprintCheckpoint(fs, m, {});
    const uint64_t grown = PeakMemory() - before;
    ASSERT_TRUE(fp.ok()) << fp.error().message();
    EXPECT_EQ(fp->digest, reference) << (remote ? "remote" : "local");
    EXPECT_GT(fp->bytes_read, kTensors * kBytes / 2) << "the reads did not merge across gaps";
    // The samples are 4 MiB; a remote window 64 MiB, early reads as much.
    EXPECT_LT(grown, uint64_t{256} << 20) << (remote ? "remote" : "local");
  }
}

// Shards reading their samples as their heads come in still keep to
// max_inflight reads out at once, first reads included. Where a shard's
// reads fit beside those out, they go out at once (the first shard's head
// is held until the second's samples do); where they would go past the
// limit, they wait for stage 2.
TEST(Sampled, OnASlowFileSystemNoMoreThanMaxInflightReadsAreOut) {
  TempDir dir;
  // A read per sample, none in the first read: 8 sample reads a shard in
  // `small` (all six shards' fit in 64 beside their heads), 200 in `big`
  // (none fit).
  const std::string small =
      Make(dir, "small", {.preset = "many-tensors", .tensors = 48, .shards = 6});
  const std::string big = Make(dir, "big", {.preset = "many-tensors", .tensors = 600, .shards = 3});
  for (const auto& [m, inflight] : {std::pair(small, 64), std::pair(big, 64), std::pair(big, 4)}) {
    const Options o{.max_inflight = inflight, .coalesce = false, .speculative_bytes = 8};
    const std::vector<std::string> shards = ShardFiles(m);
    SlowLookingFileSystem::Hold hold;
    if (m == small) hold = {shards[0], shards[1], HeaderEnd(m + "/" + shards[1])};
    SlowLookingFileSystem slow(std::chrono::milliseconds(10), hold);
    auto fp = FingerprintCheckpoint(slow, m, o);
    ASSERT_TRUE(fp.ok()) << fp.error().message();
    EXPECT_EQ(fp->digest, Digest(m, o)) << m << " " << inflight;
    EXPECT_LE(slow.most_reads_out(), inflight) << m;
    if (m == small) {
      EXPECT_TRUE(slow.released_by_read()) << "a shard's samples waited for another's head";
    } else {
      EXPECT_GE(slow.most_reads_out(), inflight / 2) << "the reads went out one by one";
    }
  }
}

TEST(Sampled, CoalescingMergesNeighbouringSamples) {
  TempDir dir;
  const std::string m = Make(dir, "many", {.preset = "many-tensors", .tensors = 3000, .shards = 3});
  const Options tiny_first_read{.speculative_bytes = 8};
  Options apart = tiny_first_read, merged = tiny_first_read;
  apart.coalesce = false;
  const Fingerprint a = Fp(m, apart), b = Fp(m, merged);
  // Without merging: the index, then per shard a first read, a header read,
  // and one read per tensor.
  EXPECT_EQ(a.reads, 1u + 3 * 2 + 3000);
  EXPECT_LT(b.reads, a.reads / 10);
}

// The samples are read in file order, a window at a time into a buffer that
// is used again, and hashed in name order: in a file whose tensors are laid
// out widest dtype first, the two orders differ. A first read that holds
// the file's first tensors (all of the widest dtype) has t000's sample
// hashed where it lies, and t003's copied to wait for t001's and t002's.
TEST(Sampled, SamplesOutOfFileOrderAreHashedInNameOrder) {
  TempDir dir;
  std::vector<format::TensorData> tensors;
  uint32_t state = 12345;
  auto next = [&state] { return state = state * 1103515245u + 12345u; };
  for (int i = 0; i < 400; ++i) {
    char name[8];
    std::snprintf(name, sizeof name, "t%03d", i);
    const format::DType dtype = i % 3 == 0   ? format::DType::kF32
                                : i % 3 == 1 ? format::DType::kBF16
                                             : format::DType::kU8;
    const uint64_t elements = i == 7 ? 0 : 50 + next() % 700;
    format::TensorData t{{name, dtype, {elements}}, {}};
    t.bytes.resize(elements * format::DTypeBits(dtype) / 8);
    for (std::byte& b : t.bytes) b = static_cast<std::byte>(next() >> 16);
    tensors.push_back(std::move(t));
  }
  const std::string path = dir.Join("mixed.safetensors");
  ASSERT_TRUE(format::WriteSafetensors(path, tensors).ok());

  // The digest from the whole file's bytes, samples in name order.
  const std::vector<std::byte> bytes = testing::ReadFileBytes(path);
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), sizeof n);  // little-endian, as on this machine
  auto header = format::ParseHeader("mixed", std::span(bytes).subspan(8, n), bytes.size());
  ASSERT_TRUE(header.ok()) << header.error().message();
  ASSERT_EQ(header->tensors[0].begin, 0u);
  ASSERT_GT(header->tensors[1].begin, header->tensors[3].begin);
  std::vector<std::span<const std::byte>> samples;
  for (const format::TensorInfo& t : header->tensors) {
    samples.push_back(std::span(bytes).subspan(header->data_offset() + t.begin,
                                               std::min<uint64_t>(1024, t.bytes())));
  }
  const std::string expected =
      SampledShardDigest(bytes.size(), std::span(bytes).first(8 + n), samples);

  // A first read of the length alone, of part of the header, and of the
  // header and half the data.
  const uint64_t half = header->data_offset() + header->data_bytes / 2;
  // Whether this file system counts as local is measured (ShardListing::
  // remote): both windows are set.
  for (uint64_t window : {uint64_t{1}, uint64_t{4096}, Options{}.local_window_bytes}) {
    for (bool coalesce : {false, true}) {
      for (uint64_t speculative : {uint64_t{8}, uint64_t{4096}, half}) {
        const Fingerprint fp = Fp(path, {.coalesce = coalesce,
                                         .speculative_bytes = speculative,
                                         .local_window_bytes = window,
                                         .remote_window_bytes = window});
        ASSERT_EQ(fp.shards.size(), 1u);
        EXPECT_EQ(fp.shards[0].digest, expected)
            << "window " << window << " coalesce " << coalesce << " speculative " << speculative;
      }
    }
  }
}

// The key of a known file, pinned. Daemons and engines of different
// versions compare keys, and stat caches keep digests across upgrades (as
// `sampled-1024` and `full`): a change of these values is a change of what
// the key means (docs/fingerprint.md), which needs new cache kinds, not new
// values here. Every read schedule gives the same ones.
TEST(Sampled, TheKeyOfAKnownFileIsPinned) {
  const std::string file = testing::ConformanceDir() + "/safetensors-samples/overall.safetensors";
  for (const Options& o : {Options{}, Options{.max_inflight = 1,
                                      .coalesce = false,
                                      .speculative_bytes = 8,
                                      .local_window_bytes = 1,
                                      .remote_window_bytes = 1}}) {
    const Fingerprint fp = Fp(file, o);
    ASSERT_EQ(fp.shards.size(), 1u);
    EXPECT_EQ(fp.shards[0].digest, "xxh3-128:fbeb75c1065c0755fd252005dac4d3df");
    EXPECT_EQ(fp.digest, "xxh3-128:ea9d233a1701f28a0172c9d5eb8cf297");
  }
  // The shard's is `sha256sum` of the file.
  const Fingerprint full = Fp(file, {.mode = Mode::kFull});
  ASSERT_EQ(full.shards.size(), 1u);
  EXPECT_EQ(full.shards[0].digest,
            "sha256:cca72ad6c59a46eaf1a240bc171b9d24e9af5e19bab12989321eb4c12f5a403b");
  EXPECT_EQ(full.digest, "sha256:00b8ed8eb06fa6726bcb91163cbe2a5ac934d79f71e6c7e2f91a384d7dad5464");
}

TEST(Sampled, WithoutShardsThereIsNoFingerprint) {
  TempDir dir;
  auto fp = FingerprintCheckpoint(io::PosixFileSystem(), dir.path(), {});
  ASSERT_FALSE(fp.ok());
  EXPECT_EQ(fp.error().message().rfind("cannot fingerprint " + dir.path(), 0), 0u)
      << fp.error().message();
}

TEST(Full, EachShardIsTheSha256OfItsBytes) {
  TempDir dir;
  const std::string m = Make(dir, "m", {.preset = "llama", .size_bytes = 6 << 20});
  Fingerprint fp = Fp(m, {.mode = Mode::kFull});
  ASSERT_EQ(fp.shards.size(), 4u);
  for (const auto& s : fp.shards) {
    auto bytes = testing::ReadFileBytes(dir.Join("m/" + s.name));
    unsigned char out[SHA256_DIGEST_LENGTH];
    SHA256(reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size(), out);
    char hex[2 * SHA256_DIGEST_LENGTH + 1];
    for (int i = 0; i < SHA256_DIGEST_LENGTH; ++i) std::snprintf(hex + 2 * i, 3, "%02x", out[i]);
    EXPECT_EQ(s.digest, std::string("sha256:") + hex) << s.name;
  }
  EXPECT_EQ(fp.digest.rfind("sha256:", 0), 0u);
  // The index, every byte of every shard, and each shard's header once more
  // (checked as in sampled mode).
  uint64_t expected = fs::file_size(dir.Join("m/model.safetensors.index.json"));
  for (int i = 1; i <= 4; ++i) {
    const auto bytes = testing::ReadFileBytes(
        dir.Join("m/model-0000" + std::to_string(i) + "-of-00004.safetensors"));
    uint64_t header = 0;
    std::memcpy(&header, bytes.data(), sizeof header);  // little-endian, as on this machine
    expected += bytes.size() + 8 + header;
  }
  EXPECT_EQ(fp.bytes_read, expected);
}

// A daemon that stops does not hash gigabytes first.
TEST(Full, ACancelStopsItWithAnError) {
  TempDir dir;
  const std::string m = Make(dir, "m", {.preset = "llama", .size_bytes = 6 << 20});
  const std::atomic<bool> cancelled{true};
  auto fp =
      FingerprintCheckpoint(io::PosixFileSystem(), m, {.mode = Mode::kFull, .cancel = &cancelled});
  ASSERT_FALSE(fp.ok());
  EXPECT_NE(fp.error().message().find("cancelled"), std::string::npos) << fp.error().message();
}

TEST(Full, ABrokenShardIsAnErrorAsInSampledMode) {
  TempDir dir;
  const std::string m = Make(dir, "m", {.preset = "tiny"});
  fs::resize_file(dir.Join("m/model.safetensors"), 1000);
  for (Mode mode : {Mode::kSampled, Mode::kFull}) {
    auto fp = FingerprintCheckpoint(io::PosixFileSystem(), m, {.mode = mode});
    ASSERT_FALSE(fp.ok()) << ModeName(mode);
    EXPECT_NE(fp.error().message().find("data region must end at end of file"), std::string::npos)
        << fp.error().message();
  }
}

// A file system that counts each shard's opens, and holds every read of a
// shard other than `broken` until the broken shard's file has been closed
// (10 s at most): by then its error is known.
class BrokenShardFileSystem final : public testing::PassThroughFileSystem {
 public:
  explicit BrokenShardFileSystem(std::string broken) : broken_(std::move(broken)) {}

  using PassThroughFileSystem::Open;
  Result<std::unique_ptr<io::RandomAccessFile>> Open(const std::string& path,
                                                     io::Symlinks symlinks) override {
    WEIGHTD_ASSIGN_OR_RETURN(auto file, base_.Open(path, symlinks));
    std::lock_guard lock(mu_);
    ++opens_[io::BaseName(path)];
    return std::unique_ptr<io::RandomAccessFile>(new File(std::move(file), this));
  }
  int opens_of(const std::string& name) {
    std::lock_guard lock(mu_);
    return opens_[name];
  }

 private:
  class File final : public testing::PassThroughFile {
   public:
    File(std::unique_ptr<io::RandomAccessFile> f, BrokenShardFileSystem* fs)
        : PassThroughFile(std::move(f)), fs_(fs) {}
    ~File() override {
      if (io::BaseName(path()) != fs_->broken_) return;
      std::lock_guard lock(fs_->mu_);
      fs_->broken_closed_ = true;
      fs_->cv_.notify_all();
    }
    Status ReadExactly(uint64_t offset, std::span<std::byte> dst) const override {
      const std::string name = io::BaseName(path());
      if (name != fs_->broken_ && name.ends_with(".safetensors")) {
        std::unique_lock lock(fs_->mu_);
        fs_->cv_.wait_for(lock, std::chrono::seconds(10), [&] { return fs_->broken_closed_; });
      }
      return PassThroughFile::ReadExactly(offset, dst);
    }

   private:
    BrokenShardFileSystem* fs_;
  };

  const std::string broken_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool broken_closed_ = false;
  std::map<std::string, int> opens_;
};

// One broken shard is the answer: the shards not yet begun when it failed
// are never opened, in either mode.
TEST(Full, ABrokenShardStopsTheShardsNotYetBegun) {
  TempDir dir;
  const std::string m =
      Make(dir, "m", {.preset = "llama", .size_bytes = 16 << 20, .layers = 8, .shards = 8});
  const std::vector<std::string> shards = ShardFiles(m);
  ASSERT_EQ(shards.size(), 8u);
  fs::resize_file(m + "/" + shards[0], 1000);
  // Full mode hashes up to 4 shards at once; sampled mode, with one read in
  // flight, one.
  for (const auto& [mode, begun] : {std::pair(Mode::kFull, 4), std::pair(Mode::kSampled, 1)}) {
    BrokenShardFileSystem files(shards[0]);
    auto fp = FingerprintCheckpoint(files, m, {.mode = mode, .max_inflight = 1});
    ASSERT_FALSE(fp.ok()) << ModeName(mode);
    EXPECT_NE(fp.error().message().find(shards[0]), std::string::npos) << fp.error().message();
    for (size_t i = static_cast<size_t>(begun); i < shards.size(); ++i) {
      EXPECT_EQ(files.opens_of(shards[i]), 0) << ModeName(mode) << " " << shards[i];
    }
  }
}

// --- The stat shortcut ---------------------------------------------------

// Files written by a test are seconds old at most: these tests turn the
// racily-clean window off (the window has a test of its own).
struct Cached {
  TempDir cache_dir;
  Fingerprint Fp(const std::string& path, Mode mode = Mode::kSampled, bool lookups = true) {
    auto cache = StatCache::Load(cache_dir.path());
    auto fp = fingerprint::Fp(
        path, {.mode = mode, .cache = cache.get(), .cache_lookups = lookups, .racy_seconds = 0});
    EXPECT_TRUE(cache->Save().ok());
    return fp;
  }
};

TEST(StatCache, AnUnchangedShardCostsNoRead) {
  TempDir dir;
  Cached c;
  const std::string m = Make(dir, "m", {.preset = "llama", .size_bytes = 4 << 20});
  for (Mode mode : {Mode::kSampled, Mode::kFull}) {
    const Fingerprint cold = c.Fp(m, mode);
    const Fingerprint warm = c.Fp(m, mode);
    EXPECT_EQ(cold.cache_hits, 0u);
    EXPECT_GT(cold.reads, 0u);
    EXPECT_EQ(warm.cache_hits, 4u);
    EXPECT_EQ(warm.reads, 0u);  // the index's shard list is remembered too
    EXPECT_EQ(warm.digest, cold.digest);
    // Each shard says the signature its digest was made or found under:
    // the file's, either way.
    ASSERT_EQ(warm.shards.size(), cold.shards.size());
    for (size_t i = 0; i < cold.shards.size(); ++i) {
      auto now = io::PosixFileSystem().Stat(m + "/" + cold.shards[i].name);
      ASSERT_TRUE(now.ok());
      EXPECT_EQ(cold.shards[i].signature, *now) << cold.shards[i].name;
      EXPECT_EQ(warm.shards[i].signature, *now) << warm.shards[i].name;
    }
  }
}

// A caller that must not take a digest on a signature's word asks nothing
// of the cache, and tells it what it computed.
TEST(StatCache, WithoutLookupsItIsOnlyTold) {
  TempDir dir;
  Cached c;
  const std::string m = Make(dir, "m", {.preset = "llama", .size_bytes = 4 << 20});
  for (Mode mode : {Mode::kSampled, Mode::kFull}) {
    const Fingerprint warm_up = c.Fp(m, mode);
    const Fingerprint told = c.Fp(m, mode, /*lookups=*/false);
    EXPECT_EQ(told.cache_hits, 0u);
    EXPECT_GT(told.reads, 0u);
    EXPECT_EQ(told.digest, warm_up.digest);
    EXPECT_EQ(c.Fp(m, mode).cache_hits, 4u);
  }
}

TEST(StatCache, FilesChangedWithinTheRacyWindowAreNotCached) {
  TempDir dir, cache_dir;
  const std::string m = Make(dir, "m", {.preset = "llama", .size_bytes = 4 << 20});
  for (int run = 0; run < 2; ++run) {
    auto cache = StatCache::Load(cache_dir.path());
    const Fingerprint fp = Fp(m, {.cache = cache.get(), .racy_seconds = 3600});
    EXPECT_EQ(fp.cache_hits, 0u) << "run " << run;
    EXPECT_GT(fp.reads, 1u) << "run " << run;  // the index is read again too
    ASSERT_TRUE(cache->Save().ok());
  }
}

TEST(StatCache, DigestsOfDifferentSampleSizesAreKeptApart) {
  TempDir dir;
  Cached c;
  const std::string m = Make(dir, "m", {.preset = "tiny"});
  auto cache = StatCache::Load(c.cache_dir.path());
  const Fingerprint kib = Fp(m, {.cache = cache.get(), .racy_seconds = 0});
  const Fingerprint small = Fp(m, {.sample_bytes = 4, .cache = cache.get(), .racy_seconds = 0});
  EXPECT_EQ(small.cache_hits, 0u);
  EXPECT_NE(small.digest, kib.digest);
}

TEST(StatCache, TouchRewriteAndReplaceAreSeen) {
  TempDir dir;
  Cached c;
  const std::string m = Make(dir, "m", {.preset = "llama", .size_bytes = 4 << 20});
  const std::string shard = dir.Join("m/model-00002-of-00004.safetensors");
  const std::string original = c.Fp(m).digest;

  // Touch: new mtime, same bytes: re-read, same digest.
  struct timespec times[2] = {{0, UTIME_OMIT}, {12345, 0}};
  ASSERT_EQ(::utimensat(AT_FDCWD, shard.c_str(), times, 0), 0);
  Fingerprint touched = c.Fp(m);
  EXPECT_EQ(touched.cache_hits, 3u);
  EXPECT_EQ(touched.digest, original);

  // Rewrite in place, same size, mtime put back: ctime still moves.
  auto ckpt = format::OpenCheckpoint(io::PosixFileSystem(), m);
  const auto& h = ckpt->shards[1].header;
  FlipByte(shard, h.data_offset() + h.tensors[0].begin);
  ASSERT_EQ(::utimensat(AT_FDCWD, shard.c_str(), times, 0), 0);
  Fingerprint rewritten = c.Fp(m);
  EXPECT_EQ(rewritten.cache_hits, 3u);
  EXPECT_NE(rewritten.digest, original);

  // Replace by rename (a new inode), restoring the original bytes.
  FlipByte(shard, h.data_offset() + h.tensors[0].begin);
  fs::copy(shard, shard + ".new");
  fs::rename(shard + ".new", shard);
  Fingerprint replaced = c.Fp(m);
  EXPECT_EQ(replaced.cache_hits, 3u);
  EXPECT_EQ(replaced.digest, original);
}

TEST(StatCache, ARewrittenIndexIsReadAgain) {
  TempDir dir;
  Cached c;
  const std::string m = Make(dir, "m", {.preset = "llama", .size_bytes = 4 << 20});
  const std::string with_four = c.Fp(m).digest;
  // Drop a shard from the index: a new index (new inode), which must be read.
  std::ifstream in(dir.Join("m/model.safetensors.index.json"));
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::string kept;
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) {
    if (line.find("model-00004-of-00004") == std::string::npos) kept += line + "\n";
  }
  // The last kept entry may now end in a comma before "}": JSON-clean it.
  const size_t brace = kept.rfind("  }");
  const size_t comma = kept.rfind(',', brace);
  if (comma != std::string::npos && kept.find_first_not_of(" \n", comma + 1) == brace)
    kept.erase(comma, 1);
  testing::WriteFileText(dir.Join("m/index.new"), kept);
  fs::rename(dir.Join("m/index.new"), dir.Join("m/model.safetensors.index.json"));
  const Fingerprint three = c.Fp(m);
  EXPECT_EQ(three.shards.size(), 3u);
  EXPECT_NE(three.digest, with_four);
  EXPECT_EQ(three.cache_hits, 3u);
}

TEST(StatCache, ACorruptCacheFileIsIgnoredAndReplaced) {
  TempDir dir;
  Cached c;
  const std::string m = Make(dir, "m", {.preset = "tiny"});
  const std::string original = c.Fp(m).digest;
  const std::string file = c.cache_dir.Join("fingerprint-stat-v3.cache");
  const auto good = testing::ReadFileBytes(file);
  // Each byte after the header belongs to one entry, which checks itself
  // when a lookup reads it: the lookup misses, says why, and the file is
  // not used again; the fingerprint reads the shard and gets it right.
  for (size_t at : {size_t{40}, good.size() / 2, good.size() - 1}) {
    auto bytes = good;
    bytes[at] ^= std::byte{1};
    testing::WriteFileBytes(file, bytes);
    auto cache = StatCache::Load(c.cache_dir.path());
    EXPECT_EQ(cache->warning(), "") << "the header is intact";
    const Fingerprint fp = fingerprint::Fp(m, {.cache = cache.get(), .racy_seconds = 0});
    EXPECT_EQ(fp.cache_hits, 0u) << "byte " << at;
    EXPECT_EQ(fp.digest, original);
    EXPECT_NE(cache->warning().find("checksum mismatch"), std::string::npos)
        << "byte " << at << ": " << cache->warning();
  }
  // The next save replaces it with a sound one.
  EXPECT_EQ(c.Fp(m).cache_hits, 0u);
  EXPECT_EQ(StatCache::Load(c.cache_dir.path())->warning(), "");
  EXPECT_EQ(c.Fp(m).cache_hits, 1u);
  // A damaged header, or no cache file at all: ignored when opened.
  auto bytes = testing::ReadFileBytes(file);
  bytes[12] ^= std::byte{1};  // the entry count
  testing::WriteFileBytes(file, bytes);
  EXPECT_NE(StatCache::Load(c.cache_dir.path())->warning().find("header checksum"),
            std::string::npos);
  testing::WriteFileText(file, "garbage");
  EXPECT_NE(StatCache::Load(c.cache_dir.path())->warning(), "");
}

// A cache grown over months finds an entry as fast as a new one (a binary
// search, nothing parsed up front), and keeps the newest kMaxEntries.
TEST(StatCache, AFullCacheKeepsTheNewestAndFindsThem) {
  TempDir cache_dir;
  constexpr uint64_t kOld = StatCache::kMaxEntries;
  {
    auto cache = StatCache::Load(cache_dir.path());
    for (uint64_t i = 0; i < kOld; ++i) {
      cache->Insert(i % 2 ? "sampled-1024" : "full", {.device = 7, .inode = i, .size = i * 3},
                    "digest-" + std::to_string(i));
    }
    ASSERT_TRUE(cache->Save().ok());
  }
  // Added now (most likely within the same second as the others, which
  // must not make them the ones dropped), under a kind that sorts last.
  auto cache = StatCache::Load(cache_dir.path());
  EXPECT_EQ(cache->size(), kOld);
  for (uint64_t i = 0; i < 10; ++i) {
    cache->Insert("sampled-4096", {.device = 8, .inode = i},
                  std::string(1000, static_cast<char>('a' + i)));
  }
  ASSERT_TRUE(cache->Save().ok());
  auto after = StatCache::Load(cache_dir.path());
  EXPECT_EQ(after->warning(), "");
  EXPECT_EQ(after->size(), kOld);
  // Of the old (all saved in one second), the last ten in key order went:
  // the highest odd inodes, under "sampled-1024". A sample of the rest,
  // and the end, where they were.
  for (uint64_t i = 0; i < kOld; i += (i + 40 >= kOld ? 1 : 37)) {
    const std::string kind = i % 2 ? "sampled-1024" : "full";
    auto got = after->Lookup(kind, {.device = 7, .inode = i, .size = i * 3});
    if (i % 2 == 1 && i >= kOld - 20) {
      EXPECT_EQ(got, std::nullopt) << i;
    } else {
      EXPECT_EQ(got, "digest-" + std::to_string(i)) << i;
    }
  }
  for (uint64_t i = 0; i < 10; ++i) {
    EXPECT_EQ(after->Lookup("sampled-4096", {.device = 8, .inode = i}),
              std::string(1000, static_cast<char>('a' + i)));
  }
  // The same signature under another kind is another entry.
  EXPECT_EQ(after->Lookup("sampled-1024", {.device = 7, .inode = 0, .size = 0}), std::nullopt);
  EXPECT_EQ(after->warning(), "");
}

// One damaged entry costs that entry, not the cache: the lookup that meets
// it misses, and the next save keeps the sound ones and says so.
TEST(StatCache, ASaveKeepsTheSoundEntriesOfADamagedFile) {
  TempDir cache_dir;
  {
    auto cache = StatCache::Load(cache_dir.path());
    for (uint64_t i = 0; i < 100; ++i) {
      cache->Insert("full", {.device = 3, .inode = i}, "digest-" + std::to_string(i));
    }
    ASSERT_TRUE(cache->Save().ok());
  }
  const std::string file = cache_dir.Join("fingerprint-stat-v3.cache");
  auto bytes = testing::ReadFileBytes(file);
  const size_t header = 32, record = 88;
  bytes[header + 50 * record + 20] ^= std::byte{1};  // entry 50's inode
  testing::WriteFileBytes(file, bytes);
  auto cache = StatCache::Load(cache_dir.path());
  EXPECT_EQ(cache->Lookup("full", {.device = 3, .inode = 50}), std::nullopt);
  EXPECT_NE(cache->warning().find("entry checksum mismatch"), std::string::npos)
      << cache->warning();
  cache->Insert("full", {.device = 3, .inode = 1000}, "new");
  ASSERT_TRUE(cache->Save().ok());
  EXPECT_NE(cache->warning().find("1 damaged entry dropped"), std::string::npos)
      << cache->warning();
  auto after = StatCache::Load(cache_dir.path());
  EXPECT_EQ(after->warning(), "");
  EXPECT_EQ(after->size(), 100u);
  for (uint64_t i = 0; i < 100; ++i) {
    const auto got = after->Lookup("full", {.device = 3, .inode = i});
    if (i == 50) {
      EXPECT_EQ(got, std::nullopt);
    } else {
      EXPECT_EQ(got, "digest-" + std::to_string(i)) << i;
    }
  }
  EXPECT_EQ(after->Lookup("full", {.device = 3, .inode = 1000}), "new");
}

// A full cache whose entries say they were saved in the future (the clock
// set back since, another host's clock on a shared home): what a save adds
// must still be kept, not pushed out by times ahead of now.
TEST(StatCache, EntriesFromTheFutureDoNotPushOutNewOnes) {
  TempDir cache_dir;
  constexpr uint64_t kFull = StatCache::kMaxEntries;
  {
    auto cache = StatCache::Load(cache_dir.path());
    for (uint64_t i = 0; i < kFull; ++i) cache->Insert("full", {.device = 1, .inode = i}, "d");
    ASSERT_TRUE(cache->Save().ok());
  }
  // Each entry's saved_at (at 48 in its 88 bytes) an hour ahead, and its
  // checksum (at 80, of the 80 before) made right again.
  const std::string file = cache_dir.Join("fingerprint-stat-v3.cache");
  auto bytes = testing::ReadFileBytes(file);
  const uint64_t ahead = static_cast<uint64_t>(::time(nullptr)) + 3600;
  for (uint64_t i = 0; i < kFull; ++i) {
    std::byte* r = bytes.data() + 32 + i * 88;
    std::memcpy(r + 48, &ahead, sizeof ahead);
    const uint64_t sum = XXH3_64bits(r, 80);
    std::memcpy(r + 80, &sum, sizeof sum);
  }
  testing::WriteFileBytes(file, bytes);
  auto cache = StatCache::Load(cache_dir.path());
  ASSERT_EQ(cache->Lookup("full", {.device = 1, .inode = 7}), "d") << cache->warning();
  for (uint64_t i = 0; i < 10; ++i) cache->Insert("full", {.device = 2, .inode = i}, "new");
  ASSERT_TRUE(cache->Save().ok());
  auto after = StatCache::Load(cache_dir.path());
  for (uint64_t i = 0; i < 10; ++i) {
    EXPECT_EQ(after->Lookup("full", {.device = 2, .inode = i}), "new") << i;
  }
  EXPECT_EQ(after->size(), kFull);
}

TEST(StatCache, AFileOwnedByAnotherUserIsIgnored) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to chown";
  TempDir dir;
  Cached c;
  c.Fp(Make(dir, "m", {.preset = "tiny"}));
  ASSERT_EQ(::chown(c.cache_dir.Join("fingerprint-stat-v3.cache").c_str(), 4242, 4242), 0);
  const std::string m = dir.Join("m");
  auto cache = StatCache::Load(c.cache_dir.path());
  EXPECT_NE(cache->warning().find("another user"), std::string::npos) << cache->warning();
  EXPECT_EQ(cache->size(), 0u);
  // The save replaces it, and the warning (what a command prints after
  // the save) still says why.
  EXPECT_EQ(fingerprint::Fp(m, {.cache = cache.get(), .racy_seconds = 0}).cache_hits, 0u);
  ASSERT_TRUE(cache->Save().ok());
  EXPECT_NE(cache->warning().find("another user"), std::string::npos) << cache->warning();
  EXPECT_NE(cache->warning().find("replaced"), std::string::npos) << cache->warning();
  EXPECT_EQ(c.Fp(m).cache_hits, 1u);
}

TEST(StatCache, ADirectoryOthersCanWriteIsNotUsed) {
  TempDir dir;
  ASSERT_EQ(::chmod(dir.path().c_str(), 0777), 0);
  auto cache = StatCache::Load(dir.path());
  EXPECT_NE(cache->warning().find("writable by other users"), std::string::npos)
      << cache->warning();
  cache->Insert("sampled-1024", {.device = 1, .inode = 2, .size = 3}, "xxh3-128:0");
  EXPECT_TRUE(cache->Save().ok());
  EXPECT_FALSE(fs::exists(dir.Join("fingerprint-stat-v3.cache")));
}

// A read-only image file system mounted, fingerprinted, unmounted, changed
// and mounted again, most likely on the same loop device: the same device
// number, inode, size and timestamps (an image keeps its files' times), so
// the same stat signature, for other bytes; as two images of one layout
// built with fixed times would be. The loop device's disk sequence number,
// new at each attach, tells them apart.
TEST(StatCache, AnotherAttachOfTheSameLoopDeviceIsNotTakenForTheFirst) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to mount an image";
  TempDir dir;
  Cached c;
  const std::string m = Make(dir, "m", {.preset = "tiny"});
  const std::string image = dir.Join("m.img"), mnt = dir.Join("mnt");
  fs::create_directory(mnt);
  if (std::system(("mke2fs -q -t ext4 -d " + m + " " + image + " 8M >/dev/null 2>&1").c_str()) != 0)
    GTEST_SKIP() << "no mke2fs here";
  const std::string mount = "mount -o loop,ro " + image + " " + mnt + " 2>&1";
  const std::string unmount = "umount " + mnt;
  struct Unmount {
    std::string command;
    ~Unmount() { (void)std::system((command + " 2>/dev/null").c_str()); }
  } unmount_at_end{unmount};
  if (std::system(mount.c_str()) != 0) GTEST_SKIP() << "cannot mount a loop device here";
  auto seen = io::PosixFileSystem().Stat(mnt + "/model.safetensors");
  ASSERT_TRUE(seen.ok());
  if (seen->disk_sequence == 0) GTEST_SKIP() << "no disk sequence numbers here (before 5.15)";
  const std::string first = c.Fp(mnt).digest;
  EXPECT_EQ(c.Fp(mnt).cache_hits, 1u);
  ASSERT_EQ(std::system(unmount.c_str()), 0);

  // The shard's last 64 bytes (tensor data) are where they are in the
  // image: change one of them there, under the file system's feet.
  const std::vector<std::byte> shard = testing::ReadFileBytes(m + "/model.safetensors");
  std::vector<std::byte> bytes = testing::ReadFileBytes(image);
  const auto tail = shard.end() - 64;
  const auto at = std::search(bytes.begin(), bytes.end(), tail, shard.end());
  ASSERT_NE(at, bytes.end());
  ASSERT_EQ(std::search(at + 1, bytes.end(), tail, shard.end()), bytes.end());
  at[63] ^= std::byte{0x5a};
  testing::WriteFileBytes(image, bytes);

  ASSERT_EQ(std::system(mount.c_str()), 0);
  const Fingerprint second = c.Fp(mnt);
  EXPECT_EQ(second.cache_hits, 0u);
  EXPECT_NE(second.digest, first);
  EXPECT_EQ(second.digest, Digest(mnt));  // no cache
}

// Engines starting at once fingerprint the same shards and each saves the
// same entries: the first writes them, the others find them there and
// leave the file as it is (no rewrite of a file of 100,000 entries per
// engine, each holding the lock the others wait on).
TEST(StatCache, EntriesSavedAlreadyAreNotWrittenAgain) {
  TempDir cache_dir;
  auto first = StatCache::Load(cache_dir.path());
  auto second = StatCache::Load(cache_dir.path());
  const io::StatSignature sig{.device = 1, .inode = 2, .size = 3};
  first->Insert("sampled", sig, "xxh3-128:a");
  second->Insert("sampled", sig, "xxh3-128:a");
  ASSERT_TRUE(first->Save().ok());
  const std::string file = cache_dir.Join("fingerprint-stat-v3.cache");
  struct stat before, after;
  ASSERT_EQ(::stat(file.c_str(), &before), 0);
  ASSERT_TRUE(second->Save().ok());
  ASSERT_EQ(::stat(file.c_str(), &after), 0);
  EXPECT_EQ(after.st_ino, before.st_ino) << "rewritten";
  EXPECT_EQ(second->Lookup("sampled", sig), "xxh3-128:a");
  // Another value for the same signature is written.
  second->Insert("sampled", sig, "xxh3-128:b");
  ASSERT_TRUE(second->Save().ok());
  ASSERT_EQ(::stat(file.c_str(), &after), 0);
  EXPECT_NE(after.st_ino, before.st_ino);
  EXPECT_EQ(StatCache::Load(cache_dir.path())->Lookup("sampled", sig), "xxh3-128:b");
}

// A writer killed between writing its temporary file and renaming it
// leaves the file behind; a save a minute later removes it (a younger one
// may be another host's, in use). A FIFO there is removed as well, never
// opened.
TEST(StatCache, TemporaryFilesOfKilledWritersAreRemoved) {
  TempDir cache_dir;
  auto cache = StatCache::Load(cache_dir.path());
  cache->Insert("sampled", {.device = 1, .inode = 2, .size = 3}, "xxh3-128:a");
  ASSERT_TRUE(cache->Save().ok());
  const std::string file = cache_dir.Join("fingerprint-stat-v3.cache");
  testing::WriteFileText(file + ".tmp-99999998", "half a cache file");
  testing::WriteFileText(file + ".tmp-99999999", "another, in use");
  fs::last_write_time(file + ".tmp-99999998",
                      fs::file_time_type::clock::now() - std::chrono::minutes(2));
  const std::string fifo = file + ".tmp-" + std::to_string(::getpid()) + "-1";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  fs::last_write_time(fifo, fs::file_time_type::clock::now() - std::chrono::minutes(2));
  cache->Insert("sampled", {.device = 1, .inode = 3, .size = 3}, "xxh3-128:b");
  ASSERT_TRUE(cache->Save().ok());
  std::vector<std::string> left;
  for (const auto& e : fs::directory_iterator(cache_dir.path())) {
    if (e.path().filename().string().find(".tmp-") != std::string::npos) {
      left.push_back(e.path().filename().string());
    }
  }
  EXPECT_EQ(left, std::vector<std::string>{"fingerprint-stat-v3.cache.tmp-99999999"});
  EXPECT_EQ(StatCache::Load(cache_dir.path())->size(), 2u);
}

TEST(StatCache, ConcurrentWritersLoseNothingAndCorruptNothing) {
  TempDir cache_dir;
  constexpr int kWriters = 8, kEach = 200;
  std::vector<pid_t> children;
  for (int w = 0; w < kWriters; ++w) {
    pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      for (int i = 0; i < kEach; i += 50) {
        auto cache = StatCache::Load(cache_dir.path());
        for (int j = i; j < i + 50; ++j) {
          io::StatSignature sig{
              .device = 1, .inode = static_cast<uint64_t>(w * kEach + j), .size = 2};
          cache->Insert("sampled", sig, "xxh3-128:" + std::to_string(w * kEach + j));
        }
        if (!cache->Save().ok()) ::_exit(1);
      }
      ::_exit(0);
    }
    children.push_back(pid);
  }
  for (pid_t pid : children) {
    int status = 0;
    ::waitpid(pid, &status, 0);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  }
  auto cache = StatCache::Load(cache_dir.path());
  EXPECT_EQ(cache->warning(), "");
  EXPECT_EQ(cache->size(), static_cast<size_t>(kWriters * kEach));
  EXPECT_EQ(cache->Lookup("sampled", {.device = 1, .inode = 7, .size = 2}), "xxh3-128:7");
  EXPECT_EQ(cache->Lookup("full", {.device = 1, .inode = 7, .size = 2}), std::nullopt);
}

}  // namespace
}  // namespace weightd::fingerprint
