// libFuzzer target: the input is a stat cache file's contents (a file under
// the user's cache directory, which a crash or another program may have left
// in any state). The input is parsed as it is and again with its checksum
// appended, so that the fuzzer reaches past the checksum into the entries.
#include <xxhash.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "fingerprint/stat_cache.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using weightd::fingerprint::StatCache;
  const std::string raw(reinterpret_cast<const char*>(data), size);
  std::string why;
  (void)StatCache::CountEntries(raw, &why);

  std::string summed = raw;
  const uint64_t sum = XXH3_64bits(raw.data(), raw.size());
  summed.append(reinterpret_cast<const char*>(&sum), sizeof sum);
  why.clear();
  const auto entries = StatCache::CountEntries(summed, &why);
  // Every refusal says why; every entry takes at least its fixed 48 bytes.
  if (!entries && why.empty()) __builtin_trap();
  if (entries && *entries * 48 > size) __builtin_trap();
  return 0;
}
