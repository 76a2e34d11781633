#include "fingerprint/stat_cache.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <random>
#include <vector>

namespace weightd::fingerprint {
namespace {

// The file: a header, the records (fixed size, sorted by key, so a lookup
// is a binary search that reads one record a step), then the values each
// record points into. In the host's byte order (another order reads as
// another version).
//
//   header (32 bytes): magic, version u32, count u32, values_bytes u64,
//                      XXH3-64 of the 24 bytes before it
//   record (88 bytes): kind_hash u64 (XXH3-64 of the kind), device, inode,
//                      size u64, mtime_ns, ctime_ns i64, saved_at u64,
//                      value_offset u64, kind_len u32, value_len u32,
//                      value_sum u64 (XXH3-64 of kind and value),
//                      XXH3-64 of the 80 bytes before it
//   values: each record's kind then its value, where value_offset says
constexpr char kMagic[8] = {'W', 'D', 'S', 'T', 'A', 'T', 'C', '1'};
constexpr uint32_t kVersion = 3;
// The version is in the name too: weightd versions that differ keep a file
// each rather than replacing each other's at every save.
constexpr char kFileName[] = "fingerprint-stat-v3.cache";
constexpr char kLockName[] = "fingerprint-stat.lock";
constexpr size_t kHeaderBytes = 32;
constexpr size_t kRecordBytes = 88;
// Bounds on what a cache file may claim, checked before trusting it.
constexpr uint32_t kMaxKindBytes = 256;
constexpr uint32_t kMaxValueBytes = 1 << 20;
constexpr uint64_t kMaxValuesBytes = 64ull << 20;
constexpr int kLockAttempts = 100;
constexpr useconds_t kLockRetryMicros = 20'000;

uint64_t Hash(std::string_view bytes) { return XXH3_64bits(bytes.data(), bytes.size()); }

template <typename T>
T Get(const char* at) {
  T v;
  std::memcpy(&v, at, sizeof v);
  return v;
}

template <typename T>
void Put(std::string& out, T v) {
  out.append(reinterpret_cast<const char*>(&v), sizeof v);
}

struct Header {
  uint32_t count = 0;
  uint64_t values_bytes = 0;
};

// The header's fields, if `bytes` (kHeaderBytes) is one this version wrote
// for a file of `file_bytes`; else why not.
std::optional<Header> DecodeHeader(std::string_view bytes, uint64_t file_bytes, std::string* why) {
  if (bytes.size() < kHeaderBytes) {
    *why = "too short";
    return std::nullopt;
  }
  if (std::memcmp(bytes.data(), kMagic, sizeof kMagic) != 0) {
    *why = "not a weightd cache file";
    return std::nullopt;
  }
  // Another version's file has another name; this is a damaged one.
  if (const uint32_t version = Get<uint32_t>(bytes.data() + 8); version != kVersion) {
    *why = "version " + std::to_string(version) + ", not " + std::to_string(kVersion);
    return std::nullopt;
  }
  if (Get<uint64_t>(bytes.data() + 24) != Hash(bytes.substr(0, 24))) {
    *why = "header checksum mismatch";
    return std::nullopt;
  }
  Header h{Get<uint32_t>(bytes.data() + 12), Get<uint64_t>(bytes.data() + 16)};
  if (h.count > StatCache::kMaxEntries || h.values_bytes > kMaxValuesBytes) {
    *why = "bad entry count or size";
    return std::nullopt;
  }
  // Both bounded above: no overflow.
  if (file_bytes != kHeaderBytes + uint64_t{h.count} * kRecordBytes + h.values_bytes) {
    *why = "length does not match its header";
    return std::nullopt;
  }
  return h;
}

struct Record {
  uint64_t kind_hash = 0;
  io::StatSignature sig;
  uint64_t saved_at = 0;
  uint64_t value_offset = 0;
  uint32_t kind_len = 0, value_len = 0;
  uint64_t value_sum = 0;

  // The order of the file.
  auto Order() const {
    return std::tuple(kind_hash, sig.device, sig.inode, sig.size, sig.mtime_ns, sig.ctime_ns);
  }
};

// A record from its bytes (kRecordBytes), checked against its checksum and
// the values area's size; else why not.
std::optional<Record> DecodeRecord(const char* at, uint64_t values_bytes, std::string* why) {
  if (Get<uint64_t>(at + 80) != Hash(std::string_view(at, 80))) {
    *why = "entry checksum mismatch";
    return std::nullopt;
  }
  Record r;
  r.kind_hash = Get<uint64_t>(at);
  r.sig.device = Get<uint64_t>(at + 8);
  r.sig.inode = Get<uint64_t>(at + 16);
  r.sig.size = Get<uint64_t>(at + 24);
  r.sig.mtime_ns = Get<int64_t>(at + 32);
  r.sig.ctime_ns = Get<int64_t>(at + 40);
  r.saved_at = Get<uint64_t>(at + 48);
  r.value_offset = Get<uint64_t>(at + 56);
  r.kind_len = Get<uint32_t>(at + 64);
  r.value_len = Get<uint32_t>(at + 68);
  r.value_sum = Get<uint64_t>(at + 72);
  // Lengths bounded first: the sum below cannot overflow.
  if (r.kind_len > kMaxKindBytes || r.value_len > kMaxValueBytes || r.value_offset > values_bytes ||
      values_bytes - r.value_offset < uint64_t{r.kind_len} + r.value_len) {
    *why = "entry points outside the file";
    return std::nullopt;
  }
  return r;
}

// What is wrong with a record's kind and value, `bytes` (kind then value,
// as the values area holds them), or null when they are its own.
const char* EntryProblem(const Record& r, std::string_view bytes) {
  if (Hash(bytes) != r.value_sum) return "value checksum mismatch";
  if (Hash(bytes.substr(0, r.kind_len)) != r.kind_hash) return "entry kind does not match its hash";
  return nullptr;
}

void PutRecord(std::string& out, const Record& r) {
  const size_t start = out.size();
  Put(out, r.kind_hash);
  Put(out, r.sig.device);
  Put(out, r.sig.inode);
  Put(out, r.sig.size);
  Put(out, r.sig.mtime_ns);
  Put(out, r.sig.ctime_ns);
  Put(out, r.saved_at);
  Put(out, r.value_offset);
  Put(out, r.kind_len);
  Put(out, r.value_len);
  Put(out, r.value_sum);
  Put(out, Hash(std::string_view(out).substr(start, 80)));
}

// Reads exactly `n` bytes at `offset`.
bool ReadAt(int fd, uint64_t offset, char* into, size_t n) {
  while (n > 0) {
    const ssize_t got = ::pread(fd, into, n, static_cast<off_t>(offset));
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) return false;
    into += got;
    offset += static_cast<uint64_t>(got);
    n -= static_cast<size_t>(got);
  }
  return true;
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

// This boot's identity: disk sequence numbers start over at every boot.
const std::string& BootId() {
  static const std::string id = [] {
    std::string text(64, '\0');
    FILE* f = std::fopen("/proc/sys/kernel/random/boot_id", "re");
    if (f == nullptr) return std::string();
    text.resize(std::fread(text.data(), 1, text.size(), f));
    std::fclose(f);
    return text;
  }();
  return id;
}

StatCache::Key StatCache::MakeKey(const std::string& kind, const io::StatSignature& sig) {
  // A loop device's sequence number, of this boot, is folded into the
  // device: another file system on a loop device an earlier one had
  // (attached again, to another image, whose files may have the same inode
  // numbers, sizes and timestamps, as reproducible builds of read-only
  // images make them) is then another key. A reboot makes every key on a
  // loop device new: one fingerprint reads the files again.
  uint64_t device = sig.device;
  if (sig.disk_sequence != 0) {
    std::string id = BootId();
    Put(id, sig.device);
    Put(id, sig.disk_sequence);
    device = Hash(id);
  }
  return {kind, device, sig.inode, sig.size, sig.mtime_ns, sig.ctime_ns};
}

struct StatCache::File {
  int fd = -1;
  uint32_t count = 0;
  uint64_t values_bytes = 0;
  File() = default;
  File(const File&) = delete;
  File& operator=(const File&) = delete;
  ~File() {
    if (fd >= 0) ::close(fd);
  }
};

std::unique_ptr<StatCache> StatCache::Load(const std::string& dir) {
  std::unique_ptr<StatCache> cache(new StatCache(dir));
  if (std::string why = CheckDirectory(dir); !why.empty()) {
    // Another user could plant entries, FIFOs or held locks there: neither
    // read nor write it.
    cache->warning_ = dir + ": stat cache not used: " + why;
    cache->disabled_ = true;
    return cache;
  }
  const std::string path = dir + "/" + kFileName;
  std::string why;
  cache->file_ = OpenFile(path, &why);
  if (!why.empty()) cache->warning_ = path + ": ignored: " + why;
  return cache;
}

StatCache::~StatCache() = default;

std::shared_ptr<const StatCache::File> StatCache::OpenFile(const std::string& path,
                                                           std::string* why) {
  auto file = std::make_shared<File>();
  // O_NONBLOCK: a FIFO planted here must not hang us (it fails S_ISREG below).
  file->fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
  if (file->fd < 0) {
    if (errno != ENOENT) *why = std::strerror(errno);  // else no file yet: an empty cache
    return nullptr;
  }
  struct stat st;
  char header[kHeaderBytes];
  std::optional<Header> h;
  if (::fstat(file->fd, &st) != 0) {
    *why = std::strerror(errno);
  } else if (st.st_uid != ::geteuid()) {
    *why = "owned by another user";
  } else if (!S_ISREG(st.st_mode)) {
    *why = "not a regular file";
  } else if (!ReadAt(file->fd, 0, header, sizeof header)) {
    *why = "too short";
  } else {
    h = DecodeHeader(std::string_view(header, sizeof header), static_cast<uint64_t>(st.st_size),
                     why);
  }
  if (!h) return nullptr;
  file->count = h->count;
  file->values_bytes = h->values_bytes;
  return file;
}

std::optional<std::string> StatCache::FindIn(const File& file, const Key& key, std::string* why) {
  if (file.count == 0) return std::nullopt;
  const std::string& kind = std::get<0>(key);
  const auto want = std::tuple(Hash(kind), std::get<1>(key), std::get<2>(key), std::get<3>(key),
                               std::get<4>(key), std::get<5>(key));
  auto record = [&](uint32_t i) -> std::optional<Record> {
    char bytes[kRecordBytes];
    if (!ReadAt(file.fd, kHeaderBytes + uint64_t{i} * kRecordBytes, bytes, sizeof bytes)) {
      *why = "short read";
      return std::nullopt;
    }
    return DecodeRecord(bytes, file.values_bytes, why);
  };
  // The first record not below `want`, kept as the search reads it.
  uint32_t lo = 0, hi = file.count;
  std::optional<Record> found;
  while (lo < hi) {
    const uint32_t mid = lo + (hi - lo) / 2;
    auto r = record(mid);
    if (!r) return std::nullopt;
    if (r->Order() < want) {
      lo = mid + 1;
    } else {
      hi = mid;
      found = r;
    }
  }
  if (!found || found->Order() != want || found->kind_len != kind.size()) return std::nullopt;
  std::string bytes(found->kind_len + found->value_len, '\0');
  if (!ReadAt(file.fd, kHeaderBytes + uint64_t{file.count} * kRecordBytes + found->value_offset,
              bytes.data(), bytes.size())) {
    *why = "short read";
    return std::nullopt;
  }
  if (const char* problem = EntryProblem(*found, bytes)) {
    *why = problem;
    return std::nullopt;
  }
  if (std::string_view(bytes).substr(0, found->kind_len) != kind) return std::nullopt;
  return bytes.substr(found->kind_len);
}

std::optional<std::map<StatCache::Key, StatCache::Stored>> StatCache::ParseAll(
    std::string_view data, std::string* why, bool salvage) {
  auto h = DecodeHeader(data, data.size(), why);
  if (!h) return std::nullopt;
  std::map<Key, Stored> entries;
  const std::string_view values = data.substr(kHeaderBytes + size_t{h->count} * kRecordBytes);
  std::optional<Record> previous;
  uint32_t dropped = 0;
  std::string first_problem;
  for (uint32_t i = 0; i < h->count; ++i) {
    std::string problem;
    auto r = DecodeRecord(data.data() + kHeaderBytes + size_t{i} * kRecordBytes, h->values_bytes,
                          &problem);
    std::string_view bytes;
    if (r && !salvage && previous && !(previous->Order() < r->Order())) {
      problem = "entries out of order";
    } else if (r) {
      bytes =
          values.substr(static_cast<size_t>(r->value_offset), r->kind_len + size_t{r->value_len});
      if (const char* p = EntryProblem(*r, bytes)) problem = p;
    }
    if (!problem.empty()) {
      if (!salvage) {
        *why = problem;
        return std::nullopt;
      }
      if (dropped++ == 0) first_problem = problem;
      continue;
    }
    entries[MakeKey(std::string(bytes.substr(0, r->kind_len)), r->sig)] = {
        r->saved_at, std::string(bytes.substr(r->kind_len))};
    previous = r;
  }
  if (dropped > 0) {
    *why = std::to_string(dropped) + (dropped == 1 ? " damaged entry" : " damaged entries") +
           " dropped (" + first_problem + ")";
  }
  return entries;
}

std::optional<size_t> StatCache::CountEntries(std::string_view data, std::string* why) {
  auto entries = ParseAll(data, why);
  if (!entries) return std::nullopt;
  return entries->size();
}

std::optional<std::string> StatCache::Lookup(const std::string& kind,
                                             const io::StatSignature& sig) const {
  const Key key = MakeKey(kind, sig);
  std::shared_ptr<const File> file;
  {
    std::lock_guard lock(mu_);
    if (auto it = added_.find(key); it != added_.end()) return it->second;
    if (damaged_ || file_ == nullptr) return std::nullopt;
    file = file_;
  }
  // Read without the lock: lookups from many threads go at once.
  std::string why;
  auto found = FindIn(*file, key, &why);
  if (!why.empty()) {
    std::lock_guard lock(mu_);
    if (file_ == file) {  // not a file a save has replaced since
      damaged_ = true;
      warning_ = dir_ + "/" + kFileName + ": ignored: " + why;
    }
  }
  return found;
}

void StatCache::Insert(const std::string& kind, const io::StatSignature& sig,
                       const std::string& digest) {
  if (kind.size() > kMaxKindBytes || digest.size() > kMaxValueBytes) return;
  std::lock_guard lock(mu_);
  added_[MakeKey(kind, sig)] = digest;
}

std::string StatCache::warning() const {
  std::lock_guard lock(mu_);
  return warning_;
}

size_t StatCache::size() const {
  std::lock_guard lock(mu_);
  return (damaged_ || file_ == nullptr ? 0 : file_->count) + added_.size();
}

Status StatCache::Save() {
  // Disk I/O happens outside mu_, so lookups never wait on a save.
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

  // Entries another process saved already (the same shards fingerprinted
  // by engines starting at once) need no rewrite of the file: looked up in
  // it as it is now, before the lock and again under it.
  const std::string path = dir_ + "/" + kFileName;
  auto on_disk = [&]() -> std::shared_ptr<const File> {
    std::string why;
    std::shared_ptr<const File> file = OpenFile(path, &why);
    if (file == nullptr) return nullptr;
    for (const auto& [key, value] : added) {
      const std::optional<std::string> found = FindIn(*file, key, &why);
      if (!found || *found != value) return nullptr;
    }
    return file;
  };
  auto adopt = [&](std::shared_ptr<const File> file) {
    std::lock_guard lock(mu_);
    file_ = std::move(file);
    damaged_ = false;
    for (const auto& [key, value] : added) {
      auto it = added_.find(key);
      if (it != added_.end() && it->second == value) added_.erase(it);
    }
  };
  if (auto file = on_disk()) {
    adopt(std::move(file));
    return OkStatus();
  }

  // One writer at a time: re-read under the lock so entries other processes
  // saved since we loaded are kept, then replace the file by rename. A lock
  // held too long is given up on: the cache is an optimization. A lock file
  // removed while held (a clean-up) would let a second writer in: the one
  // locked must still be the one there.
  const std::string lock_path = dir_ + "/" + kLockName;
  int lock_fd = -1;
  bool locked = false;
  for (int attempt = 0; attempt < kLockAttempts && !locked; ++attempt) {
    if (lock_fd < 0) {
      lock_fd =
          ::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK, 0600);
      if (lock_fd < 0) return Error(lock_path + ": " + std::strerror(errno));
    }
    locked = ::flock(lock_fd, LOCK_EX | LOCK_NB) == 0;
    struct stat held, there;
    if (locked && (::fstat(lock_fd, &held) != 0 || ::lstat(lock_path.c_str(), &there) != 0 ||
                   held.st_dev != there.st_dev || held.st_ino != there.st_ino)) {
      locked = false;
      ::close(lock_fd);
      lock_fd = -1;
      continue;
    }
    if (!locked) ::usleep(kLockRetryMicros);
  }
  if (!locked) {
    if (lock_fd >= 0) ::close(lock_fd);
    return Error(lock_path + ": stat cache not saved: another process holds its lock");
  }
  if (auto file = on_disk()) {
    ::close(lock_fd);
    adopt(std::move(file));
    return OkStatus();
  }
  // Temporary files left by writers killed before their rename. Every
  // writer makes its own under the lock and renames it within moments;
  // where a lock is local to each host (NFS mounted local_lock) another's
  // may be in use now: only those a minute old go.
  if (DIR* d = ::opendir(dir_.c_str())) {
    const std::string prefix = std::string(kFileName) + ".tmp-";
    const time_t minute_ago = ::time(nullptr) - 60;
    while (const dirent* e = ::readdir(d)) {
      struct stat st;
      if (std::strncmp(e->d_name, prefix.c_str(), prefix.size()) == 0 &&
          ::fstatat(::dirfd(d), e->d_name, &st, AT_SYMLINK_NOFOLLOW) == 0 &&
          st.st_mtime < minute_ago) {
        ::unlinkat(::dirfd(d), e->d_name, 0);
      }
    }
    ::closedir(d);
  }

  // What is there now: its sound entries, if its header is sound (else it
  // is replaced).
  std::map<Key, Stored> merged;
  std::string dropped;
  std::string unsound;
  if (const auto old = OpenFile(path, &unsound)) {  // checked as a lookup checks it; bounded
    std::string data(
        static_cast<size_t>(kHeaderBytes + uint64_t{old->count} * kRecordBytes + old->values_bytes),
        '\0');
    auto sound = ReadAt(old->fd, 0, data.data(), data.size())
                     ? ParseAll(data, &unsound, /*salvage=*/true)
                     : std::nullopt;
    if (sound) {
      merged = std::move(*sound);
      dropped = unsound;  // what salvaging left out, if anything
    }
  }
  // A time ahead of the clock (the clock set back, another host's clock)
  // counts as now: it must not outrank what this save adds.
  const uint64_t now = static_cast<uint64_t>(::time(nullptr));
  for (auto& [k, v] : merged) v.saved_at = std::min(v.saved_at, now);
  for (auto& [k, v] : added) merged[k] = {now, v, true};

  // Within bounds: the newest saved are kept, what this save adds first.
  std::vector<const std::pair<const Key, Stored>*> kept;
  kept.reserve(merged.size());
  for (const auto& entry : merged) kept.push_back(&entry);
  std::stable_sort(kept.begin(), kept.end(), [](auto* a, auto* b) {
    return std::tie(a->second.saved_at, a->second.now) >
           std::tie(b->second.saved_at, b->second.now);
  });
  uint64_t values_bytes = 0;
  size_t n = 0;
  for (; n < kept.size() && n < kMaxEntries; ++n) {
    const uint64_t bytes = std::get<0>(kept[n]->first).size() + kept[n]->second.value.size();
    if (values_bytes + bytes > kMaxValuesBytes) break;
    values_bytes += bytes;
  }
  kept.resize(n);
  std::vector<std::pair<Record, const std::pair<const Key, Stored>*>> records;
  records.reserve(n);
  for (const auto* entry : kept) {
    const auto& [kind, device, inode, size, mtime, ctime] = entry->first;
    Record r;
    r.kind_hash = Hash(kind);
    r.sig = {.device = device, .inode = inode, .size = size, .mtime_ns = mtime, .ctime_ns = ctime};
    r.saved_at = entry->second.saved_at;
    r.kind_len = static_cast<uint32_t>(kind.size());
    r.value_len = static_cast<uint32_t>(entry->second.value.size());
    records.push_back({r, entry});
  }
  std::sort(records.begin(), records.end(),
            [](const auto& a, const auto& b) { return a.first.Order() < b.first.Order(); });

  std::string head(kMagic, sizeof kMagic), body, values;
  values.reserve(static_cast<size_t>(values_bytes));
  std::vector<Key> written_keys;
  for (auto& [r, entry] : records) {
    if (entry->second.now) written_keys.push_back(entry->first);
    r.value_offset = values.size();
    values += std::get<0>(entry->first);
    values += entry->second.value;
    r.value_sum = Hash(std::string_view(values).substr(static_cast<size_t>(r.value_offset)));
    PutRecord(body, r);
  }
  Put(head, kVersion);
  Put(head, static_cast<uint32_t>(records.size()));
  Put(head, static_cast<uint64_t>(values.size()));
  Put(head, Hash(head));

  // A name of its own, made only here (O_EXCL: never a file, or a FIFO,
  // found there): processes of the same PID on other hosts (containers'
  // PID 1) may share the directory.
  std::random_device entropy;
  const std::string tmp = path + ".tmp-" + std::to_string(::getpid()) + "-" +
                          std::to_string(entropy()) + std::to_string(entropy());
  Status status = OkStatus();
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
  bool written = fd >= 0;
  for (const std::string* part : {&head, &body, &values}) {
    for (size_t at = 0; written && at < part->size();) {
      const ssize_t wrote = ::write(fd, part->data() + at, part->size() - at);
      if (wrote < 0 && errno == EINTR) continue;
      if (wrote == 0) errno = EIO;  // no progress, no error: say something true
      written = wrote > 0;
      if (written) at += static_cast<size_t>(wrote);
    }
  }
  if (!written || ::fsync(fd) != 0) {
    status = Error(tmp + ": cannot write the stat cache: " + std::strerror(errno));
  }
  if (fd >= 0) ::close(fd);
  if (status.ok() && ::rename(tmp.c_str(), path.c_str()) != 0) {
    status = Error(path + ": cannot replace the stat cache: " + std::strerror(errno));
  }
  if (!status.ok()) ::unlink(tmp.c_str());
  // Lookups go to the file just written, opened before another save can
  // replace it; what it holds of this save's entries is no longer kept
  // apart.
  std::string why;
  auto file = status.ok() ? OpenFile(path, &why) : nullptr;
  ::flock(lock_fd, LOCK_UN);
  ::close(lock_fd);
  if (file != nullptr) {
    std::lock_guard lock(mu_);
    file_ = std::move(file);
    damaged_ = false;
    if (!dropped.empty()) {
      warning_ = path + ": " + dropped;
    } else if (!warning_.empty()) {
      warning_ += " (replaced by a sound file)";
    }
    for (const Key& k : written_keys) {
      auto it = added_.find(k);
      if (it != added_.end() && it->second == added.at(k)) added_.erase(it);
    }
  }
  return status;
}

}  // namespace weightd::fingerprint
