// Segments, manifests, the cache key, the wire, and the loader, in process.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sched.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <mutex>
#include <thread>

#include "fingerprint/fingerprint.h"
#include "format/checkpoint.h"
#include "format/rules.h"
#include "format/synthetic.h"
#include "io/file.h"
#include "loader/loader.h"
#include "memory/cuda.h"
#include "memory/host_memory.h"
#include "memory/manifest.h"
#include "memory/segment.h"
#include "protocol/cache_key.h"
#include "protocol/channel.h"
#include "protocol/paths.h"
#include "test_util.h"
#include "transform/plan.h"

namespace weightd {
namespace {

using testing::TempDir;

TEST(HostSegment, SealedSegmentsAreReadOnlyEverywhere) {
  auto seg = memory::CreateHostSegment(10000, "test");
  ASSERT_TRUE(seg.ok()) << seg.error().message();
  std::vector<std::byte> sevens(10000, std::byte{7});
  ASSERT_TRUE((*seg)->Write(0, sevens).ok());
  EXPECT_FALSE((*seg)->Write(1, sevens).ok());  // past the end
  EXPECT_FALSE((*seg)->Export().ok());          // not before sealing
  // What was written reads back before the seal, through the same view
  // (where /proc lets the segment be mapped read-only early).
  const auto before = (*seg)->readable();
  if (::access("/proc/self/fd", F_OK) == 0) {
    ASSERT_EQ(before.size(), 10000u);
    EXPECT_EQ(before[9999], std::byte{7});
  }
  ASSERT_TRUE((*seg)->Seal().ok());
  if (!before.empty()) {
    EXPECT_EQ((*seg)->readable().data(), before.data());
  }
  EXPECT_FALSE((*seg)->Write(0, std::span(sevens).first(1)).ok());
  auto fd = (*seg)->Export();
  ASSERT_TRUE(fd.ok());
  // The descriptor refuses writes and resizing.
  const char x = 1;
  EXPECT_EQ(::pwrite(fd->get(), &x, 1, 0), -1);
  EXPECT_NE(::ftruncate(fd->get(), 0), 0);
  EXPECT_EQ(::mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd->get(), 0), MAP_FAILED);
  auto map = memory::MapHostSegment(*fd, 10000);
  ASSERT_TRUE(map.ok()) << map.error().message();
  EXPECT_EQ((*map)->bytes()[9999], std::byte{7});
  EXPECT_EQ((*map)->bytes().size(), 10000u);                // not the page rounding after it
  EXPECT_FALSE(memory::MapHostSegment(*fd, 1 << 30).ok());  // more than it holds
  // Far more than announced is not the segment announced either (a copy
  // would copy it all).
  auto big = memory::CreateHostSegment(8 << 20, "test");
  ASSERT_TRUE(big.ok());
  ASSERT_TRUE((*big)->Seal().ok());
  auto big_fd = (*big)->Export();
  ASSERT_TRUE(big_fd.ok());
  auto wrong = memory::MapHostSegment(*big_fd, 10000);
  ASSERT_FALSE(wrong.ok());
  EXPECT_NE(wrong.error().message().find("were announced"), std::string::npos);
  EXPECT_TRUE(memory::MapHostSegment(*big_fd, 8 << 20).ok());
}

// The KiB of this process's page tables that map the mapping holding `at`
// (smaps' Rss); -1 where none holds it.
long RssKibOfMappingHolding(const void* at) {
  std::ifstream smaps("/proc/self/smaps");
  const auto addr = reinterpret_cast<uintptr_t>(at);
  bool holds = false;
  for (std::string line; std::getline(smaps, line);) {
    unsigned long long from = 0, to = 0;
    long kib = 0;
    if (std::sscanf(line.c_str(), "%llx-%llx ", &from, &to) == 2) {
      holds = from <= addr && addr < to;
    } else if (holds && std::sscanf(line.c_str(), "Rss: %ld kB", &kib) == 1) {
      return kib;
    }
  }
  return -1;
}

// A reader about to read a whole manifest has its pages mapped in one call,
// the last one too where the bytes end inside it.
TEST(HostSegment, PrefaultMapsWhatWillBeRead) {
  constexpr size_t kSize = (1 << 20) + 100;
  auto seg = memory::CreateHostSegment(kSize, "test");
  ASSERT_TRUE(seg.ok()) << seg.error().message();
  ASSERT_TRUE((*seg)->Write(0, std::vector<std::byte>(kSize, std::byte{3})).ok());
  ASSERT_TRUE((*seg)->Seal().ok());
  auto fd = (*seg)->Export();
  ASSERT_TRUE(fd.ok());
  auto map = memory::MapHostSegment(*fd, kSize);
  ASSERT_TRUE(map.ok()) << map.error().message();
  const std::span<const std::byte> bytes = (*map)->bytes();
  ASSERT_EQ(RssKibOfMappingHolding(bytes.data()), 0);  // nothing read yet
  memory::PrefaultForReading({});
  memory::PrefaultForReading(bytes.first(600 << 10));
  EXPECT_GE(RssKibOfMappingHolding(bytes.data()), 600);
  memory::PrefaultForReading(bytes);
  EXPECT_GE(RssKibOfMappingHolding(bytes.data()), 1024 + 4);
  EXPECT_EQ(bytes.back(), std::byte{3});
}

TEST(CudaDevices, NamesParseAndUuidsPrintAsNvidiaSmiDoes) {
  using Kind = memory::DeviceSpec::Kind;
  EXPECT_EQ(memory::ParseDevice("cpu")->kind, Kind::kHost);
  EXPECT_EQ(memory::ParseDevice("host")->kind, Kind::kHost);
  EXPECT_EQ(memory::ParseDevice("cuda:12")->ordinal, 12);
  auto uuid = memory::ParseDevice("cuda:GPU-6f0e1c2a-0000-4a6f-9c1d-1234567890ab");
  ASSERT_TRUE(uuid.ok());
  EXPECT_EQ(uuid->kind, Kind::kCudaUuid);
  EXPECT_EQ(uuid->uuid, "GPU-6f0e1c2a-0000-4a6f-9c1d-1234567890ab");
  for (const char* bad : {"", "gpu", "cuda:", "cuda:-1", "cuda:x", "cuda:1x", "cuda:GPU-6f0e",
                          "cuda:GPU-6f0e1c2a-0000-4a6f-9c1d-1234567890aZ", "CUDA:0"}) {
    auto r = memory::ParseDevice(bad);
    ASSERT_FALSE(r.ok()) << bad;
    // A UUID's form, said as such for one that looks like one.
    const bool uuid_like = std::string(bad).find("GPU-") != std::string::npos;
    EXPECT_NE(r.error().message().find(uuid_like ? "8-4-4-4-12 lowercase hex" : "cuda:N"),
              std::string::npos)
        << r.error().message();
  }
  std::array<uint8_t, 16> bytes{};
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<uint8_t>(i * 17);
  EXPECT_EQ(memory::FormatGpuUuid(bytes), "GPU-00112233-4455-6677-8899-aabbccddeeff");
  EXPECT_TRUE(memory::ParseDevice("cuda:" + memory::FormatGpuUuid(bytes)).ok());
}

TEST(CudaDevices, OrdinalsResolveInThisProcesssNumberingAndSizesRound) {
  std::vector<memory::CudaDevice> visible = {{.ordinal = 0, .uuid = "GPU-a"},
                                             {.ordinal = 1, .uuid = "GPU-b"}};
  EXPECT_EQ(*memory::ResolveCudaOrdinal(1, visible), "GPU-b");
  auto missing = memory::ResolveCudaOrdinal(2, visible);
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.error().message().find("sees 2 CUDA device(s)"), std::string::npos);
  constexpr uint64_t kTwoMiB = 2 << 20;
  EXPECT_EQ(memory::RoundToGranularity(0, kTwoMiB), 0u);
  EXPECT_EQ(memory::RoundToGranularity(1, kTwoMiB), kTwoMiB);
  EXPECT_EQ(memory::RoundToGranularity(kTwoMiB, kTwoMiB), kTwoMiB);
  EXPECT_EQ(memory::RoundToGranularity(kTwoMiB + 1, kTwoMiB), 2 * kTwoMiB);
  EXPECT_FALSE(memory::RoundToGranularity(UINT64_MAX, kTwoMiB).has_value());
  EXPECT_FALSE(memory::RoundToGranularity(5, 0).has_value());
}

TEST(CudaDevices, AUuidResolvesWithoutTheDriverAndMigIsSpelledAsTheDriverDoes) {
  const std::string hex = "6f0e1c2a-0000-4a6f-9c1d-1234567890ab";
  auto gpu = memory::ResolveDevice("cuda:GPU-" + hex);
  ASSERT_TRUE(gpu.ok()) << gpu.error().message();
  EXPECT_EQ(gpu->Name(), "cuda:GPU-" + hex);
  auto mig = memory::ResolveDevice("cuda:MIG-" + hex);
  ASSERT_TRUE(mig.ok());
  EXPECT_EQ(mig->Name(), "cuda:GPU-" + hex);  // one spelling per GPU in keys
  EXPECT_TRUE(memory::SameGpu("GPU-" + hex, "MIG-" + hex));
  EXPECT_FALSE(memory::SameGpu("GPU-" + hex, "GPU-" + hex.substr(0, 35) + "c"));
  EXPECT_FALSE(memory::SameGpu("GPU-a", "GPU-a"));  // not a UUID
  EXPECT_EQ(memory::ResolveDevice("cpu")->Name(), "host");
  EXPECT_FALSE(memory::ResolveDevice("cuda:x").ok());
}

TEST(CudaDevices, ANoGpuHostSaysWhyAndDoesNotCrash) {
  auto devices = memory::ListCudaDevices();
  if (devices.ok()) {
    for (const auto& d : *devices) EXPECT_TRUE(memory::ParseDevice("cuda:" + d.uuid).ok());
  } else {
    // No driver, no device, or built without the header: each says so.
    const std::string why = devices.error().message();
    bool known = false;
    for (std::string_view cause :
         {"no CUDA driver: ", "no CUDA device", "this weightd was built without",
          "the CUDA driver is older", "the CUDA driver has no", "the CUDA driver did not start"}) {
      known |= why.starts_with(cause);
    }
    EXPECT_TRUE(known) << why;
    auto again = memory::ListCudaDevices();  // loaded once; the same answer
    ASSERT_FALSE(again.ok());
    EXPECT_EQ(again.error().message(), devices.error().message());
  }
}

TEST(CudaSegment, AnAbsentGpuIsAnErrorThatSaysWhy) {
  const std::string uuid = "GPU-00000000-0000-0000-0000-000000000000";
  auto segment = memory::CreateCudaSegment(4096, uuid);
  ASSERT_FALSE(segment.ok());
  // Any open descriptor gets as far as the driver.
  auto mapping = memory::MapCudaSegment(memory::UniqueFd(::open("/dev/null", O_RDONLY | O_CLOEXEC)),
                                        4096, uuid);
  ASSERT_FALSE(mapping.ok());
  auto devices = memory::ListCudaDevices();
  if (!devices.ok()) {  // no CUDA here: the same reason, from either side
    EXPECT_EQ(segment.error().message(), devices.error().message());
    EXPECT_EQ(mapping.error().message(), devices.error().message());
  } else {  // a GPU, but not this one
    EXPECT_NE(segment.error().message().find("no such GPU"), std::string::npos)
        << segment.error().message();
  }
}

TEST(HostSegment, GatheredWritesLandInOrder) {
  // More pieces than one pwritev takes (IOV_MAX), some empty, at an offset:
  // of a byte each, and of 512 (more than a MiB in all).
  constexpr size_t kPieces = 3000;
  for (const size_t piece_bytes : {size_t{1}, size_t{512}}) {
    SCOPED_TRACE(piece_bytes);
    std::vector<std::byte> values(kPieces * piece_bytes);
    std::vector<std::span<const std::byte>> pieces;
    for (size_t i = 0; i < values.size(); ++i) values[i] = static_cast<std::byte>(i * 7 + i / 251);
    for (size_t i = 0; i < kPieces; ++i) {
      pieces.push_back(std::span(&values[i * piece_bytes], i % 5 == 4 ? 0 : piece_bytes));
    }
    auto seg = memory::CreateHostSegment(kPieces * piece_bytes + 8192, "test");
    ASSERT_TRUE(seg.ok());
    ASSERT_TRUE((*seg)->Write(100, pieces).ok());
    ASSERT_TRUE((*seg)->Seal().ok());
    auto bytes = (*seg)->readable();
    size_t at = 100;
    for (size_t i = 0; i < kPieces; ++i) {
      if (i % 5 == 4) continue;
      for (size_t b = 0; b < piece_bytes; ++b) {
        ASSERT_EQ(bytes[at++], values[i * piece_bytes + b]) << "piece " << i << " byte " << b;
      }
    }
    EXPECT_EQ(bytes[at], std::byte{0});
    EXPECT_EQ(bytes[99], std::byte{0});
  }
}

// What a daemon weighs its reservations against: the memory a segment
// holds so far, read from any thread, after the segment is gone too.
TEST(HostSegment, HeldProbeReadsThePagesWrittenSoFar) {
  constexpr uint64_t kMiB = 1 << 20;
  auto seg = memory::CreateHostSegment(8 * kMiB, "test",
                                       {.try_huge_pages = false, .transparent_huge_pages = false});
  ASSERT_TRUE(seg.ok());
  auto held = (*seg)->HeldProbe();
  EXPECT_EQ(held(), 0u);
  std::vector<std::byte> bytes(3 * kMiB, std::byte{1});
  ASSERT_TRUE((*seg)->Write(kMiB, bytes).ok());
  // Where swap is on, a page counted might be out of memory: none is.
  if (memory::HostHasSwap()) {
    EXPECT_EQ(held(), 0u);
    return;
  }
  // Whole 2 MiB folios where the kernel's policy for shared memory puts
  // them in anyway.
  const std::string policy = memory::ShmemHugePagePolicy();
  if (policy == "always" || policy == "force" || policy == "within_size") {
    EXPECT_GE(held(), 3 * kMiB);
    EXPECT_LE(held(), 8 * kMiB);
  } else {
    EXPECT_EQ(held(), 3 * kMiB);
  }
  const uint64_t before = held();
  seg->reset();
  EXPECT_EQ(held(), before);
}

using testing::HugePagePool;

// A plan for normal memory whatever the pool has; and a segment that must
// be huge pages, where the pool has none, is refused rather than made of
// normal pages.
TEST(HostSegment, AHugePagePlanIsKeptOrRefused) {
  const memory::HostPlacement normal = memory::PlanHostSegments(6 << 20, 1, false);
  EXPECT_FALSE(normal.options.try_huge_pages);
  EXPECT_TRUE(normal.options.normal_pages_if_no_huge_pages);
  if (HugePagePool::Available() > 0) GTEST_SKIP() << "this machine has huge pages free";
  memory::HostSegmentOptions only_huge;
  only_huge.normal_pages_if_no_huge_pages = false;
  auto refused = memory::CreateHostSegment(4 << 20, "huge-only", only_huge);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.error().message().find("in huge pages, as planned"), std::string::npos)
      << refused.error().message();
  auto fallback = memory::CreateHostSegment(4 << 20, "huge-or-normal");
  ASSERT_TRUE(fallback.ok()) << fallback.error().message();
  EXPECT_FALSE((*fallback)->huge_pages());
}

// In the child: a segment from the pool, filled from two threads, holes
// read back as zeros, and normal pages when the pool is short.
void CheckHugePageSegments() {
  constexpr uint64_t kSize = (6ull << 20) + 1;
  // What a caller reserving ahead is told: huge pages, as the segment is.
  const memory::HostPlacement planned = memory::PlanHostSegments(kSize);
  EXPECT_TRUE(planned.options.try_huge_pages);
  EXPECT_EQ(planned.bytes, 8ull << 20);
  const long free_before = HugePagePool::Read("free_hugepages");
  auto seg = memory::CreateHostSegment(kSize, "huge-test");
  ASSERT_TRUE(seg.ok()) << seg.error().message();
  ASSERT_TRUE((*seg)->huge_pages());
  EXPECT_EQ((*seg)->reserved_bytes(), 8ull << 20);
  // Its pages are taken as it is made, before any write: a page the system
  // would refuse is refused here, not by a SIGBUS during the fill.
  EXPECT_EQ(free_before - HugePagePool::Read("free_hugepages"), 4);
  std::vector<std::byte> pattern(kSize);
  for (size_t i = 0; i < pattern.size(); ++i) pattern[i] = static_cast<std::byte>(i * 13 + 5);
  auto fill = [&](uint64_t from, uint64_t to) {
    ASSERT_TRUE(
        (*seg)->Write(from, std::span(pattern).subspan(from, static_cast<size_t>(to - from))).ok());
  };
  std::thread half(fill, 0, kSize / 2);
  fill(kSize / 2, kSize);
  half.join();
  // Read back before the seal and after through one view, which stays put.
  const std::byte* view = (*seg)->readable().data();
  ASSERT_NE(view, nullptr);
  EXPECT_TRUE(std::equal(pattern.begin(), pattern.end(), view));
  ASSERT_TRUE((*seg)->Seal().ok());
  if (::access("/proc/self/fd", F_OK) == 0) {
    EXPECT_EQ((*seg)->readable().data(), view);
  }
  auto fd = (*seg)->Export();
  ASSERT_TRUE(fd.ok());
  auto map = memory::MapHostSegment(*fd, kSize);
  ASSERT_TRUE(map.ok()) << map.error().message();
  EXPECT_TRUE(std::equal(pattern.begin(), pattern.end(), (*map)->bytes().begin()));

  // Pages the fill never wrote read as zeros, not a SIGBUS.
  auto sparse = memory::CreateHostSegment(kSize, "huge-test-sparse");
  ASSERT_TRUE(sparse.ok()) << sparse.error().message();
  ASSERT_TRUE((*sparse)->huge_pages());
  ASSERT_TRUE((*sparse)->Write(0, std::span(pattern).first(100)).ok());
  ASSERT_TRUE((*sparse)->Seal().ok());
  auto sparse_fd = (*sparse)->Export();
  ASSERT_TRUE(sparse_fd.ok());
  auto sparse_map = memory::MapHostSegment(*sparse_fd, kSize);
  ASSERT_TRUE(sparse_map.ok()) << sparse_map.error().message();
  const std::span<const std::byte> rest = (*sparse_map)->bytes().subspan(100);
  EXPECT_TRUE(std::all_of(rest.begin(), rest.end(), [](std::byte b) { return b == std::byte{0}; }));

  // More than the pool has left: normal pages, not a failure. (Not tried
  // where the pool had plenty free before: more than it could be more than
  // the memory there is.)
  if (const long left = HugePagePool::Available(); left <= 64) {
    const uint64_t too_big = static_cast<uint64_t>(left + 1) * (2ull << 20);
    EXPECT_FALSE(memory::PlanHostSegments(too_big).options.try_huge_pages);
    EXPECT_FALSE(
        memory::PlanHostSegments(kSize, static_cast<uint64_t>(left + 1)).options.try_huge_pages);
    auto fallback = memory::CreateHostSegment(too_big, "huge-test-short");
    ASSERT_TRUE(fallback.ok()) << fallback.error().message();
    EXPECT_FALSE((*fallback)->huge_pages());
    EXPECT_EQ((*fallback)->size(), too_big);
    // Made as planned for huge pages the pool no longer has: refused, not
    // normal pages (the room was weighed for the pool, not for memory).
    EXPECT_FALSE(planned.options.normal_pages_if_no_huge_pages);
    auto refused = memory::CreateHostSegment(too_big, "huge-test-refused", planned.options);
    ASSERT_FALSE(refused.ok());
    EXPECT_NE(refused.error().message().find("in huge pages, as planned"), std::string::npos)
        << refused.error().message();
  }
}

// Runs `checks` in a child process, which the test waits for.
void InChild(const std::function<void()>& checks) {
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::alarm(60);  // a hung child must not keep the pool raised for good
    checks();
    ::_exit(::testing::Test::HasFailure() ? 1 : 0);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
      << "the checks failed (above) or the child died (status " << status << ")";
}

TEST(HugePagePool, SegmentsTakeItsPagesAndNormalPagesWhenItIsShort) {
  HugePagePool pool;
  if (std::string why = pool.Raise(8); !why.empty()) GTEST_SKIP() << why;
  InChild(CheckHugePageSegments);
}

// One rank of a split model, loaded into huge pages: its digest is that of
// the checkpoint, hashed partly after the seal, from the samples the reads
// did not pass by and the replicated tensors in the sealed segment.
TEST(HugePagePool, OneRankInHugePagesHasTheCheckpointsDigest) {
  HugePagePool pool;
  if (std::string why = pool.Raise(16); !why.empty()) GTEST_SKIP() << why;
  InChild([] {
    TempDir dir;
    const std::string path = dir.Join("m");
    ASSERT_TRUE(
        format::WriteSyntheticCheckpoint(path, {.preset = "llama", .size_bytes = 8 << 20}).ok());
    auto processing = transform::ResolveProcessing(2, "keep", "none", "llama");
    ASSERT_TRUE(processing.ok()) << processing.error().message();
    loader::LoadOptions one;
    one.processing = *processing;
    one.ranks = {1};
    auto loaded = loader::LoadCheckpoint(io::PosixFileSystem(), path, one);
    ASSERT_TRUE(loaded.ok()) << loaded.error().message();
    ASSERT_TRUE(loaded->ranks[0].segment->huge_pages());
    auto fp = fingerprint::FingerprintCheckpoint(io::PosixFileSystem(), path, {});
    ASSERT_TRUE(fp.ok()) << fp.error().message();
    EXPECT_EQ(loaded->checkpoint_digest, fp->digest);
  });
}

using testing::ShmemHugePagePolicy;

// KiB of the mapping that holds `at` mapped 2 MiB at a time (its
// ShmemPmdMapped in /proc/self/smaps); -1 where no mapping holds it.
long PmdMappedKiB(const void* at) {
  std::ifstream smaps("/proc/self/smaps");
  const auto addr = reinterpret_cast<uintptr_t>(at);
  bool holds = false;
  for (std::string line; std::getline(smaps, line);) {
    unsigned long long from = 0, to = 0;
    if (std::sscanf(line.c_str(), "%llx-%llx ", &from, &to) == 2) {
      holds = from <= addr && addr < to;
    } else if (holds && line.starts_with("ShmemPmdMapped:")) {
      return std::stol(line.substr(std::strlen("ShmemPmdMapped:")));
    }
  }
  return -1;
}

// Fills `segment` with `pattern` from two threads, seals it and maps it as
// an engine would; checks the bytes there.
std::unique_ptr<memory::Mapping> FillAndMap(memory::Segment& segment,
                                            const std::vector<std::byte>& pattern) {
  const size_t half = pattern.size() / 2;
  Status first = OkStatus();
  std::thread other([&] { first = segment.Write(0, std::span(pattern).first(half)); });
  EXPECT_TRUE(segment.Write(half, std::span(pattern).subspan(half)).ok());
  other.join();
  EXPECT_TRUE(first.ok()) << first.error().message();
  EXPECT_TRUE(segment.Seal().ok());
  auto fd = segment.Export();
  if (!fd.ok()) return nullptr;
  auto map = memory::MapHostSegment(*fd, pattern.size());
  if (!map.ok()) return nullptr;
  EXPECT_TRUE(std::equal(pattern.begin(), pattern.end(), (*map)->bytes().begin()));
  return std::move(map).value();
}

constexpr uint64_t kThpSize = (6ull << 20) + 1;

uint64_t InPages(uint64_t size) {
  const auto page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  return (size + page - 1) / page * page;
}

std::vector<std::byte> Pattern(uint64_t size) {
  std::vector<std::byte> pattern(size);
  for (size_t i = 0; i < pattern.size(); ++i) pattern[i] = static_cast<std::byte>(i * 29 + 3);
  return pattern;
}

// Sets the shmem policy to `policy` for the test; why it cannot, where it
// cannot (or where segments would come from the huge page pool instead).
std::string SetPolicy(ShmemHugePagePolicy& p, const std::string& policy) {
  if (memory::PlanHostSegments(kThpSize).options.try_huge_pages) {
    return "the huge page pool has pages free";
  }
  return p.Set(policy);
}

// Where the kernel's policy lets it fill memfds with transparent huge
// pages, a segment of normal memory is whole ones: planned so, taking what
// it was planned to take, and mapped by engines 2 MiB at a time.
TEST(ShmemHugePages, UnderWithinSizeASegmentIsWholeHugePagesMappedSo) {
  ShmemHugePagePolicy policy;
  if (std::string why = SetPolicy(policy, "within_size"); !why.empty()) GTEST_SKIP() << why;
  const memory::HostPlacement planned = memory::PlanHostSegments(kThpSize, 2);
  EXPECT_TRUE(planned.options.transparent_huge_pages);
  EXPECT_EQ(planned.bytes, 8ull << 20);
  auto seg = memory::CreateHostSegment(kThpSize, "thp-test", planned.options);
  ASSERT_TRUE(seg.ok()) << seg.error().message();
  EXPECT_TRUE((*seg)->transparent_huge_pages());
  EXPECT_FALSE((*seg)->huge_pages());
  EXPECT_EQ((*seg)->reserved_bytes(), planned.bytes);
  // Free 2 MiB blocks for the fill, which the kernel takes without
  // compacting memory itself.
  std::ofstream("/proc/sys/vm/compact_memory") << 1;
  auto map = FillAndMap(**seg, Pattern(kThpSize));
  ASSERT_NE(map, nullptr);
  EXPECT_GE(PmdMappedKiB(map->bytes().data()), 2048);
}

// Planned in normal pages, a segment keeps its tail in them; smaller than
// a huge page, it gets none under `within_size`.
TEST(ShmemHugePages, UnderWithinSizeNormalPagesAreKeptWherePlannedAndForSmallSegments) {
  ShmemHugePagePolicy policy;
  if (std::string why = SetPolicy(policy, "within_size"); !why.empty()) GTEST_SKIP() << why;
  memory::HostSegmentOptions normal;
  normal.try_huge_pages = false;
  normal.transparent_huge_pages = false;
  auto as_planned = memory::CreateHostSegment(kThpSize, "thp-test-normal", normal);
  ASSERT_TRUE(as_planned.ok()) << as_planned.error().message();
  EXPECT_EQ((*as_planned)->reserved_bytes(), InPages(kThpSize));

  const memory::HostPlacement small = memory::PlanHostSegments(1 << 20);
  EXPECT_FALSE(small.options.transparent_huge_pages);
  EXPECT_EQ(small.bytes, 1u << 20);
  auto small_seg = memory::CreateHostSegment(1 << 20, "thp-test-small", small.options);
  ASSERT_TRUE(small_seg.ok()) << small_seg.error().message();
  EXPECT_FALSE((*small_seg)->transparent_huge_pages());
  EXPECT_EQ((*small_seg)->reserved_bytes(), 1u << 20);
}

// Under `always` even one byte takes a huge page, and that is what is
// planned and reserved.
TEST(ShmemHugePages, UnderAlwaysATinySegmentReservesAWholeHugePage) {
  ShmemHugePagePolicy policy;
  if (std::string why = SetPolicy(policy, "always"); !why.empty()) GTEST_SKIP() << why;
  const memory::HostPlacement tiny = memory::PlanHostSegments(1);
  EXPECT_TRUE(tiny.options.transparent_huge_pages);
  EXPECT_EQ(tiny.bytes, 2ull << 20);
  auto seg = memory::CreateHostSegment(1, "thp-test-tiny", tiny.options);
  ASSERT_TRUE(seg.ok()) << seg.error().message();
  EXPECT_TRUE((*seg)->transparent_huge_pages());
  EXPECT_EQ((*seg)->reserved_bytes(), tiny.bytes);
}

// Under `never`, normal pages, mapped 4 KiB at a time.
TEST(ShmemHugePages, UnderNeverASegmentIsNormalPages) {
  ShmemHugePagePolicy policy;
  if (std::string why = SetPolicy(policy, "never"); !why.empty()) GTEST_SKIP() << why;
  const memory::HostPlacement none = memory::PlanHostSegments(kThpSize);
  EXPECT_FALSE(none.options.transparent_huge_pages);
  EXPECT_EQ(none.bytes, InPages(kThpSize));
  auto seg = memory::CreateHostSegment(kThpSize, "thp-test-never", none.options);
  ASSERT_TRUE(seg.ok()) << seg.error().message();
  EXPECT_FALSE((*seg)->transparent_huge_pages());
  EXPECT_EQ((*seg)->reserved_bytes(), InPages(kThpSize));
  auto map = FillAndMap(**seg, Pattern(kThpSize));
  ASSERT_NE(map, nullptr);
  EXPECT_EQ(PmdMappedKiB(map->bytes().data()), 0);
}

// Under a huge page, a segment is normal pages whatever the pool holds, and
// that is what a caller reserving ahead is told.
TEST(HostSegment, SmallSegmentsArePlannedInNormalPages) {
  if (const std::string p = memory::ShmemHugePagePolicy(); p == "always" || p == "force") {
    GTEST_SKIP() << "this machine's shmem policy gives every memfd a huge page";
  }
  const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  for (uint64_t size : std::vector<uint64_t>{0, 1, page, page + 1, (2ull << 20) - 1}) {
    const memory::HostPlacement planned = memory::PlanHostSegments(size, 3);
    EXPECT_FALSE(planned.options.try_huge_pages) << size;
    EXPECT_EQ(planned.bytes, (std::max<uint64_t>(size, 1) + page - 1) / page * page) << size;
    auto seg = memory::CreateHostSegment(size, "planned", planned.options);
    ASSERT_TRUE(seg.ok()) << seg.error().message();
    EXPECT_EQ((*seg)->reserved_bytes(), planned.bytes) << size;
  }
}

TEST(HostSegment, UnsealedDescriptorsAreRefused) {
  memory::UniqueFd fd(::memfd_create("loose", MFD_CLOEXEC));
  ASSERT_TRUE(fd.valid());
  ASSERT_EQ(::ftruncate(fd.get(), 4096), 0);
  auto map = memory::MapHostSegment(fd, 4096);
  ASSERT_FALSE(map.ok());
  EXPECT_NE(map.error().message().find("not sealed"), std::string::npos);
}

TEST(HostSegment, WritingThroughAMappingFaults) {
  auto seg = memory::CreateHostSegment(4096, "test");
  ASSERT_TRUE(seg.ok());
  ASSERT_TRUE((*seg)->Seal().ok());
  auto fd = (*seg)->Export();
  auto map = memory::MapHostSegment(*fd, 4096);
  ASSERT_TRUE(map.ok());
  const pid_t child = ::fork();
  if (child == 0) {
    ::signal(SIGSEGV, SIG_DFL);  // not the sanitizer's report: the plain fault
    const_cast<std::byte*>((*map)->bytes().data())[0] = std::byte{1};
    ::_exit(0);
  }
  int status = 0;
  ::waitpid(child, &status, 0);
  ASSERT_TRUE(WIFSIGNALED(status)) << "a write into a sealed mapping went through";
  EXPECT_EQ(WTERMSIG(status), SIGSEGV);
}

TEST(Manifest, RoundTripsAndAlignsEveryTensor) {
  const std::vector<uint64_t> b_shape = {3, 5}, c_shape = {7};
  std::vector<memory::TensorLayout> tensors = {
      {"b", "BF16", b_shape, 30, 0}, {"a", "F32", {}, 4, 0}, {"c", "U8", c_shape, 7, 0}};
  auto plan = memory::PlanSegment(tensors);
  ASSERT_TRUE(plan.ok());
  std::vector<std::byte> seg(plan->total_bytes + 4096);
  // Page-aligned, as a mapping is.
  std::byte* base =
      reinterpret_cast<std::byte*>((reinterpret_cast<uintptr_t>(seg.data()) + 4095) / 4096 * 4096);
  std::span<std::byte> view(base, plan->total_bytes);
  memory::WriteManifest(*plan, view);
  auto m = memory::ReadManifest(view);
  ASSERT_TRUE(m.ok()) << m.error().message();
  ASSERT_EQ(m->tensors.size(), 3u);
  EXPECT_EQ(m->tensors[0].name, "a");
  EXPECT_EQ(m->tensors[1].dtype, "BF16");
  EXPECT_EQ(std::vector<uint64_t>(m->tensors[1].shape.begin(), m->tensors[1].shape.end()),
            (std::vector<uint64_t>{3, 5}));
  for (const auto& t : m->tensors) EXPECT_EQ(t.offset % memory::kTensorAlignment, 0u);
  EXPECT_FALSE(memory::PlanSegment({{"x", "F32", {}, 4, 0}, {"x", "F32", {}, 4, 0}}).ok());
}

// Streamed a few bytes at a time, the manifest comes in order and whole,
// zeros after the names included; the first error ends it.
TEST(Manifest, StreamedInPiecesItIsTheSameManifest) {
  const std::vector<uint64_t> b_shape = {3, 5}, c_shape = {7};
  auto plan = memory::PlanSegment(
      {{"bb", "BF16", b_shape, 30, 0}, {"a", "F32", {}, 4, 0}, {"c", "U8", c_shape, 7, 0}});
  ASSERT_TRUE(plan.ok());
  std::vector<std::byte> streamed(plan->total_bytes, std::byte{0xee});
  uint64_t next = 0;
  int pieces = 0;
  ASSERT_TRUE(memory::StreamManifest(*plan, 7, [&](uint64_t at, std::span<const std::byte> piece) {
                EXPECT_EQ(at, next);
                EXPECT_LE(piece.size(), 7u);
                std::copy(piece.begin(), piece.end(),
                          streamed.begin() + static_cast<ptrdiff_t>(at));
                next = at + piece.size();
                ++pieces;
                return OkStatus();
              }).ok());
  EXPECT_EQ(next, plan->manifest_bytes);
  EXPECT_EQ(pieces, static_cast<int>((plan->manifest_bytes + 6) / 7));
  // Its last bytes, after the names, are zeros written, not left as found.
  EXPECT_EQ(streamed[plan->manifest_bytes - 1], std::byte{0});
  auto m = memory::ReadManifest(std::span(streamed));
  ASSERT_TRUE(m.ok()) << m.error().message();
  ASSERT_EQ(m->tensors.size(), 3u);
  EXPECT_EQ(m->tensors[1].name, "bb");
  EXPECT_EQ(std::vector<uint64_t>(m->tensors[1].shape.begin(), m->tensors[1].shape.end()), b_shape);
  EXPECT_EQ(m->tensors[2].offset, plan->tensors[2].offset);

  int calls = 0;
  auto failed = memory::StreamManifest(*plan, 7, [&](uint64_t, std::span<const std::byte>) {
    ++calls;
    return Status(Error("disk full"));
  });
  ASSERT_FALSE(failed.ok());
  EXPECT_EQ(failed.error().message(), "disk full");
  EXPECT_EQ(calls, 1);
}

// Tensors placed by the caller keep their offsets; the plan says how big
// the manifest before them is, and refuses names out of order, a name
// twice, and a tensor before the data, off the alignment or past the end.
TEST(Manifest, TensorsPlacedByTheCallerKeepTheirPlaces) {
  const uint64_t data = memory::DataOffsetAfter(memory::ManifestBytes(2, 1, 2));
  EXPECT_EQ(data, 4096u);
  const std::vector<uint64_t> shape = {3};
  auto plan = memory::PlanPlacedSegment(
      {{"a", "F32", shape, 12, data + 256}, {"b", "U8", {}, 1, data}}, data + 512);
  ASSERT_TRUE(plan.ok()) << plan.error().message();
  EXPECT_EQ(plan->data_offset, data);
  EXPECT_EQ(plan->manifest_bytes, memory::ManifestBytes(2, 1, 2));
  std::vector<uint64_t> words(plan->total_bytes / 8);
  std::span<std::byte> seg(reinterpret_cast<std::byte*>(words.data()), plan->total_bytes);
  memory::WriteManifest(*plan, seg);
  auto m = memory::ReadManifest(seg);
  ASSERT_TRUE(m.ok()) << m.error().message();
  EXPECT_EQ(m->tensors[0].offset, data + 256);
  EXPECT_EQ(m->tensors[1].offset, data);
  EXPECT_FALSE(memory::PlanPlacedSegment({{"b", "U8", {}, 1, data}, {"a", "U8", {}, 1, data + 256}},
                                         data + 512)
                   .ok());
  EXPECT_FALSE(memory::PlanPlacedSegment({{"a", "U8", {}, 1, data}, {"a", "U8", {}, 1, data + 256}},
                                         data + 512)
                   .ok());
  for (const uint64_t at : {uint64_t{0}, data + 8, data + 512, ~uint64_t{0} - 255}) {
    EXPECT_FALSE(memory::PlanPlacedSegment({{"a", "U8", {}, 1, at}}, data + 512).ok()) << at;
  }
  EXPECT_FALSE(memory::PlanPlacedSegment({}, 64).ok());  // no room for the manifest
}

TEST(Manifest, CorruptTablesAreErrorsNotCrashes) {
  const std::vector<uint64_t> shape = {2};
  auto plan = memory::PlanSegment({{"w", "F32", shape, 8, 0}});
  ASSERT_TRUE(plan.ok());
  std::vector<uint64_t> words(plan->total_bytes / 8 + 1);
  std::span<std::byte> seg(reinterpret_cast<std::byte*>(words.data()), plan->total_bytes);
  memory::WriteManifest(*plan, seg);
  ASSERT_TRUE(memory::ReadManifest(seg).ok());
  // Every 8-byte word of the header and the record, set to huge values.
  for (size_t word = 1; word < (64 + 56) / 8; ++word) {
    std::vector<std::byte> broken(seg.begin(), seg.end());
    std::vector<uint64_t> aligned(broken.size() / 8 + 1);
    std::memcpy(aligned.data(), broken.data(), broken.size());
    aligned[word] = ~0ull - 3;
    auto m = memory::ReadManifest(
        std::span(reinterpret_cast<const std::byte*>(aligned.data()), broken.size()));
    EXPECT_FALSE(m.ok()) << "word " << word;
  }
  EXPECT_FALSE(memory::ReadManifest(seg.first(10)).ok());
  // A GPU's: the manifest alone in hand, the segment's size told.
  const auto tables = seg.first(plan->manifest_bytes);
  EXPECT_FALSE(memory::ReadManifest(tables).ok());  // its data is not in these bytes
  auto gpu = memory::ReadManifest(tables, plan->total_bytes);
  ASSERT_TRUE(gpu.ok()) << gpu.error().message();
  EXPECT_EQ(gpu->tensors[0].offset, plan->tensors[0].offset);
  EXPECT_FALSE(memory::ReadManifest(tables, plan->total_bytes - 1).ok());
  EXPECT_FALSE(memory::ReadManifest(tables.first(64), plan->total_bytes).ok());
}

TEST(Manifest, VisitingHandsOverEveryTensorAndStopsAtTheVisitorsError) {
  const std::vector<uint64_t> shape = {2};
  auto plan = memory::PlanSegment(
      {{"a", "F32", shape, 8, 0}, {"b", "BF16", shape, 4, 0}, {"c", "U8", shape, 2, 0}});
  ASSERT_TRUE(plan.ok());
  std::vector<uint64_t> words(plan->total_bytes / 8 + 1);
  std::span<std::byte> seg(reinterpret_cast<std::byte*>(words.data()), plan->total_bytes);
  memory::WriteManifest(*plan, seg);
  auto summary = memory::ReadManifestSummary(seg, seg.size());
  ASSERT_TRUE(summary.ok()) << summary.error().message();
  EXPECT_EQ(summary->tensor_count, 3u);
  EXPECT_EQ(summary->data_offset, plan->data_offset);
  EXPECT_EQ(summary->manifest_bytes, plan->manifest_bytes);
  std::string seen;
  ASSERT_TRUE(memory::VisitTensors(seg, seg.size(), [&](const memory::TensorRecord& t) {
                seen += std::string(t.name) + ":" + std::string(t.dtype) + " ";
                return OkStatus();
              }).ok());
  EXPECT_EQ(seen, "a:F32 b:BF16 c:U8 ");
  seen.clear();
  Status stopped = memory::VisitTensors(seg, seg.size(), [&](const memory::TensorRecord& t) {
    seen += t.name;
    return t.name == "b" ? Status(Error("no b here")) : OkStatus();
  });
  ASSERT_FALSE(stopped.ok());
  EXPECT_EQ(stopped.error().message(), "no b here");
  EXPECT_EQ(seen, "ab");
  EXPECT_FALSE(memory::ReadManifestSummary(seg.first(10), seg.size()).ok());
}

TEST(Manifest, ATerabyteOfClaimedRecordsIsAnErrorNotAnAbort) {
  // Whoever sends a segment can make it a sparse memfd of any size, which
  // costs nothing, and claim a table that fills it.
  constexpr uint64_t kClaimed = 1ull << 40;
  memory::UniqueFd fd(::memfd_create("sparse", MFD_CLOEXEC));
  ASSERT_TRUE(fd.valid());
  ASSERT_EQ(::ftruncate(fd.get(), static_cast<off_t>(kClaimed)), 0);
  void* p =
      ::mmap(nullptr, kClaimed, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_NORESERVE, fd.get(), 0);
  ASSERT_NE(p, MAP_FAILED);
  // magic, manifest bytes, tensor count, dimensions, string bytes, data
  // offset, data bytes, zero: every record of zeros, the first one wrong.
  const uint64_t header[8] = {0, kClaimed, (kClaimed - 64) / 56, 0, 0, kClaimed, 0, 0};
  std::memcpy(p, header, sizeof header);
  std::memcpy(p, "WDSEG01", 8);
  auto m = memory::ReadManifest(std::span(static_cast<const std::byte*>(p), kClaimed));
  EXPECT_FALSE(m.ok());
  ::munmap(p, kClaimed);
}

TEST(CacheKey, DifferencesAreNamedAndTrustSkipsOnlyTheContent) {
  protocol::CacheKey held = protocol::MakeKey("xxh3-128:aa", {}, "replicate", "xxh3-64:0");
  protocol::CacheKey wanted = held;
  EXPECT_TRUE(protocol::Compare(held, wanted).empty());
  wanted.checkpoint = "xxh3-128:bb";
  wanted.tp_rank = 1;
  auto diff = protocol::Compare(held, wanted);
  ASSERT_EQ(diff.size(), 2u);
  EXPECT_EQ(diff[0].Describe(), "checkpoint: daemon has xxh3-128:aa, engine wants xxh3-128:bb");
  EXPECT_EQ(diff[1].Describe(), "tp_rank: daemon has 0, engine wants 1");
  EXPECT_EQ(protocol::Compare(held, wanted, /*skip_checkpoint=*/true).size(), 1u);
  auto back = protocol::KeyFromJson(protocol::ToJson(wanted));
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(*back, wanted);
  auto j = protocol::ToJson(wanted);
  j["tp_size"] = "two";
  EXPECT_FALSE(protocol::KeyFromJson(j).ok());
  j.erase("tp_size");
  EXPECT_FALSE(protocol::KeyFromJson(j).ok());
}

// The fingerprint mode travels with a preload only when it is not the
// default (a daemon that knows none still serves sampled requests), and
// only its two values are served.
TEST(CacheKey, ProcessingCarriesTheFingerprintModeOnlyWhenFull) {
  protocol::Processing p;
  EXPECT_FALSE(protocol::ToJson(p).contains("fingerprint"));
  p.fingerprint = "full";
  auto back = protocol::ProcessingFromJson(protocol::ToJson(p));
  ASSERT_TRUE(back.ok()) << back.error().message();
  EXPECT_EQ(back->fingerprint, "full");
  nlohmann::json odd = protocol::ToJson(p);
  odd["fingerprint"] = "most";
  auto most = protocol::ProcessingFromJson(odd);  // parsed, then refused as the flags are
  ASSERT_TRUE(most.ok());
  EXPECT_FALSE(protocol::CheckSupported(*most).ok());
  odd["fingerprint"] = 1;
  EXPECT_FALSE(protocol::ProcessingFromJson(odd).ok());
}

TEST(CacheKey, ADeviceForEveryRankOrOneForAll) {
  protocol::Processing p;
  p.tp_size = 3;
  p.device = "cuda:0,cuda:GPU-6f0e1c2a-0000-4a6f-9c1d-1234567890ab,cpu";
  ASSERT_TRUE(protocol::CheckSupported(p).ok());
  EXPECT_EQ(protocol::DeviceOfRank(p, 0), "cuda:0");
  EXPECT_EQ(protocol::DeviceOfRank(p, 1), "cuda:GPU-6f0e1c2a-0000-4a6f-9c1d-1234567890ab");
  EXPECT_EQ(protocol::DeviceOfRank(p, 2), "cpu");
  p.device = "cuda:1";
  EXPECT_EQ(protocol::DeviceOfRank(p, 2), "cuda:1");
  for (const char* bad :
       {"cuda:0,cuda:1", "cuda:0,,cpu", "cuda:0,cuda:1,cuda:2,cuda:3", "cuda:0,gpu1,cpu", ","}) {
    p.device = bad;
    EXPECT_FALSE(protocol::CheckSupported(p).ok()) << bad;
  }
}

TEST(Channel, CarriesMessagesAndOneDescriptor) {
  int fds[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds), 0);
  protocol::Channel a{memory::UniqueFd(fds[0])}, b{memory::UniqueFd(fds[1])};
  auto seg = memory::CreateHostSegment(4096, "test");
  ASSERT_TRUE(seg.ok());
  const std::byte answer{42};
  ASSERT_TRUE((*seg)->Write(0, std::span(&answer, 1)).ok());
  ASSERT_TRUE((*seg)->Seal().ok());
  auto handle = (*seg)->Export();
  ASSERT_TRUE(a.Send({{"type", "acquired"}, {"bytes", 4096}}, &*handle).ok());
  ASSERT_TRUE(a.Send({{"type", "status"}}).ok());
  auto m = b.Receive(1000);
  ASSERT_TRUE(m.ok()) << m.error().message();
  EXPECT_EQ(m->type(), "acquired");
  ASSERT_EQ(m->fds.size(), 1u);
  auto map = memory::MapHostSegment(m->fds[0], 4096);
  ASSERT_TRUE(map.ok());
  EXPECT_EQ((*map)->bytes()[0], std::byte{42});
  auto second = b.Receive(1000);
  ASSERT_TRUE(second.ok());
  EXPECT_TRUE(second->fds.empty());
  EXPECT_FALSE(b.Receive(50).ok());  // nothing more: a timeout, not a hang
}

TEST(Channel, RefusesABodyNestedDeeperThanItsLimit) {
  int fds[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds), 0);
  protocol::Channel a{memory::UniqueFd(fds[0])}, b{memory::UniqueFd(fds[1])};
  auto nested = [](int levels) {
    nlohmann::json v = 1;
    for (int i = 0; i < levels; ++i) v = nlohmann::json::array({v});
    return nlohmann::json{{"type", "status"}, {"x", v}};
  };
  ASSERT_TRUE(a.Send(nested(protocol::kMaxJsonDepth - 1)).ok());
  auto fine = b.Receive(1000);
  ASSERT_TRUE(fine.ok()) << fine.error().message();
  ASSERT_TRUE(a.Send(nested(protocol::kMaxJsonDepth)).ok());
  auto deep = b.Receive(1000);
  ASSERT_FALSE(deep.ok());
  EXPECT_NE(deep.error().message().find("nests deeper"), std::string::npos)
      << deep.error().message();
  // Brackets in strings (an escaped quote among them) are not levels.
  const std::string brackets(100, '[');
  ASSERT_TRUE(a.Send({{"type", "status"}, {"x", "\"" + brackets + "\\" + brackets}}).ok());
  auto quoted = b.Receive(1000);
  ASSERT_TRUE(quoted.ok()) << quoted.error().message();
  EXPECT_EQ(quoted->body["x"], "\"" + brackets + "\\" + brackets);
  // A megabyte of them, unclosed: refused as too deep, not parsed first.
  const std::string body = R"({"type":"status","x":)" + std::string(1 << 19, '[');
  const std::string frame = protocol::FrameHeader(static_cast<uint32_t>(body.size()), 0) + body;
  std::thread writer([&] {  // more than the socket's buffer holds
    for (size_t at = 0; at < frame.size();) {
      const ssize_t n = ::write(fds[0], frame.data() + at, frame.size() - at);
      if (n <= 0) return;
      at += static_cast<size_t>(n);
    }
  });
  auto unclosed = b.Receive(10'000);
  writer.join();
  ASSERT_FALSE(unclosed.ok());
  EXPECT_NE(unclosed.error().message().find("nests deeper"), std::string::npos)
      << unclosed.error().message();
}

// A daemon stopped or hung stops accepting; once its queue is full, a
// blocking connect would wait for it forever.
TEST(Channel, ConnectGivesUpOnAQueueThatStaysFull) {
  TempDir dir;
  const std::string path = dir.Join("s.sock");
  memory::UniqueFd listener(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path.c_str(), sizeof addr.sun_path - 1);
  ASSERT_EQ(::bind(listener.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  ASSERT_EQ(::listen(listener.get(), 0), 0);
  std::vector<memory::UniqueFd> queued;  // never accepted
  while (queued.size() < 64) {
    memory::UniqueFd c(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    if (::connect(c.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
      ASSERT_EQ(errno, EAGAIN);
      break;
    }
    queued.push_back(std::move(c));
  }
  ASSERT_FALSE(queued.empty());
  auto refused = protocol::Connect(path, 200);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.error().message().find("queue is full"), std::string::npos)
      << refused.error().message();
  // A place freed: the next connect gets it, and is usable.
  memory::UniqueFd taken(::accept4(listener.get(), nullptr, nullptr, SOCK_CLOEXEC));
  ASSERT_TRUE(taken.valid());
  auto ch = protocol::Connect(path, 200);
  ASSERT_TRUE(ch.ok()) << ch.error().message();
  ASSERT_TRUE(ch->Send({{"type", "status"}}).ok());
}

// Paths are bytes, JSON is UTF-8: a Latin-1 directory name must arrive
// unchanged, and a malformed encoding is an error, not a guess.
TEST(Channel, PathsArriveAsTheyLeft) {
  for (const std::string& path : {std::string("/models/llama"), std::string("/models/caf\xe9"),
                                  std::string("/m/\xff\x01x")}) {
    nlohmann::json wire = nlohmann::json::parse(protocol::PathToJson(path).dump());
    auto back = protocol::PathFromJson(wire);
    ASSERT_TRUE(back.ok()) << back.error().message();
    EXPECT_EQ(*back, path);
  }
  EXPECT_TRUE(protocol::PathToJson("/models/llama").is_string());
  // No path on disk holds a NUL: one that does would open what comes before it.
  for (const char* bad : {R"({"hex": "abc"})", R"({"hex": "zz"})", R"({"hex": 1})", "3", "{}",
                          R"({"hex": "2f6d002f78"})", R"("/m/\u0000x")"}) {
    EXPECT_FALSE(protocol::PathFromJson(nlohmann::json::parse(bad)).ok()) << bad;
  }
}

TEST(Channel, CarriesTwoDescriptorsInOrderAndRefusesThree) {
  int fds[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds), 0);
  protocol::Channel a{memory::UniqueFd(fds[0])}, b{memory::UniqueFd(fds[1])};
  std::vector<memory::UniqueFd> handles;
  for (std::byte mark : {std::byte{1}, std::byte{2}, std::byte{3}}) {
    auto seg = memory::CreateHostSegment(4096, "test");
    ASSERT_TRUE(seg.ok());
    ASSERT_TRUE((*seg)->Write(0, std::span(&mark, 1)).ok());
    ASSERT_TRUE((*seg)->Seal().ok());
    handles.push_back(std::move((*seg)->Export()).value());
  }
  const std::vector<const memory::UniqueFd*> two = {&handles[1], &handles[0]};
  ASSERT_TRUE(a.Send({{"type", "acquired"}}, two).ok());
  auto m = b.Receive(1000);
  ASSERT_TRUE(m.ok()) << m.error().message();
  ASSERT_EQ(m->fds.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    auto map = memory::MapHostSegment(m->fds[i], 4096);
    ASSERT_TRUE(map.ok());
    EXPECT_EQ((*map)->bytes()[0], std::byte(2 - i));
  }
  const std::vector<const memory::UniqueFd*> three = {&handles[0], &handles[1], &handles[2]};
  EXPECT_FALSE(a.Send({{"type", "acquired"}}, three).ok());
}

// Runs `child` in a child process and returns its exit status; a child
// still running after a minute (hung) is killed and reported as 99.
int RunInChild(const std::function<int()>& child) {
  const pid_t pid = ::fork();
  if (pid == 0) ::_exit(child());
  for (int i = 0; i < 600; ++i) {
    int status = 0;
    if (::waitpid(pid, &status, WNOHANG) == pid)
      return WIFEXITED(status) ? WEXITSTATUS(status) : 98;
    ::usleep(100'000);
  }
  ::kill(pid, SIGKILL);
  ::waitpid(pid, nullptr, 0);
  return 99;
}

TEST(Channel, AWaitInterruptedBySignalsStillEnds) {
  // An engine with a periodic timer: each signal interrupts the wait,
  // which must go on for what is left of it, not start again.
  const int status = RunInChild([] {
    int fds[2];
    if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) != 0) return 2;
    protocol::Channel a{memory::UniqueFd(fds[0])}, b{memory::UniqueFd(fds[1])};
    struct sigaction tick {};
    tick.sa_handler = [](int) {};
    ::sigaction(SIGALRM, &tick, nullptr);  // no SA_RESTART: poll returns EINTR
    const itimerval every_5ms{{0, 5'000}, {0, 5'000}};
    ::setitimer(ITIMER_REAL, &every_5ms, nullptr);
    auto m = b.Receive(300);
    return !m.ok() && m.error().message() == protocol::Channel::kTimedOut ? 0 : 1;
  });
  EXPECT_EQ(status, 0) << (status == 99 ? "the wait never ended" : "not a timeout");
}

TEST(Channel, SaysWhenThisProcessHasNoDescriptorLeft) {
  const int status = RunInChild([] {
    int fds[2];
    if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) != 0) return 2;
    protocol::Channel a{memory::UniqueFd(fds[0])}, b{memory::UniqueFd(fds[1])};
    memory::UniqueFd sent(::memfd_create("sent", MFD_CLOEXEC));
    if (!a.Send({{"type", "x"}}, &sent).ok()) return 3;
    // Every slot below the limit taken.
    const rlimit few{64, 64};
    if (::setrlimit(RLIMIT_NOFILE, &few) != 0) return 4;
    while (::fcntl(0, F_DUPFD, 0) >= 0) {
    }
    auto m = b.Receive(1000);
    if (m.ok()) return 5;
    std::fprintf(stderr, "%s\n", m.error().message().c_str());
    return m.error().message().find("no file descriptor left") != std::string::npos ? 0 : 1;
  });
  EXPECT_EQ(status, 0);
}

// Loads the checkpoint at `path` and checks the load against its files: the
// digest against the fingerprint's, every tensor's bytes against the file's.
void CheckLoadOf(const std::string& path, const loader::LoadOptions& options) {
  auto loaded = loader::LoadCheckpoint(io::PosixFileSystem(), path, options);
  ASSERT_TRUE(loaded.ok()) << loaded.error().message();
  auto fp = fingerprint::FingerprintCheckpoint(io::PosixFileSystem(), path, {});
  ASSERT_TRUE(fp.ok());
  EXPECT_EQ(loaded->checkpoint_digest, fp->digest);
  EXPECT_EQ(loaded->tensors, fp->tensors);
  // Each shard read is named as the fingerprint names it, with the stat
  // signature of the very file read (a full key is checked against it).
  ASSERT_EQ(loaded->read_shards.size(), fp->shards.size());
  for (size_t i = 0; i < fp->shards.size(); ++i) {
    EXPECT_EQ(loaded->read_shards[i].name, fp->shards[i].name);
    EXPECT_EQ(loaded->read_shards[i].signature, fp->shards[i].signature) << fp->shards[i].name;
  }

  auto ckpt = format::OpenCheckpoint(io::PosixFileSystem(), path);
  ASSERT_TRUE(ckpt.ok());
  ASSERT_EQ(loaded->ranks.size(), 1u);
  const auto segment = loaded->ranks[0].segment->readable();
  auto m = memory::ReadManifest(segment);
  ASSERT_TRUE(m.ok());
  for (const auto& shard : ckpt->shards) {
    auto bytes = testing::ReadFileBytes(shard.path);
    for (const auto& t : shard.header.tensors) {
      auto it = std::find_if(m->tensors.begin(), m->tensors.end(),
                             [&](const memory::TensorRecord& r) { return r.name == t.name; });
      ASSERT_NE(it, m->tensors.end());
      ASSERT_EQ(it->bytes, t.bytes());
      EXPECT_EQ(std::memcmp(segment.data() + it->offset,
                            bytes.data() + shard.header.data_offset() + t.begin, t.bytes()),
                0)
          << t.name;
    }
  }
}

void CheckLoadAgainstFiles(const format::SyntheticOptions& made) {
  TempDir dir;
  const std::string path = dir.Join("m");
  ASSERT_TRUE(format::WriteSyntheticCheckpoint(path, made).ok());
  loader::LoadOptions small_reads;
  small_reads.max_inflight = 4;
  small_reads.chunk_bytes = 4096;  // big tensors split into many reads
  CheckLoadOf(path, small_reads);
}

// A shard of U8 tensors of the given sizes, named t0000, t0001, ... after
// `prefix`, each byte from `seed`; laid out in the file in name order, or
// in the reverse of it (the writer lays out in name order).
void WriteShardOfSizes(const std::string& path, const std::string& prefix,
                       const std::vector<uint64_t>& sizes, uint8_t seed, bool reversed) {
  std::string json = "{";
  std::vector<std::byte> data;
  std::vector<uint64_t> begin(sizes.size());
  for (size_t k = 0; k < sizes.size(); ++k) {
    const size_t i = reversed ? sizes.size() - 1 - k : k;
    begin[i] = data.size();
    for (uint64_t b = 0; b < sizes[i]; ++b) data.push_back(std::byte(seed + i * 31 + b * 7));
  }
  for (size_t i = 0; i < sizes.size(); ++i) {
    char name[32];
    std::snprintf(name, sizeof name, "t%04zu", i);
    json += (i ? "," : "") + format::JsonQuote(prefix + name) + ":{\"dtype\":\"U8\",\"shape\":[" +
            std::to_string(sizes[i]) + "],\"data_offsets\":[" + std::to_string(begin[i]) + "," +
            std::to_string(begin[i] + sizes[i]) + "]}";
  }
  json += "}";
  std::vector<std::byte> file(8);
  for (int b = 0; b < 8; ++b) file[b] = std::byte((json.size() >> (8 * b)) & 0xff);
  for (char c : json) file.push_back(std::byte(c));
  file.insert(file.end(), data.begin(), data.end());
  testing::WriteFileBytes(path, file);
}

// Where a worker takes each shard's reads in turn and hashes samples as
// they pass (small tensors: samples are most of the bytes), every sample is
// still taken whole and in name order: tensors of no bytes, under and over
// the sample's KiB, and big ones read in several jobs. The same load where
// the files do not lie in name order, or where a read is smaller than a
// sample, takes samples the other way.
TEST(Loader, SamplesHashedAsTheyAreReadGiveTheFingerprint) {
  std::vector<uint64_t> sizes = {0, 1, 1023, 1024, 1025, 5000, 0, 300000, 17, 700000, 2};
  for (uint64_t i = 0; i < 400; ++i) sizes.push_back(i * 37 % 1500);
  for (const bool reversed : {false, true}) {
    TempDir dir;
    const std::string path = dir.Join("m");
    ASSERT_EQ(::mkdir(path.c_str(), 0755), 0);
    for (int s = 0; s < 3; ++s) {
      WriteShardOfSizes(path + "/model-0000" + std::to_string(s + 1) + "-of-00003.safetensors",
                        "s" + std::to_string(s) + ".", sizes, static_cast<uint8_t>(s),
                        reversed && s == 1);
    }
    for (const uint64_t chunk : {uint64_t{4096}, uint64_t{64 << 10}, uint64_t{512}}) {
      SCOPED_TRACE((reversed ? "one shard reversed, reads of " : "reads of ") +
                   std::to_string(chunk));
      loader::LoadOptions o;
      o.chunk_bytes = chunk;
      o.max_inflight = 2;  // no more workers than shards, on any machine
      CheckLoadOf(path, o);
    }
  }
}

// Tensors kept as stored lie shard by shard, each shard's in its file's
// order (the reversed shard too), each at the next multiple of the
// alignment: so every shard is laid out from its own header alone.
TEST(Loader, TensorsKeptAsStoredLieShardByShardInFileOrder) {
  const std::vector<uint64_t> sizes = {5, 0, 300, 256, 1, 70000, 2};
  TempDir dir;
  const std::string path = dir.Join("m");
  ASSERT_EQ(::mkdir(path.c_str(), 0755), 0);
  for (int s = 0; s < 3; ++s) {
    WriteShardOfSizes(path + "/model-0000" + std::to_string(s + 1) + "-of-00003.safetensors",
                      "s" + std::to_string(2 - s) + ".", sizes, static_cast<uint8_t>(s), s == 1);
  }
  auto loaded = loader::LoadCheckpoint(io::PosixFileSystem(), path);
  ASSERT_TRUE(loaded.ok()) << loaded.error().message();
  auto m = memory::ReadManifest(loaded->ranks[0].segment->readable());
  ASSERT_TRUE(m.ok()) << m.error().message();
  ASSERT_EQ(m->tensors.size(), 3 * sizes.size());
  std::vector<memory::TensorRecord> by_offset = m->tensors;
  std::sort(by_offset.begin(), by_offset.end(),
            [](const auto& a, const auto& b) {  // a tensor of no bytes shares its place
              return std::pair(a.offset, a.bytes) < std::pair(b.offset, b.bytes);
            });
  // Shard 1's names start "s2.", shard 2's "s1." (reversed in its file),
  // shard 3's "s0.": name order is neither shard nor file order.
  std::vector<std::string> expected;
  for (int s = 0; s < 3; ++s) {
    for (size_t k = 0; k < sizes.size(); ++k) {
      const size_t i = s == 1 ? sizes.size() - 1 - k : k;
      char name[32];
      std::snprintf(name, sizeof name, "s%d.t%04zu", 2 - s, i);
      expected.push_back(name);
    }
  }
  uint64_t end = m->data_offset;
  for (size_t i = 0; i < by_offset.size(); ++i) {
    EXPECT_EQ(by_offset[i].name, expected[i]) << "at " << i;
    EXPECT_EQ(by_offset[i].offset % memory::kTensorAlignment, 0u);
    EXPECT_EQ(by_offset[i].offset, (end + memory::kTensorAlignment - 1) / memory::kTensorAlignment *
                                       memory::kTensorAlignment)
        << by_offset[i].name << ": padded no more than to the next multiple";
    end = by_offset[i].offset + by_offset[i].bytes;
  }
  CheckLoadOf(path, {});
}

// A tensor of no bytes at the offset of the one before it, last of a run of
// small neighbours (the reference's rules let it lie there): the run is
// still read to the end of the one before, kept as stored or replicated to
// two ranks.
TEST(Loader, ATensorOfNoBytesLastInARunDoesNotShortenIt) {
  TempDir dir;
  const std::string path = dir.Join("m");
  ASSERT_EQ(::mkdir(path.c_str(), 0755), 0);
  const std::string json = R"({"a":{"dtype":"U8","shape":[5],"data_offsets":[0,5]},)"
                           R"("b":{"dtype":"U8","shape":[0],"data_offsets":[0,0]}})";
  std::vector<std::byte> file(8);
  for (int b = 0; b < 8; ++b) file[b] = std::byte((json.size() >> (8 * b)) & 0xff);
  for (char c : json) file.push_back(std::byte(c));
  for (int v = 1; v <= 5; ++v) file.push_back(std::byte(v));
  testing::WriteFileBytes(path + "/model.safetensors", file);
  auto replicated = transform::ResolveProcessing(2, "keep", "none", "replicate");
  ASSERT_TRUE(replicated.ok()) << replicated.error().message();
  for (const bool split : {false, true}) {
    SCOPED_TRACE(split ? "replicated to two ranks" : "kept as stored");
    loader::LoadOptions o;
    if (split) o.processing = *replicated;
    auto loaded = loader::LoadCheckpoint(io::PosixFileSystem(), path, o);
    ASSERT_TRUE(loaded.ok()) << loaded.error().message();
    ASSERT_EQ(loaded->ranks.size(), split ? 2u : 1u);
    for (const loader::LoadedRank& rank : loaded->ranks) {
      const auto segment = rank.segment->readable();
      auto m = memory::ReadManifest(segment);
      ASSERT_TRUE(m.ok()) << m.error().message();
      ASSERT_EQ(m->tensors.size(), 2u);
      ASSERT_EQ(m->tensors[0].name, "a");
      ASSERT_EQ(m->tensors[0].bytes, 5u);
      for (int v = 0; v < 5; ++v) {
        EXPECT_EQ(segment[m->tensors[0].offset + v], std::byte(v + 1)) << "rank " << rank.rank;
      }
    }
  }
}

// A tensor the index puts in another shard, or one in two shards, fails
// the load before its segment is made, however the load lays it out.
TEST(Loader, ShardsThatDisagreeFailTheLoad) {
  const std::vector<uint64_t> sizes(300, 1000);
  for (const bool twice : {false, true}) {
    SCOPED_TRACE(twice ? "a tensor in two shards" : "the index names another shard");
    TempDir dir;
    const std::string path = dir.Join("m");
    ASSERT_EQ(::mkdir(path.c_str(), 0755), 0);
    WriteShardOfSizes(path + "/a.safetensors", "a.", sizes, 1, false);
    WriteShardOfSizes(path + "/b.safetensors", twice ? "a." : "b.", sizes, 2, false);
    if (!twice) {
      std::string index = "{\"weight_map\":{";
      for (size_t i = 0; i < sizes.size(); ++i) {
        char name[32];
        std::snprintf(name, sizeof name, "t%04zu", i);
        index += std::string(i ? "," : "") + "\"a." + name + "\":\"a.safetensors\",\"b." + name +
                 "\":\"" + (i == 123 ? "a" : "b") + ".safetensors\"";
      }
      testing::WriteFileText(path + "/model.safetensors.index.json", index + "}}");
    }
    // Refused before any room is asked for: a daemon would evict idle
    // models for it.
    int allocations = 0;
    loader::LoadOptions o;
    o.allocate = [&](uint64_t bytes, int) {
      ++allocations;
      return memory::CreateHostSegment(bytes, "disagreeing");
    };
    auto loaded = loader::LoadCheckpoint(io::PosixFileSystem(), path, o);
    ASSERT_FALSE(loaded.ok());
    EXPECT_EQ(allocations, 0);
    EXPECT_NE(loaded.error().message().find(twice ? "t0000" : "b.t0123"), std::string::npos)
        << loaded.error().message();
    EXPECT_NE(
        loaded.error().message().find(twice ? std::string(format::rules::kTensorInTwoShards)
                                            : std::string(format::rules::kIndexTensorMissing)),
        std::string::npos)
        << loaded.error().message();
  }
}

// Big tensors in many small reads, and runs of small tensors of odd sizes
// (each run written at once, its tensors' alignment padding laid out
// between them).
TEST(Loader, DigestEqualsTheFingerprintAndBytesEqualTheFiles) {
  for (const format::SyntheticOptions& made :
       {format::SyntheticOptions{.preset = "llama", .size_bytes = 4 << 20},
        format::SyntheticOptions{.preset = "many-tensors", .tensors = 3000, .shards = 2}}) {
    SCOPED_TRACE(made.preset);
    CheckLoadAgainstFiles(made);
  }
}

// A segment the loader cannot read back, as a GPU's memory is.
class UnreadableSegment final : public memory::Segment {
 public:
  explicit UnreadableSegment(std::unique_ptr<memory::Segment> inner) : inner_(std::move(inner)) {}
  memory::Device device() const override { return inner_->device(); }
  uint64_t size() const override { return inner_->size(); }
  uint64_t reserved_bytes() const override { return inner_->reserved_bytes(); }
  bool huge_pages() const override { return inner_->huge_pages(); }
  Status Write(uint64_t offset, std::span<const std::span<const std::byte>> pieces) override {
    return inner_->Write(offset, pieces);
  }
  Status Seal() override { return inner_->Seal(); }
  bool readable_here() const override { return false; }
  std::span<const std::byte> readable() const override { return {}; }
  Result<memory::UniqueFd> Export() const override { return inner_->Export(); }

 private:
  std::unique_ptr<memory::Segment> inner_;
};

// A load into transparent huge pages has the checkpoint's bytes and digest.
TEST(ShmemHugePages, ALoadIntoThemHasTheCheckpointsBytesAndDigest) {
  ShmemHugePagePolicy policy;
  if (std::string why = SetPolicy(policy, "within_size"); !why.empty()) GTEST_SKIP() << why;
  TempDir dir;
  const std::string path = dir.Join("m");
  ASSERT_TRUE(
      format::WriteSyntheticCheckpoint(path, {.preset = "llama", .size_bytes = 8 << 20}).ok());
  CheckLoadOf(path, {});
  auto loaded = loader::LoadCheckpoint(io::PosixFileSystem(), path);
  ASSERT_TRUE(loaded.ok()) << loaded.error().message();
  EXPECT_TRUE(loaded->ranks[0].segment->transparent_huge_pages());
}

TEST(Loader, DigestIsTheSameWhenTheSegmentCannotBeReadBack) {
  TempDir dir;
  const std::string path = dir.Join("m");
  ASSERT_TRUE(format::WriteSyntheticCheckpoint(path, {.preset = "tiny"}).ok());
  loader::LoadOptions o;
  o.allocate = [](uint64_t bytes, int) -> Result<std::unique_ptr<memory::Segment>> {
    auto inner = memory::CreateHostSegment(bytes, "unreadable");
    if (!inner.ok()) return inner.error();
    return std::unique_ptr<memory::Segment>(new UnreadableSegment(std::move(inner).value()));
  };
  auto loaded = loader::LoadCheckpoint(io::PosixFileSystem(), path, o);
  ASSERT_TRUE(loaded.ok()) << loaded.error().message();
  auto fp = fingerprint::FingerprintCheckpoint(io::PosixFileSystem(), path, {});
  ASSERT_TRUE(fp.ok());
  EXPECT_EQ(loaded->checkpoint_digest, fp->digest);
  // The manifest comes back in host memory, for the daemon to send along.
  auto manifest = memory::ReadManifest(loaded->manifest, loaded->ranks[0].segment->size());
  ASSERT_TRUE(manifest.ok()) << manifest.error().message();
  EXPECT_EQ(manifest->tensors.size(), loaded->tensors);
  auto readable = loader::LoadCheckpoint(io::PosixFileSystem(), path, {});
  ASSERT_TRUE(readable.ok());
  EXPECT_TRUE(readable->manifest.empty());  // a host segment is its own copy
}

TEST(Loader, AnAllocationRefusedIsTheLoadsError) {
  TempDir dir;
  const std::string path = dir.Join("m");
  ASSERT_TRUE(format::WriteSyntheticCheckpoint(path, {.preset = "tiny"}).ok());
  loader::LoadOptions o;
  o.allocate = [](uint64_t, int) -> Result<std::unique_ptr<memory::Segment>> {
    return Error("out of budget");
  };
  auto loaded = loader::LoadCheckpoint(io::PosixFileSystem(), path, o);
  ASSERT_FALSE(loaded.ok());
  EXPECT_EQ(loaded.error().message(), "out of budget");
}

// The workers' buffers stay within what the caller gives them: fewer
// workers where each job needs more, one at least, and the same bytes.
TEST(Loader, WorkersKeepTheirBuffersWithinWhatTheyAreGiven) {
  if (memory::HostCpus() < 2) GTEST_SKIP() << "one CPU: one worker whatever the buffers";
  TempDir dir;
  const std::string path = dir.Join("m");
  ASSERT_TRUE(
      format::WriteSyntheticCheckpoint(path, {.preset = "llama", .size_bytes = 24 << 20}).ok());
  loader::LoadOptions o;
  o.max_inflight = 4;
  auto plenty = loader::LoadCheckpoint(io::PosixFileSystem(), path, o);
  ASSERT_TRUE(plenty.ok()) << plenty.error().message();
  EXPECT_GE(plenty->workers, 2);
  o.buffer_bytes = 1;  // less than any job: one worker still
  auto scant = loader::LoadCheckpoint(io::PosixFileSystem(), path, o);
  ASSERT_TRUE(scant.ok()) << scant.error().message();
  EXPECT_EQ(scant->workers, 1);
  EXPECT_EQ(scant->checkpoint_digest, plenty->checkpoint_digest);
  const auto a = plenty->ranks[0].segment->readable(), b = scant->ranks[0].segment->readable();
  ASSERT_EQ(a.size(), b.size());
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size()), 0);
}

// Progress comes in steps of about a 64th of the load (1 MiB at least),
// also within a job of megabytes (one slow read of it would otherwise
// hold back every report), and ends at the total once.
TEST(Loader, ProgressComesInSmallStepsToTheTotal) {
  TempDir dir;
  const std::string path = dir.Join("m");
  ASSERT_TRUE(
      format::WriteSyntheticCheckpoint(path, {.preset = "llama", .size_bytes = 24 << 20}).ok());
  std::mutex mu;
  std::vector<std::pair<uint64_t, uint64_t>> reports;
  loader::LoadOptions o;
  o.progress = [&](uint64_t done, uint64_t total) {
    std::lock_guard lock(mu);
    reports.emplace_back(done, total);
  };
  auto loaded = loader::LoadCheckpoint(io::PosixFileSystem(), path, o);
  ASSERT_TRUE(loaded.ok()) << loaded.error().message();
  ASSERT_FALSE(reports.empty());
  const uint64_t total = reports.back().second;
  EXPECT_EQ(reports.back().first, total);
  const uint64_t batch = std::max<uint64_t>(total / 64, 1 << 20);
  uint64_t before = 0;
  for (const auto& [done, of] : reports) {
    EXPECT_EQ(of, total);
    EXPECT_GT(done, before);  // no report twice
    EXPECT_LE(done - before, batch + (256 << 10)) << "a report " << done - before << " bytes on";
    before = done;
  }
}

// The control group limits a container sets, as /proc/self/cgroup,
// /proc/self/mountinfo and the mounted files show them: the lowest on the
// group or its ancestors, paths taken relative to what each mount shows.
TEST(HostMemory, TheLowestControlGroupLimitIsTheCeiling) {
  TempDir root;
  auto put = [&](const std::string& rel, const std::string& text) {
    std::filesystem::create_directories(std::filesystem::path(root.Join(rel)).parent_path());
    testing::WriteFileText(root.Join(rel), text);
  };
  // A mountinfo line for a control group file system mounted at `point`
  // with group `group` as its root.
  auto mount = [](const std::string& group, const std::string& point, bool v2) {
    return "35 31 0:32 " + group + " " + point + " rw,relatime shared:9 - " +
           (v2 ? "cgroup2 cgroup2 rw" : "cgroup cgroup rw,memory") + "\n";
  };
  std::string where;
  // cgroup v2: "max" on the group itself, a number on its parent.
  put("v2/a/b/memory.max", "max\n");
  put("v2/a/memory.max", "2147483648\n");
  EXPECT_EQ(memory::CgroupMemoryLimit("0::/a/b\n", mount("/", "/v2", true), root.path(), &where),
            2147483648u);
  EXPECT_EQ(where, root.Join("v2/a/memory.max"));
  // cgroup v1, the memory controller among others: the group's own limit,
  // lower than its ancestors' "unlimited"; and the hierarchical limit in
  // its memory.stat, which counts ancestors the mount may not show.
  put("v1/x/y/memory.limit_in_bytes", "1073741824\n");
  put("v1/memory.limit_in_bytes", "9223372036854771712\n");
  const std::string v1 = mount("/", "/v1", false);
  EXPECT_EQ(memory::CgroupMemoryLimit("5:cpu,cpuacct:/z\n4:memory:/x/y\n", v1, root.path(), &where),
            1073741824u);
  EXPECT_EQ(where, root.Join("v1/x/y/memory.limit_in_bytes"));
  put("v1/x/y/memory.stat", "cache 0\nhierarchical_memory_limit 536870912\nrss 0\n");
  EXPECT_EQ(memory::CgroupMemoryLimit("4:memory:/x/y\n", v1, root.path(), &where), 536870912u);
  EXPECT_EQ(where, root.Join("v1/x/y/memory.stat"));
  // A container's own group mounted as the root, the process in a group
  // below it: its path is taken relative to the mount's root, and a
  // sibling's limit outside that root is never read.
  put("c/memory.limit_in_bytes", "3221225472\n");
  put("c/sub/memory.limit_in_bytes", "2684354560\n");
  put("docker/memory.limit_in_bytes", "1048576\n");
  EXPECT_EQ(memory::CgroupMemoryLimit("4:memory:/docker/0123abcd/sub\n",
                                      mount("/docker/0123abcd", "/c", false), root.path(), &where),
            2684354560u);
  EXPECT_EQ(memory::CgroupMemoryLimit("4:memory:/docker/0123abcd\n",
                                      mount("/docker/0123abcd", "/c", false), root.path(), &where),
            3221225472u);
  // A group outside what the mount shows: nothing read there.
  EXPECT_EQ(memory::CgroupMemoryLimit("4:memory:/elsewhere\n",
                                      mount("/docker/0123abcd", "/c", false), root.path(), &where),
            std::nullopt);
  // A group outside this process's cgroup namespace (the kernel shows it
  // with ".."), and a mount root shown that way: nothing read for them.
  put("up/memory.max", "1048576\n");
  EXPECT_EQ(memory::CgroupMemoryLimit("0::/../up\n", mount("/", "/v2", true), root.path(), &where),
            std::nullopt);
  EXPECT_EQ(memory::CgroupMemoryLimit("0::/a/b\n", mount("/..", "/v2", true), root.path(), &where),
            std::nullopt);
  // A mount covered by a later one at the same place (the whole tree
  // mounted over a container's own group): only the one on top is read,
  // so c/ is the tree's root and c/sub a top-level group, not ours.
  EXPECT_EQ(
      memory::CgroupMemoryLimit("4:memory:/docker/0123abcd/sub\n",
                                mount("/docker/0123abcd", "/c", false) + mount("/", "/c", false),
                                root.path(), &where),
      3221225472u);
  EXPECT_EQ(where, root.Join("c/memory.limit_in_bytes"));
  EXPECT_EQ(
      memory::CgroupMemoryLimit("4:memory:/docker/0123abcd/sub\n",
                                mount("/", "/c", false) + mount("/docker/0123abcd", "/c", false),
                                root.path(), &where),
      2684354560u);
  // A mount point with a space, as mountinfo escapes it.
  put("with space/memory.max", "4294967296\n");
  EXPECT_EQ(
      memory::CgroupMemoryLimit("0::/\n", mount("/", "/with\\040space", true), root.path(), &where),
      4294967296u);
  // No limit anywhere, or nothing readable as one: none.
  put("g/memory.max", "12abc\n");
  EXPECT_EQ(memory::CgroupMemoryLimit("0::/\n", mount("/", "/g", true), root.path(), &where),
            std::nullopt);
  EXPECT_EQ(memory::CgroupMemoryLimit("0::/\n", mount("/", "/nothing", true), root.path(), &where),
            std::nullopt);
  EXPECT_EQ(memory::CgroupMemoryLimit("garbage\n::\n0::relative\n", v1, root.path(), &where),
            std::nullopt);
  EXPECT_EQ(
      memory::CgroupMemoryLimit("4:memory:/x/y\n", "short line\n- cgroup\n", root.path(), &where),
      std::nullopt);
  // This process: never more than RAM, and said where from.
  const memory::MemoryCeiling here = memory::HostMemoryCeiling();
  EXPECT_GT(here.bytes, 0u);
  EXPECT_FALSE(here.source.empty());
}

// The CPU quotas a container sets: the lowest over the group and its
// ancestors, in whole CPUs rounded up, found as the memory limits are.
TEST(HostCpus, TheLowestControlGroupQuotaLimitsThem) {
  TempDir root;
  auto put = [&](const std::string& rel, const std::string& text) {
    std::filesystem::create_directories(std::filesystem::path(root.Join(rel)).parent_path());
    testing::WriteFileText(root.Join(rel), text);
  };
  auto mount = [](const std::string& group, const std::string& point, bool v2) {
    return "32 31 0:29 " + group + " " + point + " rw,relatime shared:8 - " +
           (v2 ? "cgroup2 cgroup2 rw" : "cgroup cgroup rw,cpu,cpuacct") + "\n";
  };
  const std::string v2 = mount("/", "/v2", true);
  // cgroup v2: none on the group, 1.5 CPUs on its parent (2 to run on),
  // 4 on the pod above.
  put("v2/pod/ctr/cpu.max", "max 100000\n");
  put("v2/pod/cpu.max", "400000 100000\n");
  EXPECT_EQ(memory::CgroupCpuLimit("0::/pod/ctr\n", v2, root.path()), 4);
  put("v2/pod/ctr/cpu.max", "150000 100000\n");
  EXPECT_EQ(memory::CgroupCpuLimit("0::/pod/ctr\n", v2, root.path()), 2);
  put("v2/pod/ctr/cpu.max", "5000 100000\n");  // a twentieth: still one
  EXPECT_EQ(memory::CgroupCpuLimit("0::/pod/ctr\n", v2, root.path()), 1);
  // cgroup v1's cpu controller (with cpuacct): -1 is none.
  const std::string v1 = mount("/", "/v1", false);
  put("v1/batch/job/cpu.cfs_quota_us", "-1\n");
  put("v1/batch/job/cpu.cfs_period_us", "100000\n");
  EXPECT_EQ(memory::CgroupCpuLimit("3:memory:/m\n2:cpu,cpuacct:/batch/job\n", v1, root.path()),
            std::nullopt);
  put("v1/batch/cpu.cfs_quota_us", "250000\n");
  put("v1/batch/cpu.cfs_period_us", "50000\n");
  EXPECT_EQ(memory::CgroupCpuLimit("2:cpu,cpuacct:/batch/job\n", v1, root.path()), 5);
  // A hierarchy without the cpu controller is not read for CPUs, whatever
  // its files say; nor is what is not a quota.
  EXPECT_EQ(memory::CgroupCpuLimit("2:cpu,cpuacct:/batch/job\n",
                                   "35 31 0:32 / /v1 rw - cgroup cgroup rw,memory\n", root.path()),
            std::nullopt);
  for (const char* bad : {"max\n", "0 100000\n", "100000 0\n", "1e5 100000\n", "1 2 3\n", ""}) {
    put("bad/cpu.max", bad);
    EXPECT_EQ(memory::CgroupCpuLimit("0::/\n", mount("/", "/bad", true), root.path()), std::nullopt)
        << bad;
  }
  // This process: at least one.
  EXPECT_GE(memory::HostCpus(), 1);
}

// A real control group (cgroup v1's cpu controller, as root): a process
// moved into a group below one limited to one CPU counts one, whatever its
// affinity allows; one whose own group allows half a CPU counts one, not
// none; and 1.5 CPUs count two (told from no limit with 3 CPUs or more).
// The loader runs as many workers as that.
TEST(HostCpus, AProcessInALimitedControlGroupCountsWhatItsQuotaAllows) {
  const std::string mount = "/sys/fs/cgroup/cpu";
  if (::geteuid() != 0 || ::access((mount + "/cpu.cfs_quota_us").c_str(), W_OK) != 0) {
    GTEST_SKIP() << "needs root and cgroup v1's cpu controller at " << mount;
  }
  {
    std::ifstream cgroups("/proc/self/cgroup");
    bool at_root = false;
    for (std::string line; std::getline(cgroups, line);) {
      at_root = at_root || line.ends_with(":cpu:/") || line.ends_with(":cpu,cpuacct:/");
    }
    if (!at_root) GTEST_SKIP() << "this process is not in the cpu hierarchy's root group";
  }
  const std::string parent = mount + "/weightd-test-" + std::to_string(::getpid());
  const std::string child = parent + "/engine";
  auto put = [](const std::string& file, const std::string& text) {
    std::ofstream f(file);
    f << text;
    f.flush();
    return static_cast<bool>(f);
  };
  // Removed however the test ends (a group with no process in it).
  struct Groups {
    std::vector<std::string> made;
    ~Groups() {
      for (auto it = made.rbegin(); it != made.rend(); ++it) {
        EXPECT_EQ(::rmdir(it->c_str()), 0) << *it << ": " << std::strerror(errno);
      }
    }
  } groups;
  for (const std::string& group : {parent, child}) {
    ASSERT_EQ(::mkdir(group.c_str(), 0755), 0) << group << ": " << std::strerror(errno);
    groups.made.push_back(group);
  }
  // What HostCpus says in a process moved into `group`.
  auto cpus_in = [&](const std::string& group) {
    int pipe_fds[2];
    if (::pipe(pipe_fds) != 0) return -1;
    const pid_t pid = ::fork();
    if (pid == 0) {
      ::close(pipe_fds[0]);
      int n = -1;
      if (put(group + "/cgroup.procs", std::to_string(::getpid()))) n = memory::HostCpus();
      (void)!::write(pipe_fds[1], &n, sizeof n);
      ::_exit(0);
    }
    ::close(pipe_fds[1]);
    int n = -2;
    if (pid < 0 || ::read(pipe_fds[0], &n, sizeof n) != sizeof n) n = -2;
    ::close(pipe_fds[0]);
    if (pid > 0) ::waitpid(pid, nullptr, 0);
    return n;
  };
  const int unlimited = cpus_in(child);
  EXPECT_TRUE(put(parent + "/cpu.cfs_period_us", "100000"));
  EXPECT_TRUE(put(parent + "/cpu.cfs_quota_us", "100000"));
  const int under_one = cpus_in(child);
  EXPECT_TRUE(put(child + "/cpu.cfs_period_us", "100000"));
  EXPECT_TRUE(put(parent + "/cpu.cfs_quota_us", "-1"));
  EXPECT_TRUE(put(child + "/cpu.cfs_quota_us", "50000"));
  const int own_half = cpus_in(child);
  EXPECT_TRUE(put(child + "/cpu.cfs_quota_us", "150000"));
  const int own_one_and_a_half = cpus_in(child);

  cpu_set_t set;
  CPU_ZERO(&set);
  ASSERT_EQ(::sched_getaffinity(0, sizeof set, &set), 0);
  const int affinity = CPU_COUNT(&set);
  EXPECT_EQ(unlimited, affinity);
  EXPECT_EQ(under_one, 1);
  EXPECT_EQ(own_half, 1);
  EXPECT_EQ(own_one_and_a_half, std::min(affinity, 2));
}

// The room a control group has left: its limit less what it holds beyond
// the files' page cache (reclaimed before anything is killed; shared
// memory is not on those lists), the least over the group and its
// ancestors.
TEST(HostMemory, RoomIsTheLimitLessWhatTheGroupCannotGiveBack) {
  TempDir root;
  auto put = [&](const std::string& rel, const std::string& text) {
    std::filesystem::create_directories(std::filesystem::path(root.Join(rel)).parent_path());
    testing::WriteFileText(root.Join(rel), text);
  };
  const std::string v2 = "35 31 0:32 / /v2 rw - cgroup2 cgroup2 rw\n";
  const std::string v1 = "35 31 0:32 / /v1 rw - cgroup cgroup rw,memory\n";
  constexpr uint64_t kMiB = 1 << 20;
  // v2: the group holds 600 MiB, 300 of them page cache; its parent, with
  // more room in its limit, holds more.
  put("v2/a/b/memory.max", std::to_string(1024 * kMiB));
  put("v2/a/b/memory.current", std::to_string(600 * kMiB));
  put("v2/a/b/memory.stat", "anon 1\nfile 1\nactive_file " + std::to_string(200 * kMiB) +
                                "\ninactive_file " + std::to_string(80 * kMiB) +
                                "\nshmem 5\nslab_reclaimable " + std::to_string(20 * kMiB) +
                                "\nslab_unreclaimable 7\n");
  put("v2/a/memory.max", std::to_string(2048 * kMiB));
  put("v2/a/memory.current", std::to_string(1000 * kMiB));
  auto room = memory::CgroupMemoryRoom("0::/a/b\n", v2, root.path());
  ASSERT_TRUE(room);
  EXPECT_EQ(room->free, 724 * kMiB);
  EXPECT_EQ(room->held, 300 * kMiB);
  EXPECT_EQ(room->limit, 1024 * kMiB);
  EXPECT_EQ(room->source, root.Join("v2/a/b/memory.max"));
  put("v2/a/memory.current", std::to_string(1900 * kMiB));
  room = memory::CgroupMemoryRoom("0::/a/b\n", v2, root.path());
  ASSERT_TRUE(room);
  EXPECT_EQ(room->free, 148 * kMiB);
  EXPECT_EQ(room->source, root.Join("v2/a/memory.max"));
  // v1: the hierarchy's totals; a group holding more than its limit has
  // no room, not a wrapped-around number.
  put("v1/x/memory.limit_in_bytes", std::to_string(1024 * kMiB));
  put("v1/x/memory.usage_in_bytes", std::to_string(800 * kMiB));
  put("v1/x/memory.stat", "cache 9\nactive_file 1\ntotal_active_file " +
                              std::to_string(300 * kMiB) + "\ntotal_inactive_file " +
                              std::to_string(100 * kMiB) + "\n");
  room = memory::CgroupMemoryRoom("4:memory:/x\n", v1, root.path());
  ASSERT_TRUE(room);
  EXPECT_EQ(room->free, 624 * kMiB);
  put("v1/x/memory.usage_in_bytes", std::to_string(1500 * kMiB));
  room = memory::CgroupMemoryRoom("4:memory:/x\n", v1, root.path());
  ASSERT_TRUE(room);
  EXPECT_EQ(room->free, 0u);
  // No limit: no figure from the groups (the machine's is HostMemoryRoom's).
  put("v2/c/memory.max", "max\n");
  EXPECT_EQ(memory::CgroupMemoryRoom("0::/c\n", v2, root.path()), std::nullopt);
  const std::optional<memory::MemoryRoom> here = memory::HostMemoryRoom();
  ASSERT_TRUE(here);
  EXPECT_GT(here->free, 0u);
  EXPECT_LE(here->free, here->limit);
}

}  // namespace
}  // namespace weightd
