// The fingerprint's stat shortcut: a persistent map from a shard's stat
// signature (device, inode, size, mtime, ctime) to the digest computed for
// it, so an unchanged shard costs one stat instead of reads.
//
// What it cannot see: a rewrite that keeps the size and both timestamps.
// ctime cannot be set by a user, but timestamps move in clock ticks (and in
// whole seconds on some file systems), so a rewrite right after a change
// could keep them: the fingerprint does not cache files changed in the last
// two seconds (Options::racy_seconds). On NFS the client's attribute cache (actimeo) may show the
// old signature for a few seconds after another host rewrote the file; a warm fingerprint in that
// window returns the old digest.
//
// The cache file lives in one directory ($WEIGHTD_CACHE_DIR, else
// $XDG_CACHE_HOME/weightd, else ~/.cache/weightd), which must be ours and
// writable by no one else (else the cache is not used at all). It is never
// trusted blindly: a file owned by another user, not a regular file, with a
// bad magic, version, length or checksum is ignored (and replaced at the
// next save). Saves merge with what
// is on disk under an exclusive lock and replace the file by rename, so
// concurrent fingerprints never corrupt it.
//
// Thread safety: Lookup and Insert may be called from many threads at once.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>

#include "io/file.h"
#include "weightd/result.h"

namespace weightd::fingerprint {

class StatCache {
 public:
  // The directory the cache lives in, from the environment.
  static std::string DefaultDirectory();

  // Loads the cache in `dir` (creating nothing yet). A missing file is an
  // empty cache; an untrustworthy one is an empty cache plus a warning().
  static std::unique_ptr<StatCache> Load(const std::string& dir);

  StatCache(const StatCache&) = delete;
  StatCache& operator=(const StatCache&) = delete;

  // `kind` separates digests of different modes ("sampled", "full").
  std::optional<std::string> Lookup(const std::string& kind, const io::StatSignature& sig) const;
  void Insert(const std::string& kind, const io::StatSignature& sig, const std::string& digest);

  // Writes the entries (merged with the file's current ones) back.
  Status Save();

  // Why the file on disk was ignored, or empty.
  const std::string& warning() const { return warning_; }
  size_t size() const;

  // A cache file's bytes -> how many entries it holds, or nullopt with
  // `why` set when they are not a cache file this version wrote intact.
  // (The fuzz target's entry point: the bytes are untrusted.)
  static std::optional<size_t> CountEntries(std::string_view data, std::string* why);

 private:
  explicit StatCache(std::string dir) : dir_(std::move(dir)) {}

  using Key = std::tuple<std::string, uint64_t, uint64_t, uint64_t, int64_t, int64_t>;
  static Key MakeKey(const std::string& kind, const io::StatSignature& sig);
  // Reads and verifies the file; nullopt with `why` set when untrustworthy.
  static std::optional<std::map<Key, std::string>> ReadFile(const std::string& path,
                                                            std::string* why);
  static std::optional<std::map<Key, std::string>> Parse(std::string_view data, std::string* why);

  const std::string dir_;
  mutable std::mutex mu_;
  std::map<Key, std::string> entries_;
  std::map<Key, std::string> added_;
  std::string warning_;
  bool disabled_ = false;  // the directory is not ours alone
};

}  // namespace weightd::fingerprint
