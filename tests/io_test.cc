#include <fcntl.h>
#include <gtest/gtest.h>
#include <linux/magic.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <new>
#include <numeric>
#include <stdexcept>
#include <string>
#include <thread>

#include "io/file.h"
#include "io/private_memory.h"
#include "io/read_many.h"
#include "io/worker_pool.h"
#include "test_util.h"

namespace weightd::io {
namespace {

using testing::TempDir;

std::vector<std::byte> Pattern(size_t n) {
  std::vector<std::byte> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<std::byte>((i * 131 + i / 251) & 0xff);
  return v;
}

TEST(PosixFile, ReadPastEndNamesTheFileAndSaysSo) {
  TempDir dir;
  testing::WriteFileBytes(dir.Join("f"), Pattern(100));
  auto file = PosixFileSystem().Open(dir.Join("f"));
  ASSERT_TRUE(file.ok()) << file.error().message();
  EXPECT_EQ((*file)->size(), 100u);
  std::vector<std::byte> buf(20);
  EXPECT_TRUE((*file)->ReadExactly(80, buf).ok());
  Status past = (*file)->ReadExactly(90, buf);
  ASSERT_FALSE(past.ok());
  EXPECT_NE(past.error().message().find("unexpected end of file"), std::string::npos);
  EXPECT_NE(past.error().message().find(dir.Join("f")), std::string::npos);
}

TEST(PosixFile, OpeningADirectoryOrMissingFileFails) {
  TempDir dir;
  EXPECT_FALSE(PosixFileSystem().Open(dir.path()).ok());
  EXPECT_FALSE(PosixFileSystem().Open(dir.Join("nope")).ok());
}

TEST(PosixFile, StatSignatureChangesWhenTheFileIsReplaced) {
  TempDir dir;
  testing::WriteFileBytes(dir.Join("f"), Pattern(10));
  auto before = PosixFileSystem().Stat(dir.Join("f"));
  ASSERT_TRUE(before.ok());
  EXPECT_EQ(before->size, 10u);
  auto again = PosixFileSystem().Stat(dir.Join("f"));
  EXPECT_EQ(*before, *again);
  testing::WriteFileBytes(dir.Join("g"), Pattern(10));
  ASSERT_EQ(::rename(dir.Join("g").c_str(), dir.Join("f").c_str()), 0);
  auto after = PosixFileSystem().Stat(dir.Join("f"));
  ASSERT_TRUE(after.ok());
  EXPECT_NE(before->inode, after->inode);
  EXPECT_FALSE(*before == *after);
}

TEST(PosixFile, InPageCacheSaysWhetherEveryPageIsThere) {
  TempDir dir;
  const std::string path = dir.Join("f");
  // Only where reads go through the page cache, and a clean page may be
  // dropped when asked (not ZFS's ARC, a FUSE mount's direct I/O, 9p).
  struct statfs fs;
  ASSERT_EQ(::statfs(dir.path().c_str(), &fs), 0);
  const bool tmpfs = fs.f_type == TMPFS_MAGIC;
  if (!tmpfs && fs.f_type != EXT4_SUPER_MAGIC && fs.f_type != XFS_SUPER_MAGIC &&
      fs.f_type != BTRFS_SUPER_MAGIC) {
    GTEST_SKIP() << "the temporary directory's file system (" << std::hex << fs.f_type
                 << ") may keep no page cache";
  }
  testing::WriteFileBytes(path, Pattern(3 << 20));
  {
    // Written back, so that the kernel may drop its pages when asked.
    const int fd = ::open(path.c_str(), O_RDONLY);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::fsync(fd), 0);
    ::close(fd);
  }
  auto file = PosixFileSystem().Open(path);
  ASSERT_TRUE(file.ok()) << file.error().message();
  std::vector<std::byte> all((*file)->size());
  ASSERT_TRUE((*file)->ReadExactly(0, all).ok());
  EXPECT_TRUE((*file)->InPageCache());

  if (!tmpfs) {  // tmpfs pages are the file: never dropped
    const int fd = ::open(path.c_str(), O_RDONLY);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED), 0);
    ::close(fd);
    EXPECT_FALSE((*file)->InPageCache());
  }

  testing::WriteFileBytes(dir.Join("empty"), {});
  auto empty = PosixFileSystem().Open(dir.Join("empty"));
  ASSERT_TRUE(empty.ok());
  EXPECT_TRUE((*empty)->InPageCache());  // nothing to wait for
}

// On overlayfs (a container's image) the pages are the file's below: the
// overlay's own page cache holds none of them, and the answer must still
// be yes once the file is read, and no once its pages are dropped.
TEST(PosixFile, InPageCacheSeesThroughAnOverlay) {
  TempDir dir;
  for (const char* d : {"lower", "upper", "work", "merged"}) {
    ASSERT_EQ(::mkdir(dir.Join(d).c_str(), 0755), 0);
  }
  struct statfs lower_fs;
  ASSERT_EQ(::statfs(dir.path().c_str(), &lower_fs), 0);
  if (lower_fs.f_type == TMPFS_MAGIC) GTEST_SKIP() << "tmpfs pages are never dropped";
  testing::WriteFileBytes(dir.Join("lower/f"), Pattern(3 << 20));
  {
    const int fd = ::open(dir.Join("lower/f").c_str(), O_RDONLY);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::fsync(fd), 0);
    ::close(fd);
  }
  const std::string options = "lowerdir=" + dir.Join("lower") + ",upperdir=" + dir.Join("upper") +
                              ",workdir=" + dir.Join("work");
  if (::mount("overlay", dir.Join("merged").c_str(), "overlay", 0, options.c_str()) != 0) {
    GTEST_SKIP() << "cannot mount an overlay here: " << std::strerror(errno);
  }
  struct Unmount {
    std::string at;
    ~Unmount() { ::umount2(at.c_str(), MNT_DETACH); }
  } unmount{dir.Join("merged")};
  {
    auto file = PosixFileSystem().Open(dir.Join("merged/f"));
    ASSERT_TRUE(file.ok()) << file.error().message();
    std::vector<std::byte> all((*file)->size());
    ASSERT_TRUE((*file)->ReadExactly(0, all).ok());
    EXPECT_TRUE((*file)->InPageCache());
    const int fd = ::open(dir.Join("lower/f").c_str(), O_RDONLY);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED), 0);
    ::close(fd);
    EXPECT_FALSE((*file)->InPageCache());
  }
}

class ReadManyTest : public ::testing::TestWithParam<int> {};

TEST_P(ReadManyTest, FillsEveryBufferWhateverTheConcurrency) {
  TempDir dir;
  const auto data = Pattern(1 << 16);
  testing::WriteFileBytes(dir.Join("f"), data);
  auto file = PosixFileSystem().Open(dir.Join("f"));
  ASSERT_TRUE(file.ok());
  std::vector<std::vector<std::byte>> bufs;
  std::vector<ReadRequest> reqs;
  for (uint64_t off = 0; off + 300 <= data.size(); off += 517) bufs.emplace_back(300);
  uint64_t off = 0;
  for (auto& b : bufs) {
    reqs.push_back({file->get(), off, b});
    off += 517;
  }
  ReadStats stats;
  ASSERT_TRUE(ReadMany(reqs, {.max_inflight = GetParam()}, &stats).ok());
  EXPECT_EQ(stats.reads, reqs.size());
  EXPECT_EQ(stats.bytes, reqs.size() * 300);
  for (size_t i = 0; i < bufs.size(); ++i) {
    ASSERT_TRUE(
        std::equal(bufs[i].begin(), bufs[i].end(), data.begin() + static_cast<long>(i * 517)))
        << "request " << i;
  }
}

TEST_P(ReadManyTest, ReportsAFailedRead) {
  TempDir dir;
  testing::WriteFileBytes(dir.Join("f"), Pattern(1000));
  auto file = PosixFileSystem().Open(dir.Join("f"));
  ASSERT_TRUE(file.ok());
  std::vector<std::byte> a(100), b(100);
  std::vector<ReadRequest> reqs = {{file->get(), 0, a}, {file->get(), 950, b}};
  Status s = ReadMany(reqs, {.max_inflight = GetParam()});
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.error().message().find("offset 950"), std::string::npos);
}

INSTANTIATE_TEST_SUITE_P(Inflight, ReadManyTest, ::testing::Values(1, 2, 8, 64));

TEST(StreamFile, DeliversEveryChunkInFileOrder) {
  TempDir dir;
  const auto data = Pattern(1'000'003);
  testing::WriteFileBytes(dir.Join("f"), data);
  auto file = PosixFileSystem().Open(dir.Join("f"));
  ASSERT_TRUE(file.ok());
  for (int inflight : {1, 3, 8}) {
    std::vector<std::byte> seen;
    ReadStats stats;
    Status s = StreamFile(
        **file, {.chunk_bytes = 65'537, .max_inflight = inflight},
        [&](uint64_t offset, std::span<const std::byte> chunk) {
          EXPECT_EQ(offset, seen.size());
          seen.insert(seen.end(), chunk.begin(), chunk.end());
          return OkStatus();
        },
        &stats);
    ASSERT_TRUE(s.ok()) << s.error().message();
    EXPECT_EQ(seen, data) << "inflight " << inflight;
    EXPECT_EQ(stats.bytes, data.size());
    EXPECT_EQ(stats.reads, (data.size() + 65'536) / 65'537);
  }
}

// The consumer's error at the third chunk ends the stream there. So does an
// exception (an allocation refused), which reaches the caller, and the
// workers waiting for their turn are not left waiting.
TEST(StreamFile, StopsAtTheConsumersErrorOrException) {
  TempDir dir;
  testing::WriteFileBytes(dir.Join("f"), Pattern(100'000));
  auto file = PosixFileSystem().Open(dir.Join("f"));
  ASSERT_TRUE(file.ok());
  for (bool throws : {false, true}) {
    int calls = 0;
    auto consume = [&](uint64_t offset, std::span<const std::byte>) -> Status {
      ++calls;
      if (offset < 8192) return OkStatus();
      if (throws) throw std::bad_alloc();
      return Error("enough");
    };
    const StreamOptions options{.chunk_bytes = 4096, .max_inflight = 4};
    if (throws) {
      EXPECT_THROW((void)StreamFile(**file, options, consume), std::bad_alloc);
    } else {
      Status s = StreamFile(**file, options, consume);
      ASSERT_FALSE(s.ok());
      EXPECT_EQ(s.error().message(), "enough");
    }
    EXPECT_EQ(calls, 3) << (throws ? "throwing" : "returning an error");
  }
}

// A slot that throws, on the caller's thread or a pool thread, ends there;
// the others run to their end, and the caller gets the exception once all
// have: not a terminated process, nor a team unwound from under threads
// still running its slots.
TEST(WorkerPool, WhatASlotThrowsReachesTheCallerOnceAllHaveEnded) {
  constexpr int kSlots = 8;
  for (int thrower : {0, 5}) {
    std::atomic<bool> thrown{false};
    std::atomic<int> ended{0};
    try {
      WorkerPool::Shared().RunTeam(kSlots, [&](int slot) {
        if (slot == thrower) {
          thrown = true;
          throw std::runtime_error("slot " + std::to_string(slot));
        }
        // The others end well after the throw (or after a while, should
        // the thrower's slot not have started yet).
        for (int i = 0; i < 500 && !thrown.load(); ++i) ::usleep(1000);
        ::usleep(20'000);
        ended.fetch_add(1);
      });
      ADD_FAILURE() << "nothing thrown from slot " << thrower;
    } catch (const std::runtime_error& e) {
      EXPECT_EQ(std::string(e.what()), "slot " + std::to_string(thrower));
      EXPECT_EQ(ended.load(), kSlots - 1) << "rethrown before the others ended";
    }
  }
  // The pool serves on.
  std::atomic<int> total{0};
  WorkerPool::Shared().RunTeam(kSlots, [&](int) { total.fetch_add(1); });
  EXPECT_EQ(total.load(), kSlots);
}

TEST(WorkerPool, EverySlotRunsOnceAndAllAtOnce) {
  // A barrier all 16 slots must reach: passes only if they run concurrently.
  constexpr int kSlots = 16;
  std::mutex mu;
  std::condition_variable cv;
  int arrived = 0;
  std::vector<int> runs(kSlots, 0);
  WorkerPool::Shared().RunTeam(kSlots, [&](int slot) {
    std::unique_lock lock(mu);
    ++runs[static_cast<size_t>(slot)];
    ++arrived;
    cv.notify_all();
    cv.wait(lock, [&] { return arrived == kSlots; });
  });
  EXPECT_EQ(runs, std::vector<int>(kSlots, 1));
}

// A burst of slots grows the pool; once idle long enough, the threads
// beyond those kept end, and a burst grows it again.
TEST(WorkerPool, ThreadsBeyondThoseKeptEndWhenIdle) {
  WorkerPool& pool = WorkerPool::Shared();
  pool.set_idle_exit(std::chrono::seconds(2));
  // Every slot at once (a barrier all must reach): the pool must hold a
  // thread for each but the caller's.
  constexpr int kSlots = 3 * WorkerPool::kKeptThreads;
  auto burst = [&] {
    std::mutex mu;
    std::condition_variable cv;
    int arrived = 0;
    pool.RunTeam(kSlots, [&](int) {
      std::unique_lock lock(mu);
      ++arrived;
      cv.notify_all();
      cv.wait(lock, [&] { return arrived == kSlots; });
    });
    EXPECT_EQ(arrived, kSlots);
  };
  burst();
  EXPECT_GE(pool.threads(), kSlots - 1);
  // Small teams meanwhile wake every idle thread, and give most of them
  // no work: that is no reason to stay.
  EXPECT_TRUE(testing::Eventually([&] {
    pool.RunTeam(2, [](int) {});
    return pool.threads() == WorkerPool::kKeptThreads;
  })) << pool.threads()
      << " threads";
  burst();
  EXPECT_GE(pool.threads(), kSlots - 1);
  pool.set_idle_exit(std::chrono::minutes(1));
}

TEST(WorkerPool, AChildOfForkRunsItsTeamsAtOnce) {
  // The parent's threads exist and are idle when it forks; the child has
  // none of them and must make its own.
  std::atomic<int> total{0};
  WorkerPool::Shared().RunTeam(8, [&](int) { total.fetch_add(1); });
  ASSERT_EQ(total.load(), 8);
  // Forked once they all wait for work, as a supervisor forks an engine
  // between loads: a fork while threads are busy copies whatever locks
  // they hold (ASan's own, in CI), which no pool can undo.
  for (int i = 0; i < 1000 && WorkerPool::Shared().idle_threads() < WorkerPool::Shared().threads();
       ++i) {
    ::usleep(10'000);
  }
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    // Four slots that must all be running at once; each waits a long
    // while for the others, then gives up (a pool that ran them one after
    // another would wait forever).
    constexpr int kSlots = 4;
    std::mutex mu;
    std::condition_variable cv;
    int arrived = 0;
    bool met = true;
    WorkerPool::Shared().RunTeam(kSlots, [&](int) {
      std::unique_lock lock(mu);
      ++arrived;
      cv.notify_all();
      if (!cv.wait_for(lock, std::chrono::seconds(20), [&] { return arrived == kSlots; })) {
        met = false;
      }
    });
    ::_exit(met ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "the child's slots ran one after another";
}

TEST(WorkerPool, TeamsFromManyThreadsAndReserve) {
  WorkerPool::Shared().Reserve(64);
  std::atomic<int> total{0};
  std::vector<std::thread> callers;
  for (int c = 0; c < 4; ++c) {
    callers.emplace_back([&] {
      for (int round = 0; round < 20; ++round) {
        WorkerPool::Shared().RunTeam(8, [&](int) { total.fetch_add(1); });
      }
    });
  }
  for (auto& t : callers) t.join();
  EXPECT_EQ(total.load(), 4 * 20 * 8);
  for (int i = 0; i < 500 && WorkerPool::Shared().threads() < 64; ++i) ::usleep(10'000);
  EXPECT_GE(WorkerPool::Shared().threads(), 64);
}

TEST(Paths, JoinBaseNameAndDirName) {
  EXPECT_EQ(JoinPath("a", "b"), "a/b");
  EXPECT_EQ(JoinPath("a/", "b"), "a/b");
  EXPECT_EQ(BaseName("/x/y/model.safetensors"), "model.safetensors");
  EXPECT_EQ(BaseName("dir/"), "dir");
  EXPECT_EQ(DirName("/x/y/model.safetensors"), "/x/y");
  EXPECT_EQ(DirName("weightd.toml"), ".");
  EXPECT_EQ(DirName("/weightd.toml"), "/");
}

TEST(PrivateMemory, BigBlocksAreWholeAlignedHugePagesAndSmallOnesWholePages) {
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  const size_t huge = kPrivateHugePageBytes;
  EXPECT_EQ(PrivateMappedBytes(0), page);
  EXPECT_EQ(PrivateMappedBytes(page + 1), 2 * page);
  EXPECT_EQ(PrivateMappedBytes(huge - 1), huge);
  EXPECT_EQ(PrivateMappedBytes(huge + 1), 2 * huge);
  EXPECT_EQ(PrivateMappedBytes(SIZE_MAX - 10), 0u);
  EXPECT_EQ(MapPrivate(SIZE_MAX - 10), nullptr);
  for (const size_t bytes : {size_t{1}, 3 * page + 5, huge, 3 * huge + 17}) {
    std::byte* p = MapPrivate(bytes);
    ASSERT_NE(p, nullptr) << bytes;
    EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % (bytes >= huge ? huge : page), 0u) << bytes;
    // Zeroed and writable to the last byte mapped.
    const size_t mapped = PrivateMappedBytes(bytes);
    EXPECT_EQ(p[0], std::byte{0});
    EXPECT_EQ(p[mapped - 1], std::byte{0});
    p[mapped - 1] = std::byte{1};
    UnmapPrivate(p, bytes);
    // All of it is given back, the last page too.
    errno = 0;
    EXPECT_NE(::msync(p + mapped - page, page, MS_ASYNC), 0) << bytes;
    EXPECT_EQ(errno, ENOMEM) << bytes;
  }
}

TEST(PrivateMemory, AVectorKeepsItsElementsAsItGrowsIntoHugePages) {
  std::vector<uint64_t, PrivateAllocator<uint64_t>> v;
  const size_t n = 3 * kPrivateHugePageBytes / sizeof(uint64_t);
  for (uint64_t i = 0; i < n; ++i) v.push_back(i * 7);
  ASSERT_EQ(v.size(), n);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(v.data()) % kPrivateHugePageBytes, 0u);
  for (uint64_t i = 0; i < n; i += 4099) ASSERT_EQ(v[i], i * 7) << i;
  EXPECT_EQ(v.back(), (n - 1) * 7);
  v.resize(3);
  v.shrink_to_fit();
  EXPECT_EQ(v[2], 14u);
}

// The bytes are mapped while one buffer owns them, and given back once none
// does: moved, the memory stays; replaced or destroyed, it goes.
TEST(PrivateMemory, ABufferOwnsItsMemoryUntilItGoes) {
  const size_t huge = kPrivateHugePageBytes;
  auto mapped = [](const std::byte* p) {
    errno = 0;
    return ::msync(const_cast<std::byte*>(p), 1, MS_ASYNC) == 0;
  };
  PrivateBuffer a(huge + 5);
  ASSERT_NE(a.data(), nullptr);
  EXPECT_EQ(a.size(), huge + 5);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(a.data()) % huge, 0u);
  a.data()[huge + 4] = std::byte{7};
  const std::byte* first = a.data();
  PrivateBuffer b(std::move(a));
  EXPECT_EQ(a.data(), nullptr);  // NOLINT(bugprone-use-after-move): what a move leaves
  EXPECT_EQ(a.size(), 0u);       // NOLINT(bugprone-use-after-move)
  EXPECT_EQ(b.data(), first);
  EXPECT_EQ(b.data()[huge + 4], std::byte{7});
  b = PrivateBuffer(100);
  EXPECT_FALSE(mapped(first));
  const std::byte* second = b.data();
  EXPECT_TRUE(mapped(second));
  { PrivateBuffer gone = std::move(b); }
  EXPECT_FALSE(mapped(second));
  EXPECT_THROW(PrivateBuffer(SIZE_MAX - 10), std::bad_alloc);
}

// A file made new (O_EXCL), as a writer makes its temporary file; false
// where the name is taken.
bool WriteNew(const std::string& path) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) return false;
  const bool written = ::write(fd, "half", 4) == 4;
  ::close(fd);
  return written;
}

// What a process makes goes unless it said to keep it: a file, and a
// folder with files in it, named with a slash at the end too; a kept path
// stays.
TEST(UnfinishedPath, RemovesWhatWasNotKept) {
  TempDir dir;
  const std::string file = dir.Join("f.tmp"), folder = dir.Join("d.partial"),
                    kept = dir.Join("kept");
  {
    auto f = UnfinishedPath::Make(file, [&] { return WriteNew(file); });
    auto d = UnfinishedPath::Make(folder + "/", [&] { return ::mkdir(folder.c_str(), 0755) == 0; });
    auto k = UnfinishedPath::Make(kept, [&] { return WriteNew(kept); });
    ASSERT_TRUE(f && d && k);
    testing::WriteFileText(folder + "/shard", "half");
    k->Keep();
  }
  std::vector<std::string> left;
  for (const auto& e : std::filesystem::directory_iterator(dir.path())) {
    left.push_back(e.path().filename().string());
  }
  EXPECT_EQ(left, std::vector<std::string>{"kept"});
}

// A signal's removal takes every listed path at once, and leaves nothing
// moved aside; what was not listed stays, and so does what was kept. A
// second try at a listed name, which fails, leaves the first listed. The
// process is ending then: a path listed after the removal waits for that
// end, rather than being made and left behind. In a process of its own, as
// the thread that takes the signals does it just before the process ends.
TEST(UnfinishedPath, ASignalsRemovalTakesEveryListedPath) {
  TempDir dir;
  const std::string file = dir.Join("f.tmp"), folder = dir.Join("d.partial");
  const std::string late = dir.Join("late.tmp"), kept = dir.Join("kept");
  testing::WriteFileText(dir.Join("other"), "not listed");
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    // Whatever fails here ends the child, never goes on as the test.
    try {
      auto f = UnfinishedPath::Make(file, [&] { return WriteNew(file); });
      auto d = UnfinishedPath::Make(folder, [&] { return ::mkdir(folder.c_str(), 0755) == 0; });
      auto k = UnfinishedPath::Make(kept, [&] { return WriteNew(kept); });
      if (!f || !d || !k) ::_exit(3);
      k->Keep();
      if (UnfinishedPath::Make(file, [&] { return WriteNew(file); }) != nullptr) ::_exit(3);
      testing::WriteFileText(folder + "/shard", "half");
      RemoveUnfinishedPaths();
      std::atomic<bool> made{false};
      std::thread([&] {
        auto l = UnfinishedPath::Make(late, [&] { return WriteNew(late); });
        made = true;
      }).detach();
      // A late path made is the failure. One made only after this wait
      // would go unseen: the check may miss it on a slow machine, never
      // report it wrongly.
      std::this_thread::sleep_for(std::chrono::seconds(1));
      ::_exit(made ? 2 : 0);
    } catch (...) {
      ::_exit(4);
    }
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status)) << status;
  EXPECT_EQ(WEXITSTATUS(status), 0) << "2: a path was listed and made after the removal";
  std::vector<std::string> left;
  for (const auto& e : std::filesystem::directory_iterator(dir.path())) {
    left.push_back(e.path().filename().string());
  }
  std::sort(left.begin(), left.end());
  EXPECT_EQ(left, (std::vector<std::string>{"kept", "other"}));
}

// A name that cannot be made is not this process's: a folder already
// there (a user's) is never listed, so that a signal's removal, which
// here comes while the making is under way, leaves it and its files. In a
// process of its own, since the removal is for a process that is ending.
TEST(UnfinishedPath, ASignalsRemovalNeverTakesANameThatWasTaken) {
  TempDir dir;
  const std::string theirs = dir.Join("model"), ours = dir.Join("model.partial");
  ASSERT_EQ(::mkdir(theirs.c_str(), 0755), 0);
  testing::WriteFileText(theirs + "/weights", "a user's");
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    try {
      auto made = UnfinishedPath::Make(ours, [&] { return ::mkdir(ours.c_str(), 0755) == 0; });
      if (!made) ::_exit(3);
      // The removal, started while the taken name is being made, ends the
      // process as a signal's does. Had that name been listed before its
      // mkdir failed, the removal would take the user's folder now; since
      // it is not, the removal waits for the making to end. Whichever way
      // it goes, only `ours` may go.
      auto taken = UnfinishedPath::Make(theirs, [&] {
        std::thread([] {
          RemoveUnfinishedPaths();
          ::_exit(0);
        }).detach();
        std::this_thread::sleep_for(std::chrono::milliseconds(300));
        return ::mkdir(theirs.c_str(), 0755) == 0;
      });
      if (taken || errno != EEXIST) ::_exit(5);
      std::this_thread::sleep_for(std::chrono::seconds(5));
      ::_exit(6);
    } catch (...) {
      ::_exit(4);
    }
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status)) << status;
  EXPECT_EQ(WEXITSTATUS(status), 0)
      << "5: the taken name was made (the user's folder removed first?); 6: no removal";
  ASSERT_TRUE(std::filesystem::exists(theirs + "/weights")) << "the user's folder was removed";
  EXPECT_EQ(testing::ReadFileBytes(theirs + "/weights"), testing::Bytes("a user's"));
  EXPECT_FALSE(std::filesystem::exists(ours));
}

// Moving a folder aside never takes the place of one already named as
// the aside would be (an empty one, which rename(2) would replace).
TEST(UnfinishedPath, AFolderIsNeverMovedOntoOneOfItsAsideName) {
  TempDir dir;
  const std::string folder = dir.Join("d.partial");
  const std::string other = folder + ".removing-" + std::to_string(::getpid());
  ASSERT_EQ(::mkdir(other.c_str(), 0755), 0);
  {
    auto d = UnfinishedPath::Make(folder, [&] { return ::mkdir(folder.c_str(), 0755) == 0; });
    ASSERT_TRUE(d);
    testing::WriteFileText(folder + "/shard", "half");
  }
  std::vector<std::string> left;
  for (const auto& e : std::filesystem::directory_iterator(dir.path())) {
    left.push_back(e.path().filename().string());
  }
  EXPECT_EQ(left, std::vector<std::string>{"d.partial.removing-" + std::to_string(::getpid())});
  EXPECT_TRUE(std::filesystem::is_empty(other));
}

}  // namespace
}  // namespace weightd::io
