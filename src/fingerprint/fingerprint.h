// The checkpoint's content key: what an engine computes at every start to
// prove that the checkpoint on disk is the one a cache holds.
//
// sampled (default): per shard, a digest of its size, its raw header (length
// prefix and JSON) and the first 1 KiB (or less) of every tensor's data,
// tensors in name order; then one XXH3-128 over every shard's name and
// digest, shards in name order (only those an index names, when there is
// one). Paths are not part of it: a byte-identical copy elsewhere gives the
// same digest; a renamed shard does not.
//
// full: SHA-256 of every byte of each shard (the value model hubs publish per
// file), then SHA-256 over every shard's name and hash.
//
// The I/O is planned for network file systems, where every operation costs
// a round trip: all shards are opened at once; each shard's first read takes
// the header and the first tensors' samples together; the remaining samples
// go out many at a time, with neighbours merged into one read when the gap
// between them costs less than a round trip (on a local file system, a
// window of them at a time, into a buffer used again). The digest never
// depends on that schedule. With a StatCache, a shard whose stat signature is known
// costs one stat and no read.
//
// Thread safety: FingerprintCheckpoint may run concurrently with itself; an
// Xxh3 is one thread's at a time.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "fingerprint/stat_cache.h"
#include "io/file.h"
#include "weightd/result.h"

struct XXH3_state_s;  // xxhash.h's XXH3_state_t

namespace weightd::fingerprint {

enum class Mode { kSampled, kFull };

std::string_view ModeName(Mode mode);
// "full" is kFull; anything else (the default, "sampled") kSampled.
Mode ModeNamed(std::string_view name);

struct Options {
  Mode mode = Mode::kSampled;
  // Reads outstanding at once. Sized for network storage, where only many in
  // flight hide the round trips; on a local disk fewer would do.
  int max_inflight = 512;
  // Merge neighbouring samples into one read when the gap between them is at
  // most `max_gap_bytes` (what one round trip's worth of bandwidth reads:
  // 1 ms at 256 MB/s); never build a read over `max_merged_bytes`.
  bool coalesce = true;
  uint64_t max_gap_bytes = 256 << 10;
  // 1 MiB: what one FUSE request (and a typical NFS rsize) carries; larger
  // reads are split into several operations anyway.
  uint64_t max_merged_bytes = 1 << 20;
  // The first read of each shard: prefix, header and the first samples.
  uint64_t speculative_bytes = 256 << 10;
  uint64_t sample_bytes = 1024;
  // The samples past each shard's first read are read this many bytes at
  // a time (or one merged read, if larger) into one buffer, used again once
  // the samples it held are hashed: on a local file system 8 MiB, on one
  // where a stat was seen to cost a round trip (a network or FUSE file
  // system: format::ShardListing::remote) 64 MiB, since there each window
  // costs a round trip (the 70,000-tensor K3 layout's reads are 92 MB: two
  // windows). The reads shards make on their own before that, as their
  // headers come in, share one remote window's bytes. What a shard's
  // reads merge between samples is bounded by these, whatever its header
  // claims.
  uint64_t local_window_bytes = 8 << 20;
  uint64_t remote_window_bytes = 64 << 20;
  // Stat shortcut; nullptr turns it off. Not owned.
  StatCache* cache = nullptr;
  // false: the cache is not asked, only told what was computed (its
  // answers for these files replaced): for a caller that must not take a
  // digest on the strength of a stat signature.
  bool cache_lookups = true;
  // Files changed less than this long ago are fingerprinted but not cached:
  // a rewrite within the same timestamp tick would keep their signature.
  double racy_seconds = 2.0;
  // When set and it turns true, a full fingerprint stops at its next chunk
  // with an error (a daemon shutting down). Not owned.
  const std::atomic<bool>* cancel = nullptr;
};

struct ShardFingerprint {
  std::string name;
  std::string digest;  // tagged: "xxh3-128:..." or "sha256:..."
  uint64_t file_bytes = 0;
  uint64_t tensors = 0;  // 0 when the digest came from the stat cache
  bool cached = false;
  // The file's, as it was while the digest was made (or looked up).
  io::StatSignature signature;
};

struct Fingerprint {
  std::string digest;  // tagged
  Mode mode = Mode::kSampled;
  std::vector<ShardFingerprint> shards;  // by name
  uint64_t tensors = 0;                  // in the shards that were read
  uint64_t reads = 0;
  uint64_t bytes_read = 0;
  uint64_t cache_hits = 0;
  // Operations one after another on the slowest path: lookups and opens,
  // header and sample read waves. What a latency-bound file system charges.
  uint64_t round_trips = 0;
  double seconds = 0;
  // The checkpoint directory with every symlink resolved, as the listing
  // checked the shards against it; empty for a single file.
  std::string real_path;
};

// The sampled digest of one shard from bytes a caller already holds (a
// loader that read the whole shard): the file's size, its raw header (length
// prefix and JSON), and the first `sample_bytes` of each tensor's data, in
// the header's (name) order. Equal to what FingerprintCheckpoint computes.
std::string SampledShardDigest(uint64_t file_size, std::span<const std::byte> raw_header,
                               const std::vector<std::span<const std::byte>>& samples);

// The checkpoint digest over shards' sampled digests (by name).
std::string CombineSampledShards(const std::vector<ShardFingerprint>& shards);

// XXH3-128 over bytes given piece by piece, spelled as the digests are
// (`xxh3-128:` and 32 hex digits): for other sums over many pieces, such
// as the client's checksum of every tensor.
class Xxh3 {
 public:
  Xxh3();
  Xxh3(const Xxh3&) = delete;
  Xxh3& operator=(const Xxh3&) = delete;
  ~Xxh3();
  void Update(const void* data, size_t n);
  void U64(uint64_t v) { Update(&v, sizeof v); }  // little-endian host (see dtype.cc)
  std::string Tagged() const;

 private:
  XXH3_state_s* state_;
};

// SampledShardDigest taken as the samples come, in the same order: for a
// loader that holds each tensor's first bytes only while they pass through
// its buffers.
class SampledShardHasher {
 public:
  SampledShardHasher(uint64_t file_size, std::span<const std::byte> raw_header);
  void Add(std::span<const std::byte> sample) { hash_.Update(sample.data(), sample.size()); }
  std::string Digest() const { return hash_.Tagged(); }

 private:
  Xxh3 hash_;
};

// Errors start with "cannot fingerprint" and name the reason; a checkpoint
// without safetensors shards is one (a cache must treat it as uncacheable,
// never key it by path).
Result<Fingerprint> FingerprintCheckpoint(io::FileSystem& fs, const std::string& path,
                                          const Options& options);

}  // namespace weightd::fingerprint
