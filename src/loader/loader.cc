#include "loader/loader.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <mutex>
#include <optional>
#include <thread>

#include "fingerprint/fingerprint.h"
#include "format/checkpoint.h"
#include "format/safetensors.h"
#include "io/read_many.h"
#include "memory/manifest.h"

namespace weightd::loader {
namespace {

constexpr int kParallelHeaderReads = 16;
// Progress is reported between batches of reads of about this many bytes.
constexpr uint64_t kProgressBatchBytes = 256ull << 20;
const uint64_t kSampleBytes = fingerprint::Options{}.sample_bytes;

struct OpenShard {
  std::unique_ptr<io::RandomAccessFile> file;
  io::StatSignature signature;
  std::string raw_header;  // length prefix and JSON, as in the file
};

// Opens one shard and reads its header, keeping the raw bytes for the digest.
Status ReadHead(io::FileSystem& fs, const format::ShardRef& ref, OpenShard& out,
                format::Shard& shard) {
  shard.name = ref.name;
  shard.path = ref.path;
  WEIGHTD_ASSIGN_OR_RETURN(out.file, fs.Open(ref.resolved));
  WEIGHTD_ASSIGN_OR_RETURN(out.signature, out.file->Stat());
  shard.file_size = out.file->size();
  if (out.signature.size != shard.file_size)
    return Error(ref.path + ": changed while being loaded");
  WEIGHTD_ASSIGN_OR_RETURN(shard.header,
                           format::ReadShardHeader(*out.file, ref.path, &out.raw_header));
  return OkStatus();
}

// Every read goes through a per-worker buffer of this size and is written
// into the segment from there: the buffer stays in the cache, and a segment
// filled by writes is neither faulted nor zeroed page by page. Tensors
// below this size are read in runs of neighbours, one read per run.
constexpr uint64_t kStepBytes = 256 << 10;

// One job: a range of a big tensor (read in steps), or a run of small
// neighbours read at once and each written to its place.
struct ReadJob {
  size_t shard;
  uint64_t file_offset;
  uint64_t bytes;
  uint64_t dst_offset;  // big tensors only
  struct Piece {
    uint64_t run_offset;
    uint64_t bytes;
    uint64_t dst_offset;
  };
  std::vector<Piece> pieces;
};

// Writes a run's pieces, gathering neighbours that are neighbours in the
// segment too (with their alignment padding) into one write.
Status WriteRun(memory::Segment& segment, const ReadJob& job, const std::byte* run) {
  static constexpr std::byte kZeros[memory::kTensorAlignment] = {};
  std::vector<std::span<const std::byte>> gather;
  uint64_t start = 0, end = 0;
  for (const ReadJob::Piece& p : job.pieces) {
    const uint64_t padding = p.dst_offset - end;
    if (gather.empty() || p.dst_offset < end || padding >= sizeof kZeros) {
      if (!gather.empty()) WEIGHTD_RETURN_IF_ERROR(segment.Write(start, gather));
      gather.clear();
      start = p.dst_offset;
    } else if (padding > 0) {
      gather.push_back(std::span(kZeros, static_cast<size_t>(padding)));
    }
    gather.push_back(std::span(run + p.run_offset, static_cast<size_t>(p.bytes)));
    end = p.dst_offset + p.bytes;
  }
  if (gather.empty()) return OkStatus();
  return segment.Write(start, gather);
}

// Reads a job into `buffer` (kStepBytes) and writes it into the segment.
// Returns the tensor bytes it placed.
Result<uint64_t> RunJob(const ReadJob& job, const io::RandomAccessFile& file,
                        memory::Segment& segment, std::span<std::byte> buffer) {
  if (job.pieces.empty()) {
    for (uint64_t at = 0; at < job.bytes; at += kStepBytes) {
      const auto n = static_cast<size_t>(std::min(kStepBytes, job.bytes - at));
      WEIGHTD_RETURN_IF_ERROR(file.ReadExactly(job.file_offset + at, buffer.first(n)));
      WEIGHTD_RETURN_IF_ERROR(segment.Write(job.dst_offset + at, buffer.first(n)));
    }
    return job.bytes;
  }
  WEIGHTD_RETURN_IF_ERROR(
      file.ReadExactly(job.file_offset, buffer.first(static_cast<size_t>(job.bytes))));
  WEIGHTD_RETURN_IF_ERROR(WriteRun(segment, job, buffer.data()));
  uint64_t placed = 0;
  for (const ReadJob::Piece& p : job.pieces) placed += p.bytes;
  return placed;
}

Status RunJobs(const std::vector<ReadJob>& jobs, const std::vector<OpenShard>& shards,
               memory::Segment& segment, uint64_t total, const LoadOptions& options,
               io::ReadStats* stats) {
  std::atomic<size_t> next{0};
  std::atomic<bool> failed{false};
  std::mutex mu;  // guards error, progress and stats
  std::optional<Error> error;
  uint64_t done = 0, reported = 0;
  const int workers = static_cast<int>(
      std::min<size_t>(jobs.size(), static_cast<size_t>(std::max(options.max_inflight, 1))));
  io::RunTeam(workers, [&](int) {
    // Not zeroed: every byte used is read first.
    std::unique_ptr<std::byte[]> buffer(new std::byte[kStepBytes]);
    for (size_t i; !failed.load() && (i = next.fetch_add(1)) < jobs.size();) {
      if (options.cancel != nullptr && options.cancel->load()) {
        std::lock_guard lock(mu);
        if (!error) error = Error("the load was cancelled");
        failed.store(true);
        return;
      }
      const ReadJob& job = jobs[i];
      Result<uint64_t> placed = RunJob(job, *shards[job.shard].file, segment,
                                       std::span(buffer.get(), static_cast<size_t>(kStepBytes)));
      std::lock_guard lock(mu);
      if (!placed.ok()) {
        if (!error) error = placed.error();
        failed.store(true);
        return;
      }
      stats->reads += job.pieces.empty() ? (job.bytes + kStepBytes - 1) / kStepBytes : 1;
      stats->bytes += job.bytes;
      done += *placed;
      if (options.progress && (done - reported >= kProgressBatchBytes || done == total)) {
        reported = done;
        options.progress(done, total);
      }
    }
  });
  if (error) return *error;
  return OkStatus();
}

Result<std::unique_ptr<memory::Segment>> DefaultAllocate(uint64_t bytes, const std::string& name) {
  return memory::CreateHostSegment(bytes, name);
}

}  // namespace

Result<LoadedModel> LoadCheckpoint(io::FileSystem& fs, const std::string& path,
                                   const LoadOptions& options) {
  const auto start = std::chrono::steady_clock::now();
  WEIGHTD_ASSIGN_OR_RETURN(format::ShardListing listing, format::ListShards(fs, path));

  // Headers: every shard open, many at once.
  std::vector<OpenShard> shards(listing.shards.size());
  std::vector<format::Shard> headers(shards.size());
  std::vector<std::optional<Error>> errors(shards.size());
  std::atomic<size_t> next{0};
  io::RunTeam(static_cast<int>(std::min<size_t>(shards.size(), kParallelHeaderReads)), [&](int) {
    for (size_t i; (i = next.fetch_add(1)) < shards.size();) {
      if (Status s = ReadHead(fs, listing.shards[i], shards[i], headers[i]); !s.ok()) {
        errors[i] = s.error();
      }
    }
  });
  for (auto& e : errors) {
    if (e) return *e;
  }

  // The segment's layout: every tensor of every shard, by name. order[i] is
  // where plan.tensors[i] comes from.
  struct Source {
    size_t shard;
    size_t tensor;
  };
  std::vector<Source> order;
  {
    const std::vector<std::pair<size_t, size_t>> by_name = format::TensorsByName(headers);
    WEIGHTD_RETURN_IF_ERROR(format::CheckAcrossShards(path, headers, listing.weight_map, by_name));
    order.reserve(by_name.size());
    for (const auto& [s, t] : by_name) order.push_back({s, t});
  }
  auto info = [&](const Source& src) -> const format::TensorInfo& {
    return headers[src.shard].header.tensors[src.tensor];
  };
  std::vector<memory::TensorLayout> layout;
  layout.reserve(order.size());
  for (const Source& src : order) {
    const format::TensorInfo& t = info(src);
    layout.push_back({t.name, std::string(format::DTypeName(t.dtype)), t.shape, t.bytes(), 0});
  }
  WEIGHTD_ASSIGN_OR_RETURN(memory::SegmentPlan plan, memory::PlanSegment(std::move(layout)));
  // Where each shard's tensors (header order) went in the segment.
  std::vector<std::vector<uint64_t>> placed(shards.size());
  for (size_t s = 0; s < shards.size(); ++s) placed[s].resize(headers[s].header.tensors.size());
  for (size_t i = 0; i < order.size(); ++i) {
    placed[order[i].shard][order[i].tensor] = plan.tensors[i].offset;
  }

  auto allocated = options.allocate ? options.allocate(plan.total_bytes)
                                    : DefaultAllocate(plan.total_bytes, options.segment_name);
  if (!allocated.ok()) return allocated.error();
  std::unique_ptr<memory::Segment> segment = std::move(allocated).value();
  if (segment->size() < plan.total_bytes) return Error("the segment allocated is too small");
  {
    std::vector<std::byte> manifest(static_cast<size_t>(plan.manifest_bytes));
    memory::WriteManifest(plan, manifest);
    WEIGHTD_RETURN_IF_ERROR(segment->Write(0, manifest));
  }

  // Every tensor's bytes, into place: big tensors in chunks, runs of small
  // neighbours (in file order) in one read each, since one read per small
  // tensor costs more than the copy.
  std::vector<ReadJob> jobs;
  uint64_t total = 0;
  for (const memory::TensorLayout& t : plan.tensors) total += t.bytes;
  for (size_t s = 0; s < shards.size(); ++s) {
    const format::ShardHeader& h = headers[s].header;
    std::vector<size_t> by_offset(h.tensors.size());
    for (size_t t = 0; t < by_offset.size(); ++t) by_offset[t] = t;
    std::sort(by_offset.begin(), by_offset.end(),
              [&](size_t a, size_t b) { return h.tensors[a].begin < h.tensors[b].begin; });
    for (size_t k = 0; k < by_offset.size();) {
      const format::TensorInfo& t = h.tensors[by_offset[k]];
      if (t.bytes() >= kStepBytes) {
        for (uint64_t at = 0; at < t.bytes(); at += options.chunk_bytes) {
          jobs.push_back({s,
                          h.data_offset() + t.begin + at,
                          std::min(options.chunk_bytes, t.bytes() - at),
                          placed[s][by_offset[k]] + at,
                          {}});
        }
        ++k;
        continue;
      }
      ReadJob run{s, h.data_offset() + t.begin, 0, 0, {}};
      while (k < by_offset.size()) {
        const format::TensorInfo& small = h.tensors[by_offset[k]];
        const uint64_t end = h.data_offset() + small.end;
        if (small.bytes() >= kStepBytes || end - run.file_offset > kStepBytes) break;
        run.pieces.push_back({h.data_offset() + small.begin - run.file_offset, small.bytes(),
                              placed[s][by_offset[k]]});
        run.bytes = end - run.file_offset;
        ++k;
      }
      jobs.push_back(std::move(run));
    }
  }
  io::ReadStats stats;
  WEIGHTD_RETURN_IF_ERROR(RunJobs(jobs, shards, *segment, total, options, &stats));

  // The files must be what they were when their headers were read.
  for (size_t s = 0; s < shards.size(); ++s) {
    WEIGHTD_ASSIGN_OR_RETURN(io::StatSignature now, shards[s].file->Stat());
    if (!(now == shards[s].signature)) {
      return Error(headers[s].path + ": changed while being loaded; nothing was published");
    }
  }

  // The sampled fingerprint of what was loaded, read back from the sealed
  // segment.
  WEIGHTD_RETURN_IF_ERROR(segment->Seal());
  const std::span<const std::byte> dst = segment->readable();
  LoadedModel model;
  std::vector<fingerprint::ShardFingerprint> digests(shards.size());
  std::atomic<size_t> next_shard{0};
  const int hashers = static_cast<int>(
      std::min<size_t>(shards.size(), std::max(1u, std::thread::hardware_concurrency())));
  io::RunTeam(hashers, [&](int) {
    for (size_t s; (s = next_shard.fetch_add(1)) < shards.size();) {
      std::vector<std::span<const std::byte>> samples;
      const auto& tensors = headers[s].header.tensors;
      samples.reserve(tensors.size());
      for (size_t t = 0; t < tensors.size(); ++t) {
        samples.push_back(
            dst.subspan(static_cast<size_t>(placed[s][t]),
                        static_cast<size_t>(std::min(kSampleBytes, tensors[t].bytes()))));
      }
      digests[s].name = headers[s].name;
      digests[s].digest = fingerprint::SampledShardDigest(
          headers[s].file_size,
          std::as_bytes(std::span(shards[s].raw_header.data(), shards[s].raw_header.size())),
          samples);
    }
  });
  for (const format::Shard& h : headers) model.tensors += h.header.tensors.size();
  model.checkpoint_digest = fingerprint::CombineSampledShards(digests);
  model.segment = std::move(segment);
  model.shards = shards.size();
  model.data_bytes = total;
  model.reads = stats.reads + 2 * shards.size();
  model.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return model;
}

}  // namespace weightd::loader
