#include "fingerprint/fingerprint.h"

#include <openssl/evp.h>
#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <ctime>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <thread>

#include "format/checkpoint.h"
#include "format/safetensors.h"
#include "io/private_memory.h"
#include "io/read_many.h"

namespace weightd::fingerprint {
namespace {

// Full hashing reads big sequential chunks; a few shards at once keep a
// network file system busy without thrashing a local disk.
constexpr int kFullParallelShards = 4;
constexpr uint64_t kFullChunkBytes = 4 << 20;

std::string Hex(const unsigned char* bytes, size_t n) {
  static const char* kHex = "0123456789abcdef";
  std::string out;
  out.reserve(2 * n);
  for (size_t i = 0; i < n; ++i) {
    out += kHex[bytes[i] >> 4];
    out += kHex[bytes[i] & 0xf];
  }
  return out;
}

std::string TagXxh3(const XXH128_hash_t& h) {
  XXH128_canonical_t canonical;
  XXH128_canonicalFromHash(&canonical, h);
  return "xxh3-128:" + Hex(canonical.digest, sizeof canonical.digest);
}

class Sha256 {
 public:
  Sha256() : ctx_(EVP_MD_CTX_new()) { EVP_DigestInit_ex(ctx_, EVP_sha256(), nullptr); }
  Sha256(const Sha256&) = delete;
  Sha256& operator=(const Sha256&) = delete;
  ~Sha256() { EVP_MD_CTX_free(ctx_); }
  void Update(const void* data, size_t n) { EVP_DigestUpdate(ctx_, data, n); }
  void U64(uint64_t v) { Update(&v, sizeof v); }
  std::string Tagged() {
    unsigned char out[EVP_MAX_MD_SIZE];
    unsigned int len = 0;
    EVP_DigestFinal_ex(ctx_, out, &len);
    return "sha256:" + Hex(out, len);
  }

 private:
  EVP_MD_CTX* ctx_;
};

// The checkpoint digest: every shard's name and digest, in name order.
template <typename Hash>
std::string CombineShards(const std::vector<ShardFingerprint>& shards) {
  Hash h;
  for (const auto& s : shards) {
    h.U64(s.name.size());
    h.Update(s.name.data(), s.name.size());
    h.U64(s.digest.size());
    h.Update(s.digest.data(), s.digest.size());
  }
  return h.Tagged();
}

Error CannotFingerprint(const std::string& path, const Error& why) {
  // Most reasons name the path already (or a shard in it): not twice.
  const std::string& message = why.message();
  if (message.starts_with(path + ":") || message.starts_with(path + "/")) {
    return Error("cannot fingerprint " + message);
  }
  return Error("cannot fingerprint " + path + ": " + message);
}

// The cache separates digests that were computed differently.
std::string CacheKind(const Options& o) {
  return o.mode == Mode::kFull ? "full" : "sampled-" + std::to_string(o.sample_bytes);
}

// A file changed within the last `window` seconds may change again within
// the same timestamp tick (coarse kernel clocks, whole-second file systems)
// without its signature moving, so such a signature is not cached (git's
// "racily clean" rule).
bool TooFreshToCache(const io::StatSignature& sig, double window) {
  struct timespec now;
  ::clock_gettime(CLOCK_REALTIME, &now);
  const int64_t now_ns = static_cast<int64_t>(now.tv_sec) * 1'000'000'000 + now.tv_nsec;
  return std::max(sig.mtime_ns, sig.ctime_ns) > now_ns - static_cast<int64_t>(window * 1e9);
}

// A sample that the shard's first read did not hold.
struct PendingSample {
  size_t tensor;  // in name order
  uint64_t offset;
  uint64_t length;
};

// One shard's progress through the sampled plan.
struct ShardWork {
  format::ShardRef ref;
  std::unique_ptr<io::RandomAccessFile> file;
  io::StatSignature signature;
  // The shard's digest so far: size and raw header, hashed as soon as they
  // are read so the header's bytes need not be kept.
  std::unique_ptr<Xxh3> hash;
  // Per tensor, in name order: a view into the first read while it is
  // looked at, into `head_samples`, or into a read of stage 2 once that read
  // is in. A 70,000-tensor shard's samples are tens of megabytes: copied
  // one by one, they were as many allocations and as much fresh memory
  // again.
  std::vector<std::optional<std::string_view>> samples;
  // How many samples, from the first in name order, are in `hash` already;
  // the views before this one are not used again (and may dangle).
  size_t hashed = 0;
  // The samples the first read held that wait for one it did not: a
  // vector, whose bytes stay put when the work moves.
  std::vector<char> head_samples;
  // The samples still to read, by offset once the reads are planned.
  std::vector<PendingSample> pending;
  uint64_t round_trips = 0;
  std::optional<Error> error;
  ShardFingerprint result;
};

// Hashes the shard's samples that are in, in name order, up to the first
// that is not.
void HashReadySamples(ShardWork& w) {
  for (; w.hashed < w.samples.size() && w.samples[w.hashed]; ++w.hashed) {
    w.hash->Update(w.samples[w.hashed]->data(), w.samples[w.hashed]->size());
  }
}

// The stat shortcut for one shard: true when the shard is done (its digest
// came from the cache, or its stat failed and w.error says why).
bool FromCache(io::FileSystem& fs, const Options& o, ShardWork& w) {
  w.result.name = w.ref.name;
  if (o.cache == nullptr || !o.cache_lookups) return false;
  auto sig = fs.Stat(w.ref.resolved, w.ref.symlinks);
  ++w.round_trips;
  if (!sig.ok()) {
    w.error = sig.error();
    return true;
  }
  auto digest = o.cache->Lookup(CacheKind(o), *sig);
  if (!digest) return false;
  w.signature = *sig;
  w.result.digest = *digest;
  w.result.file_bytes = sig->size;
  w.result.cached = true;
  return true;
}

// Where stage 1 reads shards' first bytes: a slot per worker, all in one
// mapping (in huge pages from 8 workers up), used again for each shard the
// worker takes.
// A zero-filled buffer of 256 KiB per shard was the costliest fresh memory
// of a cold fingerprint on a slow mount: for 66 shards, 4,200 page faults
// and over half of its reading threads' CPU.
class HeadSlots {
 public:
  // Throws std::bad_alloc where there is no memory for them.
  HeadSlots(size_t workers, const Options& o) : slot_bytes_(SlotBytes(o)) {
    size_t bytes;
    if (__builtin_mul_overflow(workers, slot_bytes_, &bytes)) throw std::bad_alloc();
    if (bytes > 0) buffer_ = io::PrivateBuffer(bytes);
  }

  // The first read's size, and room after it for the parser's padding.
  std::span<char> operator[](int worker) const {
    return {reinterpret_cast<char*>(buffer_.data()) + static_cast<size_t>(worker) * slot_bytes_,
            slot_bytes_};
  }

  static uint64_t FirstReadBytes(const Options& o) {
    return std::max<uint64_t>(o.speculative_bytes, format::kHeaderLengthBytes);
  }

 private:
  static size_t SlotBytes(const Options& o) {
    const uint64_t first = FirstReadBytes(o);
    if (first > SIZE_MAX - format::kParsePaddingBytes) throw std::bad_alloc();
    return static_cast<size_t>(first) + format::kParsePaddingBytes;
  }

  size_t slot_bytes_;
  io::PrivateBuffer buffer_;
};

// Stage 1 for one shard: stat shortcut, or open, speculative first read
// (into `slot`, from HeadSlots), header (its length taken from
// `allowance`: each shard's samples are kept until all are read), and the
// samples that first read already holds.
void OpenAndReadHead(io::FileSystem& fs, const Options& o, ShardWork& w, io::ReadStats& stats,
                     std::span<char> slot, format::HeaderAllowance& allowance,
                     bool cache_checked = false) {
  w.result.name = w.ref.name;
  if (!cache_checked && FromCache(fs, o, w)) return;
  auto file = fs.Open(w.ref.resolved, w.ref.symlinks);
  w.round_trips += 2;  // lookup + open
  if (!file.ok()) {
    w.error = file.error();
    return;
  }
  w.file = std::move(file).value();
  auto sig = w.file->Stat();
  if (!sig.ok()) {
    w.error = sig.error();
    return;
  }
  w.signature = *sig;
  const uint64_t size = w.file->size();
  w.result.file_bytes = size;
  if (w.signature.size != size) {
    w.error = Error(w.ref.path + ": changed while being fingerprinted; try again");
    return;
  }

  // The file's first bytes, then zeros where the header's parser needs
  // padding past what was read: in `slot`, or in `grown` where the header
  // is longer than the first read.
  std::span<char> head =
      slot.first(static_cast<size_t>(std::min(size, HeadSlots::FirstReadBytes(o))));
  io::PrivateBuffer grown;
  auto read_into = [&](uint64_t from) {
    ++stats.reads;
    stats.bytes += head.size() - from;
    ++w.round_trips;
    return w.file->ReadExactly(from, std::as_writable_bytes(head.subspan(from)));
  };
  if (Status s = read_into(0); !s.ok()) {
    w.error = s.error();
    return;
  }
  auto n = format::DecodeHeaderLength(w.ref.path, std::as_bytes(head), size);
  if (!n.ok()) {
    w.error = n.error();
    return;
  }
  if (Status s = allowance.Take(w.ref.path, *n); !s.ok()) {
    w.error = s.error();
    return;
  }
  const uint64_t header_end = format::kHeaderLengthBytes + *n;
  // A header (up to 100 MB, from an untrusted file) waits for its share of
  // the parsing budget before it takes memory beyond the slot, so hundreds
  // of shards cannot each hold one at the same time.
  const format::ParseTurn turn(*n);
  uint64_t read_bytes = head.size();  // of the file, from its start
  if (header_end > read_bytes) {
    // The header outgrew the speculative read: fetch exactly the rest.
    grown = io::PrivateBuffer(static_cast<size_t>(header_end + format::kParsePaddingBytes));
    std::memcpy(grown.data(), head.data(), head.size());
    const uint64_t had = head.size();
    head = std::span(reinterpret_cast<char*>(grown.data()), static_cast<size_t>(header_end));
    if (Status s = read_into(had); !s.ok()) {
      w.error = s.error();
      return;
    }
    read_bytes = header_end;
  }
  // Parsed where it was read, not copied (8 MB for a 70,000-tensor shard):
  // the padding the parser needs is file bytes past the header, or zeros.
  // Its values do not matter to the parser; zeroed, no byte of an earlier
  // shard left in a slot is ever looked at.
  if (head.size() < header_end + format::kParsePaddingBytes) {
    const size_t had = head.size();
    head = std::span(head.data(), static_cast<size_t>(header_end + format::kParsePaddingBytes));
    std::memset(head.data() + had, 0, head.size() - had);
  }
  auto header = format::ParsePaddedHeader(
      w.ref.path, std::as_bytes(head.subspan(format::kHeaderLengthBytes, static_cast<size_t>(*n))),
      size, turn);
  if (!header.ok()) {
    w.error = header.error();
    return;
  }
  w.result.tensors = header->tensors.size();
  w.hash = std::make_unique<Xxh3>();
  w.hash->U64(size);
  w.hash->Update(head.data(), static_cast<size_t>(header_end));
  // The samples the first read holds are hashed where they lie, up to the
  // first one it does not hold (in name order); those after that one are
  // copied out before the read's buffer goes.
  auto sample_of = [&](const format::TensorInfo& info) {
    return std::pair(header->data_offset() + info.begin, std::min(o.sample_bytes, info.bytes()));
  };
  size_t pending = 0;
  for (const format::TensorInfo& info : header->tensors) {
    const auto [offset, length] = sample_of(info);
    pending += offset + length > read_bytes;
  }
  w.pending.reserve(pending);
  w.samples.resize(header->tensors.size());
  for (size_t t = 0; t < header->tensors.size(); ++t) {
    const auto [offset, length] = sample_of(header->tensors[t]);
    if (offset + length <= read_bytes) {
      w.samples[t] = std::string_view(head.data() + offset, static_cast<size_t>(length));
    } else {
      w.pending.push_back({t, offset, length});
    }
  }
  HashReadySamples(w);
  size_t waiting = 0;
  for (size_t t = w.hashed; t < w.samples.size(); ++t)
    waiting += w.samples[t] ? w.samples[t]->size() : 0;
  w.head_samples.reserve(waiting);  // never grown past: the views stay valid
  for (size_t t = w.hashed; t < w.samples.size(); ++t) {
    if (!w.samples[t]) continue;
    const size_t at = w.head_samples.size();
    w.head_samples.insert(w.head_samples.end(), w.samples[t]->begin(), w.samples[t]->end());
    w.samples[t] = std::string_view(w.head_samples.data() + at, w.samples[t]->size());
  }
}

// One read of stage 2: the samples work[shard].pending[first, end).
struct MergedRead {
  size_t shard;
  uint64_t offset;
  uint64_t bytes;
  size_t first;
  size_t end;
};

// Groups each shard's pending samples, sorted by offset, into reads.
std::vector<MergedRead> PlanReads(std::span<ShardWork> work, const Options& o) {
  // By length too: a sample of no bytes at another's offset goes first,
  // and never moves a merged read's end back.
  auto by_offset = [](const PendingSample& a, const PendingSample& b) {
    return std::tie(a.offset, a.length) < std::tie(b.offset, b.length);
  };
  std::vector<MergedRead> reads;
  for (size_t shard = 0; shard < work.size(); ++shard) {
    std::vector<PendingSample>& pending = work[shard].pending;
    if (!std::is_sorted(pending.begin(), pending.end(), by_offset)) {
      std::sort(pending.begin(), pending.end(), by_offset);
    }
    uint64_t end = 0;
    for (size_t i = 0; i < pending.size(); ++i) {
      const PendingSample& p = pending[i];
      const bool merge = o.coalesce && i > 0 && p.offset >= end &&
                         p.offset - end <= o.max_gap_bytes &&
                         p.offset + p.length - reads.back().offset <= o.max_merged_bytes;
      if (!merge) reads.push_back({shard, p.offset, 0, i, i});
      end = p.offset + p.length;
      reads.back().bytes = end - reads.back().offset;
      reads.back().end = i + 1;
    }
  }
  return reads;
}

// Reads the samples of `reads`, many in flight, and hashes each shard's in
// name order as soon as those before them are in; returns how many waves of
// reads that took. Reads go a window of `window_bytes` at a time (at least
// one read) into one buffer, used again once the samples it held are hashed.
// That takes name order to be file order, as it mostly is (see below for
// samples that must wait).
//
// On a network file system the window is large, since each wave costs a
// round trip. On a local one a read costs none, and a model of small
// tensors has nearly every byte sampled: fresh memory for all of them (90 MB
// for 70,000 tensors) cost more than the reads. The buffers are in huge
// pages where the kernel gives them (io/private_memory.h), so that what is
// fresh costs a fault per 2 MiB, not per 4 KiB.
//
// Samples that wait for one in a later window are copied out before the
// buffer is used again: what waits is their bytes, never the reads', which
// are mostly the gaps merged between samples. (Kept whole, a crafted shard
// of 320 KB on disk, its tensors named in the reverse of file order, held
// 800 MiB of reads.)
Result<uint64_t> ReadSamples(const std::vector<MergedRead>& reads, uint64_t window_bytes,
                             const Options& o, std::span<ShardWork> work, io::ReadStats& stats) {
  io::PrivateBuffer buffer;
  std::vector<std::unique_ptr<char[]>> kept;
  std::vector<io::ReadRequest> requests;
  uint64_t waves = 0;
  for (size_t first = 0, end = 0; first < reads.size(); first = end) {
    uint64_t bytes = 0;
    for (end = first;
         end < reads.size() && (end == first || bytes + reads[end].bytes <= window_bytes); ++end) {
      bytes += reads[end].bytes;
    }
    if (bytes > buffer.size()) buffer = io::PrivateBuffer(static_cast<size_t>(bytes));
    const std::span window = std::span(reads).subspan(first, end - first);
    requests.clear();
    for (uint64_t at = 0; const MergedRead& r : window) {
      requests.push_back({work[r.shard].file.get(), r.offset,
                          std::span(buffer.data() + at, static_cast<size_t>(r.bytes))});
      at += r.bytes;
    }
    WEIGHTD_RETURN_IF_ERROR(io::ReadMany(requests, {.max_inflight = o.max_inflight}, &stats));
    waves += (requests.size() + o.max_inflight - 1) / std::max(o.max_inflight, 1);
    for (size_t k = 0; k < window.size(); ++k) {
      const char* data = reinterpret_cast<const char*>(requests[k].dst.data());
      ShardWork& w = work[window[k].shard];
      for (const PendingSample& p :
           std::span(w.pending).subspan(window[k].first, window[k].end - window[k].first)) {
        w.samples[p.tensor] =
            std::string_view(data + (p.offset - window[k].offset), static_cast<size_t>(p.length));
      }
    }
    uint64_t waiting = 0;
    for (const MergedRead& r : window) {
      ShardWork& w = work[r.shard];
      HashReadySamples(w);
      for (size_t i = r.first; i < r.end; ++i) {
        if (w.pending[i].tensor >= w.hashed) waiting += w.pending[i].length;
      }
    }
    if (waiting == 0) continue;
    char* copy = kept.emplace_back(std::make_unique_for_overwrite<char[]>(waiting)).get();
    for (const MergedRead& r : window) {
      ShardWork& w = work[r.shard];
      for (size_t i = r.first; i < r.end; ++i) {
        const PendingSample& p = w.pending[i];
        if (p.tensor < w.hashed) continue;
        std::optional<std::string_view>& sample = w.samples[p.tensor];
        std::memcpy(copy, sample->data(), sample->size());
        sample = std::string_view(copy, sample->size());
        copy += sample->size();
      }
    }
  }
  return waves;
}

// Reads that shards may have out for their samples before stage 2: what
// max_inflight leaves beside the first reads, so that no more than that are
// ever out at once; and the bytes they read into, within one remote window
// for all of them.
class ReadBudget {
 public:
  ReadBudget(int64_t reads, uint64_t bytes) : reads_(std::max<int64_t>(reads, 0)), bytes_(bytes) {}

  bool TryTake(int64_t reads, uint64_t bytes) {
    std::lock_guard lock(mu_);
    if (reads_ < reads || bytes_ < bytes) return false;
    reads_ -= reads;
    bytes_ -= bytes;
    return true;
  }
  void Give(int64_t reads, uint64_t bytes) {
    std::lock_guard lock(mu_);
    reads_ += reads;
    bytes_ += bytes;
  }

 private:
  std::mutex mu_;
  int64_t reads_;
  uint64_t bytes_;
};

// Stage 2 for one shard as soon as its head is in, on a file system where
// each wave of reads costs a round trip: its sample reads then need not wait
// for the slowest shard's head (80 ms of spread among 66 heads at 150 ms),
// and a few hundred reads do not all go out, and come back, at one moment.
// A shard whose reads the budget cannot take in one wave leaves them to
// stage 2, which has them all.
void ReadOwnSamples(const Options& o, ShardWork& w, io::ReadStats& stats, ReadBudget& budget) {
  if (w.error || w.pending.empty()) return;
  std::span<ShardWork> one(&w, 1);
  const std::vector<MergedRead> reads = PlanReads(one, o);
  const auto need =
      static_cast<int64_t>(std::min<size_t>(reads.size(), std::max(o.max_inflight, 1)));
  uint64_t bytes = 0;
  for (const MergedRead& r : reads) {
    if (__builtin_add_overflow(bytes, r.bytes, &bytes)) return;  // stage 2's to refuse
  }
  if (!budget.TryTake(need, bytes)) return;
  struct GiveBack {
    ReadBudget& budget;
    int64_t n;
    uint64_t bytes;
    ~GiveBack() { budget.Give(n, bytes); }
  } give_back{budget, need, bytes};
  auto waves = ReadSamples(reads, o.remote_window_bytes, o, one, stats);
  if (!waves.ok()) {
    w.error = waves.error();
    return;
  }
  w.round_trips += *waves;
  w.pending.clear();  // read and hashed: none for stage 2
}

// Stage 1 started from the directory listing while the index is still being
// read (on a remote file system, where ListShards lists the directory
// early): every regular *.safetensors file is opened and its head read, so
// the index read and the shards' opens overlap instead of following each
// other. Sampled() then takes the work of the shards the index names and the
// path checks passed; the rest is dropped, its reads still counted.
class EarlyHeads {
 public:
  EarlyHeads(io::FileSystem& fs, std::string dir, const Options& o)
      : fs_(fs), dir_(std::move(dir)), o_(o) {}
  // Where Finish was not reached (the listing threw), the early work is let
  // go with no shard named rather than waited for forever.
  ~EarlyHeads() {
    if (thread_.joinable()) Finish(nullptr);
  }

  // Called once, from ListShards's listing thread; returns at once.
  void Start(const std::vector<io::DirEntry>& entries) {
    try {
      for (const io::DirEntry& e : entries) {
        constexpr std::string_view kSuffix = ".safetensors";
        if (e.type != io::EntryType::kRegular || !e.name.ends_with(kSuffix)) continue;
        names_.push_back(e.name);
      }
      std::sort(names_.begin(), names_.end());
      work_.resize(names_.size());
      taken_.assign(names_.size(), 0);
      stats_.resize(names_.size());
      thread_ = std::jthread([this] {
        std::atomic<size_t> next{0};
        try {
          const size_t workers = std::min<size_t>(work_.size(), std::max(o_.max_inflight, 1));
          const HeadSlots slots(workers, o_);
          ReadBudget budget(o_.max_inflight - static_cast<int64_t>(workers),
                            o_.remote_window_bytes);
          io::RunTeam(static_cast<int>(workers), [&](int worker) {
            for (size_t i; (i = next.fetch_add(1)) < work_.size();) {
              // Taken only where the shard is this very name in the
              // directory, a regular file: a symlink here is not followed.
              const std::string path = io::JoinPath(dir_, names_[i]);
              work_[i].ref = {names_[i], path, path, io::Symlinks::kNotTheFile};
              OpenAndReadHead(fs_, o_, work_[i], stats_[i], slots[worker], allowance_);
              ShardWork& w = work_[i];
              // With heads still to read, not yet: Sampled() reads these
              // samples once it takes the shard.
              const bool heads_left = next.load() < work_.size();
              if (!w.error && !w.pending.empty() && Named(i, /*wait=*/!heads_left)) {
                ReadOwnSamples(o_, w, stats_[i], budget);
              }
            }
          });
        } catch (...) {
          // Some shard's work may be half done: none is taken, every shard
          // is opened again after the index.
          failed_ = true;
        }
      });
    } catch (...) {
      // No thread to spare, or no memory: the shards are opened after the
      // index instead.
      names_.clear();
      work_.clear();
    }
  }

  // Tells the early work which shards the index named (none, where the
  // listing failed) and waits for it; afterwards Take may be called.
  void Finish(const format::ShardListing* listing) {
    std::vector<char> named;
    try {
      named.assign(names_.size(), 0);
      for (size_t k = 0; listing != nullptr && k < listing->shards.size(); ++k) {
        const format::ShardRef& ref = listing->shards[k];
        auto it = std::lower_bound(names_.begin(), names_.end(), ref.name);
        if (it == names_.end() || *it != ref.name) continue;
        if (ref.resolved != io::JoinPath(listing->real_dir, ref.name)) continue;  // as Take
        named[static_cast<size_t>(it - names_.begin())] = 1;
      }
    } catch (...) {
      named.clear();  // no memory: none named, and Sampled() reads the samples
    }
    {
      std::lock_guard lock(named_mu_);
      named_ = std::move(named);
      named_known_ = true;
    }
    named_cv_.notify_all();
    if (thread_.joinable()) thread_.join();
  }

  // Moves the early work for `ref` into `w` when it was done on the very file
  // the listing checked: named directly in the directory, not through a
  // symlink, and with the same signature now.
  bool Take(const format::ShardRef& ref, const std::string& real_dir, ShardWork& w,
            io::ReadStats& stats) {
    if (failed_) return false;
    auto it = std::lower_bound(names_.begin(), names_.end(), ref.name);
    if (it == names_.end() || *it != ref.name) return false;
    const size_t i = static_cast<size_t>(it - names_.begin());
    ShardWork& early = work_[i];
    if (early.error || taken_[i]) return false;
    if (ref.resolved != io::JoinPath(real_dir, ref.name)) return false;
    auto now = fs_.Stat(ref.resolved, ref.symlinks);
    if (!now.ok() || !(*now == early.signature)) return false;
    taken_[i] = 1;
    w = std::move(early);
    w.ref = ref;
    stats = stats_[i];
    return true;
  }

  // Whether the listing named early shard i; with `wait`, once the listing
  // is done (its index read and path checks), otherwise false until then.
  // A shard's samples are read only once it is named: a file the index
  // leaves out (a consolidated copy beside the shards) costs its first read,
  // not all its samples. On a slow mount the listing is done about when the
  // heads come back: the index read goes out with the shards' opens.
  bool Named(size_t i, bool wait) {
    std::unique_lock lock(named_mu_);
    if (wait) named_cv_.wait(lock, [this] { return named_known_; });
    return named_known_ && i < named_.size() && named_[i] != 0;
  }

  // The checkpoint's headers read so far, early or after the listing: one
  // allowance for both.
  format::HeaderAllowance& allowance() { return allowance_; }

  // Reads issued for shards that were not taken.
  io::ReadStats Unused() const {
    io::ReadStats unused;
    for (size_t i = 0; i < work_.size(); ++i) {
      if (taken_[i]) continue;
      unused.reads += stats_[i].reads;
      unused.bytes += stats_[i].bytes;
    }
    return unused;
  }

 private:
  io::FileSystem& fs_;
  const std::string dir_;
  const Options& o_;
  std::vector<std::string> names_;  // sorted
  std::vector<ShardWork> work_;
  std::vector<io::ReadStats> stats_;
  // One flag per early shard; each is touched by the one worker that takes
  // that shard's name (names are unique).
  std::vector<char> taken_;
  std::mutex named_mu_;
  std::condition_variable named_cv_;
  std::vector<char> named_;   // per early shard; guarded by named_mu_
  bool named_known_ = false;  // guarded by named_mu_
  bool failed_ = false;       // the early work threw; set before Finish joins
  format::HeaderAllowance allowance_;
  std::jthread thread_;
};

Result<Fingerprint> Sampled(io::FileSystem& fs, const format::ShardListing& listing,
                            const Options& o, EarlyHeads& early) {
  const std::vector<format::ShardRef>& refs = listing.shards;
  std::vector<ShardWork> work(refs.size());
  std::vector<io::ReadStats> head_stats(work.size());
  // On a local file system the stat shortcut goes first, on this thread: a
  // warm fingerprint then starts no thread at all.
  std::vector<size_t> todo;
  for (size_t i = 0; i < refs.size(); ++i) {
    work[i].ref = refs[i];
    if (listing.remote || !FromCache(fs, o, work[i])) todo.push_back(i);
    if (work[i].error) return *work[i].error;  // its stat failed
  }
  // The rest all at once: each either takes the work started from the
  // listing (one stat, usually answered from the attribute cache, to check
  // it is the same file) or opens and reads its head now.
  {  // the slots are freed before stage 2
    std::atomic<size_t> next{0};
    std::atomic<bool> failed{false};  // once a shard has, no other is begun
    const size_t workers = std::min<size_t>(todo.size(), std::max(o.max_inflight, 1));
    const HeadSlots slots(workers, o);
    ReadBudget budget(o.max_inflight - static_cast<int64_t>(workers), o.remote_window_bytes);
    io::RunTeam(static_cast<int>(workers), [&](int worker) {
      for (size_t k; !failed && (k = next.fetch_add(1)) < todo.size();) {
        const size_t i = todo[k];
        if (!early.Take(refs[i], listing.real_dir, work[i], head_stats[i])) {
          work[i].ref = refs[i];
          OpenAndReadHead(fs, o, work[i], head_stats[i], slots[worker], early.allowance(),
                          /*cache_checked=*/!listing.remote && o.cache != nullptr);
        }
        if (listing.remote) ReadOwnSamples(o, work[i], head_stats[i], budget);
        if (work[i].error) failed = true;
      }
    });
  }
  Fingerprint fp;
  uint64_t slowest_shard = 0;
  for (size_t i = 0; i < work.size(); ++i) {
    if (work[i].error) return *work[i].error;
    fp.reads += head_stats[i].reads;
    fp.bytes_read += head_stats[i].bytes;
    slowest_shard = std::max(slowest_shard, work[i].round_trips);
  }

  // Stage 2: the remaining samples.
  io::ReadStats sample_stats;
  WEIGHTD_ASSIGN_OR_RETURN(
      const uint64_t waves,
      ReadSamples(PlanReads(work, o), listing.remote ? o.remote_window_bytes : o.local_window_bytes,
                  o, work, sample_stats));
  fp.reads += sample_stats.reads;
  fp.bytes_read += sample_stats.bytes;

  // Stage 3: the files unchanged, the digests.
  for (ShardWork& w : work) {
    if (!w.result.cached) {
      auto after = w.file->Stat();
      if (!after.ok()) return after.error();
      if (!(*after == w.signature)) {
        return Error(w.ref.path + ": changed while being fingerprinted; try again");
      }
      if (w.hashed != w.samples.size()) {
        return Error(w.ref.path + ": internal error: a sample was never read");
      }
      w.result.digest = w.hash->Tagged();
      if (o.cache != nullptr && !TooFreshToCache(w.signature, o.racy_seconds)) {
        o.cache->Insert(CacheKind(o), w.signature, w.result.digest);
      }
    } else {
      ++fp.cache_hits;
    }
    w.result.signature = w.signature;
    fp.tensors += w.result.tensors;
    fp.shards.push_back(std::move(w.result));
  }
  fp.digest = CombineShards<Xxh3>(fp.shards);
  fp.round_trips = slowest_shard + waves;
  return fp;
}

Result<Fingerprint> Full(io::FileSystem& fs, const std::vector<format::ShardRef>& refs,
                         const Options& o) {
  std::vector<ShardFingerprint> shards(refs.size());
  std::vector<std::optional<Error>> errors(refs.size());
  std::vector<io::ReadStats> stats(refs.size());
  std::atomic<size_t> next{0};
  // Set by the first shard that fails: the rest are not read (a broken
  // shard among 64 of 5 GB must not cost the others' every byte first).
  std::atomic<bool> failed{false};
  auto cancelled = [&] { return o.cancel != nullptr && o.cancel->load(); };
  const std::string kind = CacheKind(o);
  io::RunTeam(static_cast<int>(std::min<size_t>(refs.size(), kFullParallelShards)), [&](int) {
    for (size_t i; (i = next.fetch_add(1)) < refs.size();) {
      ShardFingerprint& s = shards[i];
      s.name = refs[i].name;
      auto fail = [&](const Error& e) {
        errors[i] = e;
        failed = true;
      };
      if (cancelled()) {
        fail(Error("the fingerprint was cancelled"));
        break;
      }
      if (failed) break;  // another shard's error is the answer
      // Opened even when the stat cache may answer: NFS revalidates a
      // file's attributes when it is opened (close-to-open), where a plain
      // stat may get the client's cached ones, and a stale signature would
      // find the old digest. Full mode is asked for to see every change.
      auto file = fs.Open(refs[i].resolved, refs[i].symlinks);
      if (!file.ok()) {
        fail(file.error());
        continue;
      }
      auto before = (*file)->Stat();
      if (!before.ok()) {
        fail(before.error());
        continue;
      }
      if (o.cache != nullptr && o.cache_lookups) {
        if (auto digest = o.cache->Lookup(kind, *before)) {
          s.digest = *digest;
          s.file_bytes = before->size;
          s.cached = true;
          s.signature = *before;
          continue;
        }
      }
      s.file_bytes = (*file)->size();
      if (before->size != s.file_bytes) {
        fail(Error(refs[i].path + ": changed while being fingerprinted; try again"));
        continue;
      }
      // A hash of any bytes would do for the value; but a broken shard is
      // an error here too, as in sampled mode, not a digest to compare.
      auto header = format::ReadShardHeader(**file, refs[i].path);
      if (!header.ok()) {
        fail(header.error());
        continue;
      }
      stats[i].reads += 2;  // its length, then its JSON
      stats[i].bytes += header->data_offset();
      Sha256 sha;
      Status read = io::StreamFile(
          **file, {.chunk_bytes = kFullChunkBytes, .max_inflight = 2},
          [&](uint64_t, std::span<const std::byte> chunk) -> Status {
            if (failed || cancelled()) return Error("stopped");
            sha.Update(chunk.data(), chunk.size());
            return OkStatus();
          },
          &stats[i]);
      if (!read.ok()) {
        if (cancelled()) {
          fail(Error("the fingerprint was cancelled"));
        } else if (failed) {
          break;  // stopped for another shard's error, which is the answer
        } else {
          fail(read.error());
        }
        continue;
      }
      auto after = (*file)->Stat();
      if (!after.ok() || !(*after == *before)) {
        fail(Error(refs[i].path + ": changed while being fingerprinted; try again"));
      } else {
        s.digest = sha.Tagged();
        s.signature = *before;
        if (o.cache != nullptr && !TooFreshToCache(*before, o.racy_seconds)) {
          o.cache->Insert(kind, *before, s.digest);
        }
      }
    }
  });
  for (const std::optional<Error>& e : errors) {
    if (e) return *e;  // the first in name order of those that failed
  }
  Fingerprint fp;
  fp.mode = Mode::kFull;
  for (size_t i = 0; i < refs.size(); ++i) {
    fp.reads += stats[i].reads;
    fp.bytes_read += stats[i].bytes;
    fp.cache_hits += shards[i].cached ? 1 : 0;
  }
  fp.shards = std::move(shards);
  fp.digest = CombineShards<Sha256>(fp.shards);
  // Shards go kFullParallelShards at a time; within one, reads are ordered.
  fp.round_trips = 3 + (fp.reads + kFullParallelShards - 1) / kFullParallelShards;
  return fp;
}

// The stat cache also remembers which shards an index listed, so a warm
// fingerprint does not open and read the index again.
constexpr char kIndexKind[] = "index";

format::ListOptions ListingOptions(const Options& options) {
  format::ListOptions o;
  o.reserve_workers = options.max_inflight;
  StatCache* cache = options.cache;
  const double racy_seconds = options.racy_seconds;
  if (cache == nullptr) return o;
  if (options.cache_lookups) {
    o.recall_index =
        [cache](const io::StatSignature& sig) -> std::optional<std::vector<std::string>> {
      auto text = cache->Lookup(kIndexKind, sig);
      if (!text || text->empty()) return std::nullopt;
      std::vector<std::string> names;
      for (size_t start = 0; start <= text->size();) {
        size_t end = text->find('\n', start);
        if (end == std::string::npos) end = text->size();
        names.push_back(text->substr(start, end - start));
        start = end + 1;
      }
      return names;
    };
  }
  o.remember_index = [cache, racy_seconds](const io::StatSignature& sig,
                                           const std::vector<std::string>& names) {
    if (TooFreshToCache(sig, racy_seconds)) return;
    std::string text;
    for (const auto& n : names) {
      if (n.find('\n') != std::string::npos) return;  // cannot be framed; just not cached
      text += (text.empty() ? "" : "\n") + n;
    }
    cache->Insert(kIndexKind, sig, text);
  };
  return o;
}

}  // namespace

Xxh3::Xxh3() : state_(XXH3_createState()) { XXH3_128bits_reset(state_); }
Xxh3::~Xxh3() { XXH3_freeState(state_); }
void Xxh3::Update(const void* data, size_t n) { XXH3_128bits_update(state_, data, n); }
std::string Xxh3::Tagged() const { return TagXxh3(XXH3_128bits_digest(state_)); }

SampledShardHasher::SampledShardHasher(uint64_t file_size, std::span<const std::byte> raw_header) {
  hash_.U64(file_size);
  hash_.Update(raw_header.data(), raw_header.size());
}

std::string SampledShardDigest(uint64_t file_size, std::span<const std::byte> raw_header,
                               const std::vector<std::span<const std::byte>>& samples) {
  SampledShardHasher h(file_size, raw_header);
  for (const auto& sample : samples) h.Add(sample);
  return h.Digest();
}

std::string CombineSampledShards(const std::vector<ShardFingerprint>& shards) {
  return CombineShards<Xxh3>(shards);
}

std::string_view ModeName(Mode mode) { return mode == Mode::kFull ? "full" : "sampled"; }

Mode ModeNamed(std::string_view name) { return name == "full" ? Mode::kFull : Mode::kSampled; }

Result<Fingerprint> FingerprintCheckpoint(io::FileSystem& fs, const std::string& path,
                                          const Options& options) {
  const auto start = std::chrono::steady_clock::now();
  EarlyHeads early(fs, path, options);
  format::ListOptions list_options = ListingOptions(options);
  if (options.mode == Mode::kSampled) {
    list_options.on_early_listing = [&early](const std::vector<io::DirEntry>& entries) {
      early.Start(entries);
    };
  }
  auto listing = format::ListShards(fs, path, list_options);
  early.Finish(listing.ok() ? &*listing : nullptr);
  if (!listing.ok()) return CannotFingerprint(path, listing.error());
  auto fp = options.mode == Mode::kFull ? Full(fs, listing->shards, options)
                                        : Sampled(fs, *listing, options, early);
  if (!fp.ok()) return CannotFingerprint(path, fp.error());
  const io::ReadStats unused = early.Unused();
  fp->reads += listing->reads + unused.reads;
  fp->bytes_read += listing->bytes_read + unused.bytes;
  fp->round_trips += listing->round_trips;
  fp->real_path = listing->real_dir;
  fp->seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return fp;
}

}  // namespace weightd::fingerprint
