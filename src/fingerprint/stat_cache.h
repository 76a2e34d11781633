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
// bad magic, version or length is ignored (and replaced at the next save);
// an entry whose checksum does not match is found when a lookup reads it,
// and the file is then not used again by this object (a save keeps the
// sound entries). Saves merge with what is on disk under an exclusive lock
// and replace the file by rename, so concurrent fingerprints never corrupt
// it.
//
// Every engine start looks a few signatures up, however many the file
// holds: its entries are fixed-size records sorted by key, each with its
// own checksum, found by binary search with one small read per step
// (nothing is parsed up front). A save keeps the newest kMaxEntries; the
// oldest saved go first. The file's name carries its format's version, so
// an engine and a daemon of different weightd versions keep one each
// instead of replacing each other's.
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
  // At most this many entries are kept; a save drops the oldest beyond it.
  static constexpr uint32_t kMaxEntries = 100'000;

  // The directory the cache lives in, from the environment.
  static std::string DefaultDirectory();

  // Opens the cache in `dir` (creating nothing yet). A missing file is an
  // empty cache; an untrustworthy one is an empty cache plus a warning().
  static std::unique_ptr<StatCache> Load(const std::string& dir);

  StatCache(const StatCache&) = delete;
  StatCache& operator=(const StatCache&) = delete;
  ~StatCache();  // out of line: File is defined there

  // `kind` separates digests of different modes ("sampled", "full").
  std::optional<std::string> Lookup(const std::string& kind, const io::StatSignature& sig) const;
  void Insert(const std::string& kind, const io::StatSignature& sig, const std::string& digest);

  // Writes the entries (merged with the file's current ones) back.
  Status Save();

  // Why the file on disk was ignored (found so when opened, or at a lookup
  // that met a damaged entry), or what a save dropped from it; or empty.
  std::string warning() const;
  size_t size() const;

  // A cache file's bytes -> how many entries it holds, or nullopt with
  // `why` set when they are not a cache file this version wrote intact.
  // (The fuzz target's entry point: the bytes are untrusted.)
  static std::optional<size_t> CountEntries(std::string_view data, std::string* why);

 private:
  explicit StatCache(std::string dir) : dir_(std::move(dir)) {}

  using Key = std::tuple<std::string, uint64_t, uint64_t, uint64_t, int64_t, int64_t>;
  static Key MakeKey(const std::string& kind, const io::StatSignature& sig);
  struct Stored {
    uint64_t saved_at = 0;  // seconds since the epoch
    std::string value;
    bool now = false;  // added by this save: kept before others of the same second
  };
  // Every entry of a cache file's bytes, checked; nullopt with `why` set
  // when any part is not as this version writes it. With `salvage`, the
  // sound entries of a file whose header is sound (`why` says what was
  // dropped, if anything).
  static std::optional<std::map<Key, Stored>> ParseAll(std::string_view data, std::string* why,
                                                       bool salvage = false);
  // An open cache file; lookups read it without holding mu_.
  struct File;
  // Opens `path` and checks its header: null with `why` empty when there
  // is no file, with `why` set when it is there but untrustworthy.
  static std::shared_ptr<const File> OpenFile(const std::string& path, std::string* why);
  // The file's entry for `key`, by binary search; nullopt with `why` set
  // when an entry it read is damaged.
  static std::optional<std::string> FindIn(const File& file, const Key& key, std::string* why);

  const std::string dir_;
  mutable std::mutex mu_;
  std::shared_ptr<const File> file_;  // null: none
  std::map<Key, std::string> added_;
  mutable std::string warning_;
  mutable bool damaged_ = false;  // a lookup met a damaged entry in file_: not used again
  bool disabled_ = false;         // the directory is not ours alone
};

}  // namespace weightd::fingerprint
