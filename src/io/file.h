// The one interface through which weightd touches checkpoint files. The
// format layer, the fingerprint and the loaders never call open/pread/stat
// themselves: they go through a FileSystem, so tests and benchmarks can put a
// different one underneath (a latency-adding FUSE mount is just another path;
// an in-memory file system is just another subclass).
//
// Thread safety: a FileSystem and every RandomAccessFile it opens are safe for
// concurrent use from many threads; reads are positioned and share no cursor.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "weightd/result.h"

namespace weightd::io {

// What identifies one version of a file without reading it. Two stats that
// give equal signatures are taken to be the same bytes (the fingerprint's
// stat shortcut relies on this). A rewrite that keeps size, mtime and ctime
// is invisible to it, which needs privileges to arrange.
struct StatSignature {
  uint64_t device = 0;
  uint64_t inode = 0;
  uint64_t size = 0;
  int64_t mtime_ns = 0;
  int64_t ctime_ns = 0;
  // On a loop device, which attachment the file was seen through: its
  // disk sequence number (Linux 5.15), new at every attach and unique for
  // the boot, the same in every mount namespace; 0 on any other device,
  // or where the kernel does not say.
  uint64_t disk_sequence = 0;

  bool operator==(const StatSignature&) const = default;
};

class RandomAccessFile {
 public:
  RandomAccessFile() = default;
  RandomAccessFile(const RandomAccessFile&) = delete;
  RandomAccessFile& operator=(const RandomAccessFile&) = delete;
  virtual ~RandomAccessFile() = default;

  virtual const std::string& path() const = 0;

  // The size when the file was opened.
  virtual uint64_t size() const = 0;

  // Reads exactly dst.size() bytes starting at `offset`. Reading past the end
  // is an error that says so (the file is shorter than its header claims, or
  // it shrank while we read it).
  virtual Status ReadExactly(uint64_t offset, std::span<std::byte> dst) const = 0;

  // The file's signature now (not at open time).
  virtual Result<StatSignature> Stat() const = 0;

  // Whether every byte of the file is in the page cache now, so that no
  // read of it waits for storage (until the kernel evicts some); false
  // where that cannot be told.
  virtual bool InPageCache() const { return false; }
};

enum class EntryType { kRegular, kDirectory, kSymlink, kOther };

struct DirEntry {
  std::string name;
  EntryType type = EntryType::kOther;
};

// Which symlinks an open may follow on its way to the file.
enum class Symlinks {
  kFollow,  // any: a path as the user gave it
  // None as the file itself: a name from a directory's listing, which is to
  // be the regular file the listing saw.
  kNotTheFile,
  // None anywhere: a path RealPath gave, where a symlink found now was put
  // there after the path was checked (against a shard's escape, say).
  kNone,
};

class FileSystem {
 public:
  FileSystem() = default;
  FileSystem(const FileSystem&) = delete;
  FileSystem& operator=(const FileSystem&) = delete;
  virtual ~FileSystem() = default;

  // A regular file, opened for reading; anything else is an error.
  virtual Result<std::unique_ptr<RandomAccessFile>> Open(const std::string& path,
                                                         Symlinks symlinks) = 0;
  Result<std::unique_ptr<RandomAccessFile>> Open(const std::string& path) {
    return Open(path, Symlinks::kFollow);
  }

  // Reaches the file as Open does: following the symlinks `symlinks` lets
  // it (all, for the one-argument form).
  virtual Result<StatSignature> Stat(const std::string& path, Symlinks symlinks) = 0;
  Result<StatSignature> Stat(const std::string& path) { return Stat(path, Symlinks::kFollow); }
  virtual Result<bool> IsDirectory(const std::string& path) = 0;
  virtual Result<bool> Exists(const std::string& path) = 0;

  // Entries of a directory, without "." and "..", in no particular order.
  virtual Result<std::vector<DirEntry>> ListDirectory(const std::string& path) = 0;

  // The absolute path with every symlink resolved.
  virtual Result<std::string> RealPath(const std::string& path) = 0;
};

// The host's file system, through POSIX calls.
FileSystem& PosixFileSystem();

// A path this process is making (a folder a checkpoint is staged in, a file
// written under a temporary name), removed when this goes unless Keep() was
// called: however the making ends short of that, an exception included.
// While one lives, its path is listed, so that a process a signal ends can
// remove it first (RemoveUnfinishedPaths). A folder is expected flat: its
// files, then itself.
class UnfinishedPath {
 public:
  // Makes the path with `make` (a mkdir, an open with O_EXCL: true where it
  // made the path) and lists it, one step as a signal's removal sees it:
  // the removal never finds the path listed before it exists, when a name
  // already taken (by another process, or a user's folder) would go with
  // it, nor made and not yet listed, when it would stay. Where `make` makes
  // nothing, nullptr, with errno as `make` left it.
  static std::unique_ptr<UnfinishedPath> Make(std::string path, const std::function<bool()>& make);

  UnfinishedPath(const UnfinishedPath&) = delete;
  UnfinishedPath& operator=(const UnfinishedPath&) = delete;
  ~UnfinishedPath();

  // Nothing to remove, from now on, when this goes or a signal ends the
  // process: the path was renamed into place, or is the process's result
  // to keep. Off the list.
  void Keep();

 private:
  explicit UnfinishedPath(std::string path);  // not listed until Make lists it

  std::string path_;
  bool listed_ = false;  // guarded by the list's lock
};

// Removes every path an UnfinishedPath lists now. For a thread that takes
// the signals that end the process, once, just before it ends it: what the
// process goes on doing meanwhile (writing into the folder, renaming it or
// the file into place) fails, and an UnfinishedPath made or destroyed from
// then on waits for the end.
void RemoveUnfinishedPaths();

// `path` without the slashes it ends with ("d/" is "d"; "/" stays): what
// is added to the name then goes beside the folder, not inside it.
std::string WithoutTrailingSlashes(std::string path);

// Joins a directory and a relative name with exactly one '/'.
std::string JoinPath(const std::string& dir, const std::string& name);

// The last component of a path ("a/b/c.safetensors" -> "c.safetensors").
std::string BaseName(const std::string& path);

// All but the last component ("a/b/c" -> "a/b", "c" -> ".", "/c" -> "/").
std::string DirName(const std::string& path);

}  // namespace weightd::io
