#include "fingerprint/stat_cache.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace weightd::fingerprint {
namespace {

constexpr char kMagic[8] = {'W', 'D', 'S', 'T', 'A', 'T', 'C', '1'};
constexpr uint32_t kVersion = 2;
constexpr char kFileName[] = "fingerprint-stat.cache";
constexpr char kLockName[] = "fingerprint-stat.lock";
// Bounds on what a cache file may claim, checked before trusting it.
constexpr uint64_t kMaxFileBytes = 64ull << 20;
constexpr uint32_t kMaxEntries = 200'000;
constexpr uint32_t kMaxTextBytes = 1 << 20;
constexpr int kLockAttempts = 100;
constexpr useconds_t kLockRetryMicros = 20'000;

// A little-endian reader over untrusted bytes: every read is bounds-checked.
class Reader {
 public:
  explicit Reader(std::string_view data) : data_(data) {}
  bool U32(uint32_t* v) { return Raw(v, 4); }
  bool U64(uint64_t* v) { return Raw(v, 8); }
  bool I64(int64_t* v) { return Raw(v, 8); }
  bool Text(std::string* s) {
    uint32_t len;
    if (!U32(&len) || len > kMaxTextBytes || data_.size() - pos_ < len) return false;
    s->assign(data_.substr(pos_, len));
    pos_ += len;
    return true;
  }
  bool AtEnd() const { return pos_ == data_.size(); }

 private:
  bool Raw(void* v, size_t n) {
    if (data_.size() - pos_ < n) return false;
    std::memcpy(v, data_.data() + pos_, n);
    pos_ += n;
    return true;
  }
  std::string_view data_;
  size_t pos_ = 0;
};

template <typename T>
void Put(std::string& out, T v) {
  out.append(reinterpret_cast<const char*>(&v), sizeof v);
}

void PutText(std::string& out, const std::string& s) {
  Put(out, static_cast<uint32_t>(s.size()));
  out += s;
}

Status MakeDirs(const std::string& dir) {
  std::string partial;
  size_t pos = 0;
  while (pos != std::string::npos) {
    pos = dir.find('/', pos + 1);
    partial = dir.substr(0, pos);
    if (partial.empty()) continue;
    if (::mkdir(partial.c_str(), 0700) != 0 && errno != EEXIST) {
      return Error(partial + ": cannot create the cache directory: " + std::strerror(errno));
    }
  }
  return OkStatus();
}

// Why `dir` is not ours alone, or "" when it is (or does not exist yet).
std::string CheckDirectory(const std::string& dir) {
  struct stat st;
  if (::lstat(dir.c_str(), &st) != 0) {
    return errno == ENOENT ? "" : std::strerror(errno);
  }
  if (!S_ISDIR(st.st_mode)) return "not a directory (or a symlink)";
  if (st.st_uid != ::geteuid()) return "owned by another user";
  if ((st.st_mode & (S_IWGRP | S_IWOTH)) != 0) return "writable by other users";
  return "";
}

}  // namespace

std::string StatCache::DefaultDirectory() {
  if (const char* d = std::getenv("WEIGHTD_CACHE_DIR"); d && *d) return d;
  if (const char* x = std::getenv("XDG_CACHE_HOME"); x && *x) return std::string(x) + "/weightd";
  if (const char* h = std::getenv("HOME"); h && *h) return std::string(h) + "/.cache/weightd";
  return "/tmp/weightd-cache-" + std::to_string(::geteuid());
}

StatCache::Key StatCache::MakeKey(const std::string& kind, const io::StatSignature& sig) {
  return {kind, sig.device, sig.inode, sig.size, sig.mtime_ns, sig.ctime_ns};
}

std::unique_ptr<StatCache> StatCache::Load(const std::string& dir) {
  std::unique_ptr<StatCache> cache(new StatCache(dir));
  if (std::string why = CheckDirectory(dir); !why.empty()) {
    // Another user could plant entries, FIFOs or held locks there: neither
    // read nor write it.
    cache->warning_ = dir + ": stat cache not used: " + why;
    cache->disabled_ = true;
    return cache;
  }
  auto entries = ReadFile(dir + "/" + kFileName, &cache->warning_);
  if (entries) cache->entries_ = std::move(*entries);
  return cache;
}

std::optional<std::map<StatCache::Key, std::string>> StatCache::ReadFile(const std::string& path,
                                                                         std::string* why) {
  // O_NONBLOCK: a FIFO planted here must not hang us (it fails S_ISREG below).
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
  if (fd < 0) {
    if (errno != ENOENT) *why = path + ": ignored: " + std::strerror(errno);
    return errno == ENOENT ? std::optional(std::map<Key, std::string>{}) : std::nullopt;
  }
  struct stat st;
  std::string data;
  bool ok = ::fstat(fd, &st) == 0;
  if (ok && st.st_uid != ::geteuid()) {
    *why = path + ": ignored: owned by another user";
    ok = false;
  } else if (ok && (!S_ISREG(st.st_mode) || static_cast<uint64_t>(st.st_size) > kMaxFileBytes)) {
    *why = path + ": ignored: not a regular file of a sane size";
    ok = false;
  }
  if (ok) {
    data.resize(static_cast<size_t>(st.st_size));
    ok = ::pread(fd, data.data(), data.size(), 0) == static_cast<ssize_t>(data.size());
    if (!ok) *why = path + ": ignored: short read";
  }
  ::close(fd);
  if (!ok) return std::nullopt;
  auto entries = Parse(data, why);
  if (!entries) *why = path + ": ignored: " + *why;
  return entries;
}

std::optional<size_t> StatCache::CountEntries(std::string_view data, std::string* why) {
  auto entries = Parse(data, why);
  if (!entries) return std::nullopt;
  return entries->size();
}

std::optional<std::map<StatCache::Key, std::string>> StatCache::Parse(std::string_view data,
                                                                      std::string* why) {
  std::map<Key, std::string> entries;
  auto corrupt = [&](const char* what) {
    *why = what;
    return std::nullopt;
  };
  if (data.size() < sizeof kMagic + 8) return corrupt("too short");
  uint64_t stored_sum;
  std::memcpy(&stored_sum, data.data() + data.size() - 8, 8);
  std::string_view body(data.data(), data.size() - 8);
  if (XXH3_64bits(body.data(), body.size()) != stored_sum) return corrupt("checksum mismatch");
  if (std::memcmp(body.data(), kMagic, sizeof kMagic) != 0)
    return corrupt("not a weightd cache file");
  Reader r(body.substr(sizeof kMagic));
  uint32_t version, count;
  if (!r.U32(&version) || version != kVersion) return corrupt("unknown version");
  if (!r.U32(&count) || count > kMaxEntries) return corrupt("bad entry count");
  for (uint32_t i = 0; i < count; ++i) {
    std::string kind, digest;
    io::StatSignature sig;
    if (!r.Text(&kind) || !r.U64(&sig.device) || !r.U64(&sig.inode) || !r.U64(&sig.size) ||
        !r.I64(&sig.mtime_ns) || !r.I64(&sig.ctime_ns) || !r.Text(&digest)) {
      return corrupt("truncated entry");
    }
    entries[MakeKey(kind, sig)] = std::move(digest);
  }
  if (!r.AtEnd()) return corrupt("trailing bytes");
  return entries;
}

std::optional<std::string> StatCache::Lookup(const std::string& kind,
                                             const io::StatSignature& sig) const {
  std::lock_guard lock(mu_);
  const Key key = MakeKey(kind, sig);
  if (auto it = added_.find(key); it != added_.end()) return it->second;
  if (auto it = entries_.find(key); it != entries_.end()) return it->second;
  return std::nullopt;
}

void StatCache::Insert(const std::string& kind, const io::StatSignature& sig,
                       const std::string& digest) {
  if (kind.size() > kMaxTextBytes || digest.size() > kMaxTextBytes) return;
  std::lock_guard lock(mu_);
  added_[MakeKey(kind, sig)] = digest;
}

size_t StatCache::size() const {
  std::lock_guard lock(mu_);
  return entries_.size() + added_.size();
}

Status StatCache::Save() {
  // Disk I/O happens outside mu_, so lookups never wait on a slow disk.
  std::map<Key, std::string> added;
  {
    std::lock_guard lock(mu_);
    if (disabled_ || added_.empty()) return OkStatus();
    added = added_;
  }
  WEIGHTD_RETURN_IF_ERROR(MakeDirs(dir_));
  if (std::string why = CheckDirectory(dir_); !why.empty()) {
    return Error(dir_ + ": stat cache not saved: " + why);
  }

  // One writer at a time: re-read under the lock so entries other processes
  // saved since we loaded are kept, then replace the file by rename. A lock
  // held too long is given up on: the cache is an optimization.
  const std::string lock_path = dir_ + "/" + kLockName;
  int lock_fd =
      ::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK, 0600);
  if (lock_fd < 0) return Error(lock_path + ": " + std::strerror(errno));
  bool locked = false;
  for (int attempt = 0; attempt < kLockAttempts && !locked; ++attempt) {
    locked = ::flock(lock_fd, LOCK_EX | LOCK_NB) == 0;
    if (!locked) ::usleep(kLockRetryMicros);
  }
  if (!locked) {
    ::close(lock_fd);
    return Error(lock_path + ": stat cache not saved: another process holds its lock");
  }

  const std::string path = dir_ + "/" + kFileName;
  std::string ignored;
  std::map<Key, std::string> merged =
      ReadFile(path, &ignored).value_or(std::map<Key, std::string>{});
  for (auto& [k, v] : added) merged[k] = v;
  // Keep the file bounded: beyond the limit drop entries (the lowest keys,
  // an arbitrary choice); a dropped entry only costs one more read later.
  while (merged.size() > kMaxEntries) merged.erase(merged.begin());

  std::string out(kMagic, sizeof kMagic);
  Put(out, kVersion);
  Put(out, static_cast<uint32_t>(merged.size()));
  for (const auto& [k, digest] : merged) {
    PutText(out, std::get<0>(k));
    Put(out, std::get<1>(k));
    Put(out, std::get<2>(k));
    Put(out, std::get<3>(k));
    Put(out, std::get<4>(k));
    Put(out, std::get<5>(k));
    PutText(out, digest);
  }
  Put(out, static_cast<uint64_t>(XXH3_64bits(out.data(), out.size())));

  const std::string tmp = path + ".tmp-" + std::to_string(::getpid());
  Status status = OkStatus();
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (fd < 0 || ::write(fd, out.data(), out.size()) != static_cast<ssize_t>(out.size()) ||
      ::fsync(fd) != 0) {
    status = Error(tmp + ": cannot write the stat cache: " + std::strerror(errno));
  }
  if (fd >= 0) ::close(fd);
  if (status.ok() && ::rename(tmp.c_str(), path.c_str()) != 0) {
    status = Error(path + ": cannot replace the stat cache: " + std::strerror(errno));
  }
  if (!status.ok()) ::unlink(tmp.c_str());
  ::flock(lock_fd, LOCK_UN);
  ::close(lock_fd);
  if (status.ok()) {
    std::lock_guard lock(mu_);
    entries_ = std::move(merged);
    for (const auto& [k, v] : added) {
      if (auto it = added_.find(k); it != added_.end() && it->second == v) added_.erase(it);
    }
  }
  return status;
}

}  // namespace weightd::fingerprint
