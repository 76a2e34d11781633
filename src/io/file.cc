#include "io/file.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdio>  // renameat2
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>

namespace weightd::io {
namespace {

std::string ErrnoText(int err) { return std::strerror(err); }

// The pages of a file's first `size` bytes in the page cache, by
// cachestat(2); nullopt where the kernel has no such call (before 6.5) or
// refuses it. Its structures are spelled here: older kernel headers lack
// them.
std::optional<uint64_t> CachedPages(int fd, uint64_t size) {
#if defined(__x86_64__) || defined(__aarch64__)
  constexpr long kCachestat = 451;  // the same number in both tables
  struct {
    uint64_t offset;
    uint64_t length;
  } range{0, size};
  struct {
    uint64_t cache, dirty, writeback, evicted, recently_evicted;
  } stat{};
  if (::syscall(kCachestat, static_cast<unsigned>(fd), &range, &stat, 0u) == 0) return stat.cache;
#else
  (void)fd;
  (void)size;
#endif
  return std::nullopt;
}

// A loop device's disk sequence number (Linux 5.15:
// /sys/dev/block/7:N/diskseq), new at every attach; 0 for any other device.
// Only loop devices are attached again to other contents under the same
// number as a matter of course (a read-only image each time); a disk's
// number also moves at every boot, which would cost every cache entry of
// every disk at every reboot.
//
// Each loop device's file stays open and is read again at every call (a
// sysfs file reads its current value at offset 0): one pread, where
// opening it each time cost a stat 9 µs instead of 0.5. Its inode is
// checked first: a process that closed descriptors it did not open may
// have the number reused for another file.
uint64_t DiskSequence(dev_t dev) {
  constexpr unsigned kLoopMajor = 7;
  if (major(dev) != kLoopMajor) return 0;
  struct File {
    int fd = -1;
    ino_t inode = 0;
  };
  static std::mutex mu;
  static std::map<dev_t, File>* open_files = new std::map<dev_t, File>;  // never freed
  constexpr size_t kMostDevices = 256;
  auto read_number = [](const File& f) -> uint64_t {
    struct stat st;
    if (::fstat(f.fd, &st) != 0 || st.st_ino != f.inode) return 0;
    char text[32];
    const ssize_t n = ::pread(f.fd, text, sizeof text - 1, 0);
    if (n <= 0) return 0;
    text[n] = '\0';
    char* end = nullptr;
    const unsigned long long v = std::strtoull(text, &end, 10);
    return end != text ? v : 0;
  };
  std::lock_guard lock(mu);
  if (auto it = open_files->find(dev); it != open_files->end()) {
    if (const uint64_t seq = read_number(it->second); seq != 0) return seq;
    // The device went away, or the descriptor is not ours any more (then
    // it is left to whoever has it now).
    struct stat st;
    if (::fstat(it->second.fd, &st) == 0 && st.st_ino == it->second.inode) ::close(it->second.fd);
    open_files->erase(it);
  }
  const std::string path = "/sys/dev/block/" + std::to_string(major(dev)) + ":" +
                           std::to_string(minor(dev)) + "/diskseq";
  File f;
  f.fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (f.fd < 0) return 0;
  struct stat st;
  if (::fstat(f.fd, &st) != 0) {
    ::close(f.fd);
    return 0;
  }
  f.inode = st.st_ino;
  const uint64_t seq = read_number(f);
  if (seq != 0 && open_files->size() < kMostDevices) {
    open_files->emplace(dev, f);
  } else {
    ::close(f.fd);
  }
  return seq;
}

// The signature of `path` (relative to `dirfd`; with AT_EMPTY_PATH, of
// `dirfd` itself), the disk's sequence number included.
StatSignature SignatureOf(const struct stat& st) {
  StatSignature sig;
  sig.device = static_cast<uint64_t>(st.st_dev);
  sig.inode = static_cast<uint64_t>(st.st_ino);
  sig.size = static_cast<uint64_t>(st.st_size);
  sig.mtime_ns = static_cast<int64_t>(st.st_mtim.tv_sec) * 1'000'000'000 + st.st_mtim.tv_nsec;
  sig.ctime_ns = static_cast<int64_t>(st.st_ctim.tv_sec) * 1'000'000'000 + st.st_ctim.tv_nsec;
  sig.disk_sequence = DiskSequence(st.st_dev);
  return sig;
}

Result<StatSignature> SignatureAt(int dirfd, const char* path, int flags, const std::string& name) {
  struct stat st;
  if (::fstatat(dirfd, path, &st, flags) != 0) {
    return Error(name + ": stat failed: " + ErrnoText(errno));
  }
  return SignatureOf(st);
}

// A symlink where a Symlinks other than kFollow allows none.
Error SymlinkInTheWay(const std::string& path, const std::string& what) {
  return Error(path + ": cannot " + what + ": a symlink is in its way, which was not there when " +
               "the path was checked (the directory changed meanwhile?)");
}

class PosixFile final : public RandomAccessFile {
 public:
  PosixFile(std::string path, int fd, uint64_t size)
      : path_(std::move(path)), fd_(fd), size_(size) {}
  ~PosixFile() override { ::close(fd_); }

  const std::string& path() const override { return path_; }
  uint64_t size() const override { return size_; }

  Status ReadExactly(uint64_t offset, std::span<std::byte> dst) const override {
    size_t done = 0;
    while (done < dst.size()) {
      if (offset + done > static_cast<uint64_t>(LLONG_MAX)) {
        return Error(path_ + ": read offset out of range");
      }
      ssize_t n =
          ::pread(fd_, dst.data() + done, dst.size() - done, static_cast<off_t>(offset + done));
      if (n < 0) {
        if (errno == EINTR) continue;
        return Error(path_ + ": read of " + std::to_string(dst.size()) + " bytes at offset " +
                     std::to_string(offset) + " failed: " + ErrnoText(errno));
      }
      if (n == 0) {
        return Error(path_ + ": unexpected end of file: wanted " + std::to_string(dst.size()) +
                     " bytes at offset " + std::to_string(offset) + ", file ends after " +
                     std::to_string(offset + done));
      }
      done += static_cast<size_t>(n);
    }
    return OkStatus();
  }

  Result<StatSignature> Stat() const override { return SignatureAt(fd_, "", AT_EMPTY_PATH, path_); }

  // cachestat(2) (Linux 6.5) counts the file's pages in the cache without
  // touching the address space; where it is missing, or counts none at
  // all, mincore(2) over a read-only mapping, a window at a time (its
  // vector is a byte per page), up to the first page not resident. A
  // mapping and its unmapping take the process's memory map for writing:
  // threads that fault pages in (a parser allocating) wait for each, so
  // the mapping is only the fallback. (A file on overlayfs, as in a
  // container's image, keeps its pages under the file below it, which a
  // mapping reaches and cachestat does not: it counts none.)
  bool InPageCache() const override {
    const auto page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
    if (std::optional<uint64_t> cached = CachedPages(fd_, size_)) {
      if (*cached >= (size_ + page - 1) / page) return true;
      if (*cached > 0) return false;
    }
    constexpr uint64_t kWindow = 1ull << 30;
    std::vector<unsigned char> resident;
    for (uint64_t at = 0; at < size_; at += kWindow) {
      const auto length = static_cast<size_t>(std::min(kWindow, size_ - at));
      void* map = ::mmap(nullptr, length, PROT_READ, MAP_SHARED, fd_, static_cast<off_t>(at));
      if (map == MAP_FAILED) return false;  // a file system that cannot map
      resident.resize((length + page - 1) / page);
      const bool ok = ::mincore(map, length, resident.data()) == 0;
      ::munmap(map, length);
      if (!ok || std::any_of(resident.begin(), resident.end(),
                             [](unsigned char r) { return (r & 1) == 0; })) {
        return false;
      }
    }
    return true;
  }

 private:
  const std::string path_;
  const int fd_;
  const uint64_t size_;
};

// openat2(2) with RESOLVE_NO_SYMLINKS (Linux 5.6): no symlink followed
// anywhere in `path`. Where the kernel lacks the call (or a sandbox refuses
// it), O_NOFOLLOW: none as the file itself. Its structure is spelled here:
// older kernel headers lack it.
int OpenFollowingNoSymlink(const std::string& path, int flags) {
#if defined(__x86_64__) || defined(__aarch64__)
  constexpr long kOpenat2 = 437;  // the same number in both tables
  constexpr uint64_t kResolveNoSymlinks = 0x04;
  struct {
    uint64_t flags, mode, resolve;
  } how{static_cast<uint64_t>(flags), 0, kResolveNoSymlinks};
  const long fd = ::syscall(kOpenat2, AT_FDCWD, path.c_str(), &how, sizeof how);
  if (fd >= 0 || (errno != ENOSYS && errno != EPERM)) return static_cast<int>(fd);
#endif
  return ::open(path.c_str(), flags | O_NOFOLLOW);
}

// `path` opened with `flags`, following the symlinks `symlinks` lets it.
int OpenAs(const std::string& path, int flags, Symlinks symlinks) {
  switch (symlinks) {
    case Symlinks::kFollow:
      return ::open(path.c_str(), flags);
    case Symlinks::kNotTheFile:
      return ::open(path.c_str(), flags | O_NOFOLLOW);
    case Symlinks::kNone:
      break;
  }
  return OpenFollowingNoSymlink(path, flags);
}

class Posix final : public FileSystem {
 public:
  using FileSystem::Open;
  using FileSystem::Stat;
  Result<std::unique_ptr<RandomAccessFile>> Open(const std::string& path,
                                                 Symlinks symlinks) override {
    // O_NONBLOCK: opening a FIFO (or a device) must not wait for a writer;
    // it is refused below, and regular files ignore the flag.
    int fd = OpenAs(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK, symlinks);
    if (fd < 0 && errno == ELOOP && symlinks != Symlinks::kFollow) {
      return SymlinkInTheWay(path, "open");
    }
    if (fd < 0) return Error(path + ": cannot open: " + ErrnoText(errno));
    struct stat st;
    if (::fstat(fd, &st) != 0) {
      int err = errno;
      ::close(fd);
      return Error(path + ": stat failed: " + ErrnoText(err));
    }
    if (!S_ISREG(st.st_mode)) {
      ::close(fd);
      return Error(path + ": not a regular file");
    }
    try {
      return std::unique_ptr<RandomAccessFile>(
          new PosixFile(path, fd, static_cast<uint64_t>(st.st_size)));
    } catch (...) {
      ::close(fd);  // out of memory for the object or its path: not owned yet
      throw;
    }
  }

  Result<StatSignature> Stat(const std::string& path, Symlinks symlinks) override {
    if (symlinks == Symlinks::kFollow) return SignatureAt(AT_FDCWD, path.c_str(), 0, path);
    // Through a descriptor that refers to the file without opening it,
    // reached as Open would reach it. O_PATH with O_NOFOLLOW (the fallback
    // where openat2 is missing) gives a symlink itself rather than ELOOP.
    const int fd = OpenAs(path, O_PATH | O_CLOEXEC, symlinks);
    if (fd < 0) {
      if (errno == ELOOP) return SymlinkInTheWay(path, "stat");
      return Error(path + ": stat failed: " + ErrnoText(errno));
    }
    struct stat st;
    const int err = ::fstat(fd, &st) == 0 ? 0 : errno;
    ::close(fd);
    if (err != 0) return Error(path + ": stat failed: " + ErrnoText(err));
    if (S_ISLNK(st.st_mode)) return SymlinkInTheWay(path, "stat");
    return SignatureOf(st);
  }

  Result<bool> IsDirectory(const std::string& path) override {
    struct stat st;
    if (::stat(path.c_str(), &st) != 0) return Error(path + ": " + ErrnoText(errno));
    return S_ISDIR(st.st_mode);
  }

  Result<bool> Exists(const std::string& path) override {
    struct stat st;
    if (::lstat(path.c_str(), &st) == 0) return true;
    if (errno == ENOENT || errno == ENOTDIR) return false;
    return Error(path + ": " + ErrnoText(errno));
  }

  Result<std::vector<DirEntry>> ListDirectory(const std::string& path) override {
    DIR* dir = ::opendir(path.c_str());
    if (dir == nullptr) return Error(path + ": cannot list directory: " + ErrnoText(errno));
    std::vector<DirEntry> entries;
    while (true) {
      errno = 0;
      struct dirent* ent = ::readdir(dir);
      if (ent == nullptr) break;
      std::string name = ent->d_name;
      if (name == "." || name == "..") continue;
      DirEntry entry{name, EntryType::kOther};
      unsigned char type = ent->d_type;
      if (type == DT_UNKNOWN) {
        struct stat st;
        if (::lstat(JoinPath(path, name).c_str(), &st) == 0) {
          type = S_ISREG(st.st_mode)   ? DT_REG
                 : S_ISDIR(st.st_mode) ? DT_DIR
                 : S_ISLNK(st.st_mode) ? DT_LNK
                                       : DT_UNKNOWN;
        }
      }
      if (type == DT_REG) entry.type = EntryType::kRegular;
      if (type == DT_DIR) entry.type = EntryType::kDirectory;
      if (type == DT_LNK) entry.type = EntryType::kSymlink;
      entries.push_back(std::move(entry));
    }
    int err = errno;
    ::closedir(dir);
    if (err != 0) return Error(path + ": cannot list directory: " + ErrnoText(err));
    return entries;
  }

  Result<std::string> RealPath(const std::string& path) override {
    char* resolved = ::realpath(path.c_str(), nullptr);
    if (resolved == nullptr) return Error(path + ": " + ErrnoText(errno));
    std::string out = resolved;
    std::free(resolved);
    return out;
  }
};

}  // namespace

FileSystem& PosixFileSystem() {
  static Posix* fs = new Posix();  // never destroyed: used from static-lifetime threads
  return *fs;
}

namespace {

// Removes the files directly inside `dir`, then `dir` itself; best effort
// (for a folder this process made, never a user's tree).
void RemoveFlatDirectory(const std::string& dir) {
  auto entries = PosixFileSystem().ListDirectory(dir);
  if (entries.ok()) {
    for (const auto& e : *entries) ::unlink(JoinPath(dir, e.name).c_str());
  }
  ::rmdir(dir.c_str());
}

std::mutex unfinished_mu;
std::vector<std::string>& Unfinished() {
  static auto* paths = new std::vector<std::string>;  // never destroyed: a signal may come late
  return *paths;
}

// Removes a file, or a flat folder (moved aside first, then its files and
// itself); nothing where the path is gone. Best effort: a folder it cannot
// list for want of memory stays.
void RemoveMadePath(const std::string& path) noexcept {
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0) return;
  if (!S_ISDIR(st.st_mode)) {
    ::unlink(path.c_str());  // an owner's rename of it into place then fails
    return;
  }
  try {
    // Moved aside first, in one step: an owner's rename of the folder into
    // place (a staged checkpoint) then fails, instead of moving a folder
    // half emptied. Either it was renamed whole already, or it never is.
    // Never onto a folder of that name already there (rename(2) would
    // replace an empty one): the next name then. A file system, kernel or
    // seccomp filter without RENAME_NOREPLACE gets rename(2).
    std::string aside = path + ".removing-" + std::to_string(::getpid());
    for (int n = 1;; ++n) {
      int moved = ::renameat2(AT_FDCWD, path.c_str(), AT_FDCWD, aside.c_str(), RENAME_NOREPLACE);
      if (moved != 0 && (errno == EINVAL || errno == ENOSYS || errno == EPERM)) {
        moved = ::rename(path.c_str(), aside.c_str());
      }
      if (moved == 0) break;
      if (errno != EEXIST || n == 5) return;
      aside = path + ".removing-" + std::to_string(::getpid()) + "-" + std::to_string(n);
    }
    // A file the process makes between the listing and the rmdir leaves
    // the folder not empty: again, a few times.
    for (int attempt = 0; attempt < 5 && ::rmdir(aside.c_str()) != 0 && errno == ENOTEMPTY;
         ++attempt) {
      RemoveFlatDirectory(aside);
    }
  } catch (...) {
    // Out of memory for a name or the folder's listing.
  }
}

}  // namespace

// "dir/" would be moved aside into itself ("dir/.removing-PID"), which
// fails: the folder would stay.
UnfinishedPath::UnfinishedPath(std::string path) : path_(WithoutTrailingSlashes(std::move(path))) {}

std::unique_ptr<UnfinishedPath> UnfinishedPath::Make(std::string path,
                                                     const std::function<bool()>& make) {
  // What can fail is done before the path exists: once made, it is listed
  // by moves into room already there, which cannot throw.
  std::unique_ptr<UnfinishedPath> made(new UnfinishedPath(std::move(path)));
  std::string entry = made->path_;
  std::unique_lock lock(unfinished_mu);  // a signal's removal waits, or is done
  auto& paths = Unfinished();
  paths.reserve(paths.size() + 1);
  if (!make()) {
    const int error = errno;
    lock.unlock();
    made.reset();  // never listed: nothing of ours to remove
    errno = error;
    return nullptr;
  }
  paths.push_back(std::move(entry));
  made->listed_ = true;
  return made;
}

namespace {

// Takes one entry for `path` off the list; the caller holds its lock.
void Unlist(const std::string& path) {
  auto& paths = Unfinished();
  if (auto it = std::find(paths.begin(), paths.end(), path); it != paths.end()) paths.erase(it);
}

}  // namespace

void UnfinishedPath::Keep() {
  std::lock_guard lock(unfinished_mu);  // a signal's removal is done, or waits
  if (listed_) Unlist(path_);
  listed_ = false;
}

UnfinishedPath::~UnfinishedPath() {
  std::lock_guard lock(unfinished_mu);  // a signal's removal is done, or waits
  if (!listed_) return;  // kept, or never made: another's entry of the same name stays
  Unlist(path_);
  RemoveMadePath(path_);
}

void RemoveUnfinishedPaths() {
  // Held for good, not only while they go: the process is ending, and a
  // path listed between this and its end would be left behind. Whoever
  // lists or drops one from now on waits for that end.
  unfinished_mu.lock();
  for (const std::string& path : Unfinished()) RemoveMadePath(path);
}

std::string JoinPath(const std::string& dir, const std::string& name) {
  if (dir.empty()) return name;
  if (dir.back() == '/') return dir + name;
  return dir + "/" + name;
}

std::string WithoutTrailingSlashes(std::string path) {
  while (path.size() > 1 && path.back() == '/') path.pop_back();
  return path;
}

std::string BaseName(const std::string& path) {
  const std::string p = WithoutTrailingSlashes(path);
  size_t slash = p.rfind('/');
  return slash == std::string::npos ? p : p.substr(slash + 1);
}

std::string DirName(const std::string& path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

}  // namespace weightd::io
