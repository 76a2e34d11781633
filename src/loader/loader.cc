#include "loader/loader.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <optional>

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
  format::Shard shard;
  std::unique_ptr<io::RandomAccessFile> file;
  io::StatSignature signature;
  std::string raw_header;  // length prefix and JSON, as in the file
};

// Opens one shard and reads its header, keeping the raw bytes for the digest.
Status ReadHead(io::FileSystem& fs, const format::ShardRef& ref, OpenShard& out) {
  out.shard.name = ref.name;
  out.shard.path = ref.path;
  WEIGHTD_ASSIGN_OR_RETURN(out.file, fs.Open(ref.resolved));
  WEIGHTD_ASSIGN_OR_RETURN(out.signature, out.file->Stat());
  const uint64_t size = out.file->size();
  out.shard.file_size = size;
  if (out.signature.size != size) return Error(ref.path + ": changed while being loaded");
  out.raw_header.resize(static_cast<size_t>(std::min<uint64_t>(size, format::kHeaderLengthBytes)));
  WEIGHTD_RETURN_IF_ERROR(out.file->ReadExactly(
      0, std::as_writable_bytes(std::span(out.raw_header.data(), out.raw_header.size()))));
  WEIGHTD_ASSIGN_OR_RETURN(
      uint64_t n,
      format::DecodeHeaderLength(
          ref.path, std::as_bytes(std::span(out.raw_header.data(), out.raw_header.size())), size));
  out.raw_header.resize(static_cast<size_t>(format::kHeaderLengthBytes + n));
  WEIGHTD_RETURN_IF_ERROR(out.file->ReadExactly(
      format::kHeaderLengthBytes,
      std::as_writable_bytes(
          std::span(out.raw_header.data() + format::kHeaderLengthBytes, static_cast<size_t>(n)))));
  WEIGHTD_ASSIGN_OR_RETURN(
      out.shard.header, format::ParseHeader(ref.path,
                                            std::as_bytes(std::span(
                                                out.raw_header.data() + format::kHeaderLengthBytes,
                                                static_cast<size_t>(n))),
                                            size));
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
  std::vector<std::optional<Error>> errors(shards.size());
  std::atomic<size_t> next{0};
  io::RunTeam(static_cast<int>(std::min<size_t>(shards.size(), kParallelHeaderReads)), [&](int) {
    for (size_t i; (i = next.fetch_add(1)) < shards.size();) {
      if (Status s = ReadHead(fs, listing.shards[i], shards[i]); !s.ok()) errors[i] = s.error();
    }
  });
  for (auto& e : errors) {
    if (e) return *e;
  }
  {
    std::vector<format::Shard> headers;
    for (const OpenShard& s : shards) headers.push_back(s.shard);
    WEIGHTD_RETURN_IF_ERROR(format::CheckAcrossShards(path, headers, listing.weight_map));
  }

  // The segment's layout: every tensor of every shard, by name.
  std::vector<memory::TensorLayout> layout;
  struct Source {
    size_t shard;
    uint64_t file_offset;
  };
  std::vector<std::pair<std::string, Source>> sources;
  for (size_t s = 0; s < shards.size(); ++s) {
    const format::ShardHeader& h = shards[s].shard.header;
    for (const format::TensorInfo& t : h.tensors) {
      layout.push_back({t.name, std::string(format::DTypeName(t.dtype)), t.shape, t.bytes(), 0});
      sources.push_back({t.name, {s, h.data_offset() + t.begin}});
    }
  }
  std::sort(sources.begin(), sources.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  WEIGHTD_ASSIGN_OR_RETURN(memory::SegmentPlan plan, memory::PlanSegment(std::move(layout)));

  auto allocated = options.allocate ? options.allocate(plan.total_bytes)
                                    : DefaultAllocate(plan.total_bytes, options.segment_name);
  if (!allocated.ok()) return allocated.error();
  std::unique_ptr<memory::Segment> segment = std::move(allocated).value();
  if (segment->size() < plan.total_bytes) return Error("the segment allocated is too small");
  std::span<std::byte> dst = segment->writable();
  memory::WriteManifest(plan, dst);

  // Every tensor's bytes, straight into place.
  std::vector<io::ReadRequest> requests;
  uint64_t total = 0;
  for (size_t i = 0; i < plan.tensors.size(); ++i) {
    const memory::TensorLayout& t = plan.tensors[i];
    const Source& from = sources[i].second;
    for (uint64_t at = 0; at < t.bytes; at += options.chunk_bytes) {
      const uint64_t n = std::min(options.chunk_bytes, t.bytes - at);
      requests.push_back({shards[from.shard].file.get(), from.file_offset + at,
                          dst.subspan(static_cast<size_t>(t.offset + at), static_cast<size_t>(n))});
    }
    total += t.bytes;
  }
  io::ReadStats stats;
  uint64_t done = 0;
  for (size_t begin = 0; begin < requests.size();) {
    size_t end = begin;
    uint64_t batch = 0;
    while (end < requests.size() && (end == begin || batch < kProgressBatchBytes)) {
      batch += requests[end].dst.size();
      ++end;
    }
    WEIGHTD_RETURN_IF_ERROR(io::ReadMany(std::span(requests).subspan(begin, end - begin),
                                         {.max_inflight = options.max_inflight}, &stats));
    done += batch;
    if (options.progress) options.progress(done, total);
    begin = end;
  }

  // The files must be what they were when their headers were read.
  for (const OpenShard& s : shards) {
    WEIGHTD_ASSIGN_OR_RETURN(io::StatSignature now, s.file->Stat());
    if (!(now == s.signature)) {
      return Error(s.shard.path + ": changed while being loaded; nothing was published");
    }
  }

  // The sampled fingerprint of what was loaded.
  LoadedModel model;
  std::vector<fingerprint::ShardFingerprint> digests;
  for (size_t s = 0; s < shards.size(); ++s) {
    std::vector<std::span<const std::byte>> samples;
    for (const format::TensorInfo& t : shards[s].shard.header.tensors) {
      auto it = std::lower_bound(
          plan.tensors.begin(), plan.tensors.end(), t.name,
          [](const memory::TensorLayout& l, const std::string& n) { return l.name < n; });
      samples.push_back(dst.subspan(static_cast<size_t>(it->offset),
                                    static_cast<size_t>(std::min(kSampleBytes, t.bytes()))));
    }
    fingerprint::ShardFingerprint f;
    f.name = shards[s].shard.name;
    f.digest = fingerprint::SampledShardDigest(
        shards[s].shard.file_size,
        std::as_bytes(std::span(shards[s].raw_header.data(), shards[s].raw_header.size())),
        samples);
    digests.push_back(std::move(f));
    model.tensors += shards[s].shard.header.tensors.size();
  }
  model.checkpoint_digest = fingerprint::CombineSampledShards(digests);
  WEIGHTD_RETURN_IF_ERROR(segment->Seal());
  model.segment = std::move(segment);
  model.shards = shards.size();
  model.data_bytes = total;
  model.reads = stats.reads + 2 * shards.size();
  model.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return model;
}

}  // namespace weightd::loader
