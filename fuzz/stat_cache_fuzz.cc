// libFuzzer target: the input is a stat cache file's contents (a file under
// the user's cache directory, which a crash or another program may have left
// in any state). The input is parsed as it is, and again with its checksums
// made right (header, each entry, its kind's hash and its value, where the
// entry says they are), so that the fuzzer reaches past them into the
// lengths, offsets and order. A file that parses must open as a cache of as
// many entries, each found by a lookup with its value; a save over any
// input must write a file that parses.
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

#include "fingerprint/stat_cache.h"

namespace {

constexpr size_t kHeader = 32, kRecord = 88;

template <typename T>
T Get(const std::string& s, size_t at) {
  T v;
  std::memcpy(&v, s.data() + at, sizeof v);
  return v;
}

void Set(std::string& s, size_t at, uint64_t v) { std::memcpy(s.data() + at, &v, sizeof v); }

// The input with its values' size, kinds' hashes and every checksum made
// right, as a writer would have.
std::string WithChecksums(std::string s) {
  if (s.size() < kHeader) return s;
  const uint64_t count = std::min<uint64_t>(Get<uint32_t>(s, 12), (s.size() - kHeader) / kRecord);
  const size_t values = kHeader + count * kRecord;
  Set(s, 16, s.size() - values);
  Set(s, 24, XXH3_64bits(s.data(), 24));
  for (uint64_t i = 0; i < count; ++i) {
    const size_t r = kHeader + i * kRecord;
    const uint64_t offset = Get<uint64_t>(s, r + 56);
    const uint64_t kind = Get<uint32_t>(s, r + 64);
    const uint64_t bytes = kind + Get<uint32_t>(s, r + 68);
    if (offset <= s.size() - values && bytes <= s.size() - values - offset) {
      Set(s, r, XXH3_64bits(s.data() + values + offset, kind));
      Set(s, r + 72, XXH3_64bits(s.data() + values + offset, bytes));
    }
    Set(s, r + 80, XXH3_64bits(s.data() + r, 80));
  }
  return s;
}

// A folder of this process's own, removed at exit. (Plain chars: no
// destructor runs before the exit handler does.)
const char* Dir() {
  static char name[] = "/tmp/stat-cache-fuzz-XXXXXX";
  static const bool made = [] {
    if (::mkdtemp(name) == nullptr) std::abort();
    std::atexit([] {
      std::error_code ignored;
      std::filesystem::remove_all(name, ignored);
    });
    return true;
  }();
  (void)made;
  return name;
}

// `bytes` as the cache file; false when it cannot be written (a full /tmp).
bool WriteCacheFile(const std::string& bytes) {
  std::ofstream out(std::string(Dir()) + "/fingerprint-stat-v3.cache",
                    std::ios::binary | std::ios::trunc);
  out << bytes;
  out.close();
  return out.good();
}

// A save over `bytes` keeps what is sound in them (the salvage path, for
// any input) and writes a file that parses whole. Every few inputs: a save
// syncs to disk.
void SaveOver(const std::string& bytes) {
  static int turn = 0;
  if (++turn % 64 != 0 || !WriteCacheFile(bytes)) return;
  auto cache = weightd::fingerprint::StatCache::Load(Dir());
  cache->Insert("fuzz", {.device = 1, .inode = 2}, "value");
  if (!cache->Save().ok()) return;
  std::ifstream in(std::string(Dir()) + "/fingerprint-stat-v3.cache", std::ios::binary);
  const std::string saved((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::string why;
  if (!weightd::fingerprint::StatCache::CountEntries(saved, &why)) __builtin_trap();
  if (cache->Lookup("fuzz", {.device = 1, .inode = 2}) != "value") __builtin_trap();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using weightd::fingerprint::StatCache;
  const std::string raw(reinterpret_cast<const char*>(data), size);
  std::string why;
  (void)StatCache::CountEntries(raw, &why);

  const std::string fixed = WithChecksums(raw);
  SaveOver(fixed);
  why.clear();
  const auto entries = StatCache::CountEntries(fixed, &why);
  if (!entries && why.empty()) __builtin_trap();  // every refusal says why
  if (!entries) {
    // Engines look up in a file without parsing it whole: the lookups meet
    // what the parse refused (records out of order, offsets out of place)
    // and must only miss, or find what a sound record holds.
    if (!WriteCacheFile(fixed)) return 0;
    auto cache = StatCache::Load(Dir());
    if (fixed.size() < kHeader) return 0;
    const size_t count = (fixed.size() - kHeader) / kRecord;
    const size_t values = kHeader + std::min<size_t>(Get<uint32_t>(fixed, 12), count) * kRecord;
    for (size_t i = 0; i < std::min<size_t>(count, 4); ++i) {
      const size_t r = kHeader + i * kRecord;
      // The record's own kind where it lies in the file, to reach its value.
      const uint64_t offset = Get<uint64_t>(fixed, r + 56), kind = Get<uint32_t>(fixed, r + 64);
      const bool inside = offset <= fixed.size() - values && kind <= fixed.size() - values - offset;
      const std::string k = inside ? fixed.substr(values + offset, kind) : "sampled-1024";
      (void)cache->Lookup(k, {.device = Get<uint64_t>(fixed, r + 8),
                              .inode = Get<uint64_t>(fixed, r + 16),
                              .size = Get<uint64_t>(fixed, r + 24),
                              .mtime_ns = Get<int64_t>(fixed, r + 32),
                              .ctime_ns = Get<int64_t>(fixed, r + 40)});
    }
    (void)cache->Lookup("full", {.device = ~0ull, .inode = ~0ull});
    return 0;
  }
  // What parses whole opens as a cache of as many entries, with no warning,
  // and a lookup finds each entry with its value.
  if (!WriteCacheFile(fixed)) return 0;
  auto cache = StatCache::Load(Dir());
  if (!cache->warning().empty() || cache->size() != *entries) __builtin_trap();
  const size_t values = kHeader + *entries * kRecord;
  for (size_t i = 0; i < *entries; ++i) {
    const size_t r = kHeader + i * kRecord;
    const weightd::io::StatSignature sig{.device = Get<uint64_t>(fixed, r + 8),
                                         .inode = Get<uint64_t>(fixed, r + 16),
                                         .size = Get<uint64_t>(fixed, r + 24),
                                         .mtime_ns = Get<int64_t>(fixed, r + 32),
                                         .ctime_ns = Get<int64_t>(fixed, r + 40)};
    const size_t at = values + Get<uint64_t>(fixed, r + 56);
    const size_t kind = Get<uint32_t>(fixed, r + 64);
    const std::string value = fixed.substr(at + kind, Get<uint32_t>(fixed, r + 68));
    if (cache->Lookup(fixed.substr(at, kind), sig) != value) __builtin_trap();
  }
  if (!cache->warning().empty()) __builtin_trap();
  return 0;
}
