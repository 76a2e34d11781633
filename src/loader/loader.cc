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
#include "memory/host_memory.h"
#include "memory/manifest.h"
#include "transform/apply.h"
#include "transform/convert.h"

namespace weightd::loader {
namespace {

constexpr int kParallelHeaderReads = 16;
// Shards hashed at once, from memory.
constexpr size_t kDigestThreads = 4;
// Progress is reported between batches of reads of a 64th of the load,
// within these bounds (a small model's tenths are seen too; the daemon
// forwards at most one report per 100 ms).
constexpr uint64_t kMinProgressBatchBytes = 1 << 20;
constexpr uint64_t kMaxProgressBatchBytes = 256ull << 20;
const uint64_t kSampleBytes = fingerprint::Options{}.sample_bytes;

// Every read goes through a per-worker buffer and is written into the
// segments from there: a buffer this size stays in the cache, and a segment
// filled by writes is neither faulted nor zeroed page by page. Tensors
// below this size are read in runs of neighbours, one read per run.
constexpr uint64_t kStepBytes = 256 << 10;
// Source rows processed at once (cast, split by columns, quantized), about;
// and the most one band's buffers may take.
constexpr uint64_t kBandBytes = 1 << 20;
constexpr uint64_t kBufferBudget = 512ull << 20;

struct OpenShard {
  std::unique_ptr<io::RandomAccessFile> file;
  io::StatSignature signature;
  format::HeaderBytes raw_header;  // length prefix and JSON, as in the file
  bool in_page_cache = false;
};

// Opens one shard and reads its header, keeping the raw bytes for the digest.
Status ReadHead(io::FileSystem& fs, const format::ShardRef& ref, OpenShard& out,
                format::Shard& shard, format::HeaderAllowance& allowance) {
  shard.name = ref.name;
  shard.path = ref.path;
  WEIGHTD_ASSIGN_OR_RETURN(out.file, fs.Open(ref.resolved, ref.symlinks));
  WEIGHTD_ASSIGN_OR_RETURN(out.signature, out.file->Stat());
  shard.file_size = out.file->size();
  if (out.signature.size != shard.file_size)
    return Error(ref.path + ": changed while being loaded");
  WEIGHTD_ASSIGN_OR_RETURN(
      shard.header, format::ReadShardHeader(*out.file, ref.path, &out.raw_header, &allowance));
  return OkStatus();
}

// A source tensor: where its bytes are and where its fingerprint sample goes.
struct Source {
  size_t shard;
  uint64_t file_offset;  // of its first byte
  uint64_t bytes;
  uint64_t sample_at;  // into Samples::bytes, unless `whole`
  uint64_t sample_bytes;
  // Copied whole and unchanged into every segment, at `whole_at`, where
  // its sample is hashed from.
  bool whole = false;
  uint64_t whole_at = 0;
};

// The first KiB of every tensor the segments do not hold as the file has
// it, caught as the reads pass by. (Where the first segment can be read
// back while it is written, those copied whole are hashed from it: no copy
// of tens of megabytes for 70,000 small tensors.)
struct Samples {
  std::unique_ptr<std::byte[]> bytes;
  std::unique_ptr<std::atomic<bool>[]> caught;

  // `data` holds the tensor's bytes from `offset` on.
  void Offer(const Source& s, size_t index, uint64_t offset, std::span<const std::byte> data) {
    if (offset != 0 || data.size() < s.sample_bytes || caught[index].exchange(true)) return;
    std::memcpy(bytes.get() + s.sample_at, data.data(), static_cast<size_t>(s.sample_bytes));
  }
};

// Copies bytes as the file has them: a range of one big tensor, or a run of
// small neighbours read at once, each piece written to its place in every
// segment listed (replicated tensors go to all; a column split's rows only
// to their rank).
struct CopyJob {
  size_t shard;
  uint64_t file_offset;
  uint64_t bytes;
  struct Piece {
    uint64_t run_offset;
    uint64_t bytes;
    uint64_t dst_offset;  // in the segment
    size_t source;        // which tensor, for its sample
    uint64_t tensor_offset;
  };
  std::vector<Piece> pieces;
  std::vector<size_t> targets;  // indexes into the segments being built
};

// Produces output rows [row0, row1) of one output tensor, for one target
// (a column split: that rank's rows) or for all (row split, replicated).
struct BandJob {
  size_t output;
  uint64_t row0;
  uint64_t row1;
  std::vector<size_t> targets;
};

struct Target {
  int rank;
  memory::Segment* segment;
};

// A tensor copied whole and unchanged, as its copy jobs see it.
struct WholeTensor {
  uint64_t file_offset;
  uint64_t bytes;
  uint64_t dst_offset;
  size_t source;
};

// The jobs that copy one shard's `tensors` (in file order: by first byte;
// a tensor of no bytes may share its offset with a neighbour, before or
// after it) to `targets`: a big tensor in chunks, small neighbours in runs
// read at once. Each tensor's place in the segment and its source are
// `dst_base` and `source_base` on from what `tensors` say.
void AppendCopies(size_t shard, std::span<const WholeTensor> tensors, uint64_t dst_base,
                  size_t source_base, uint64_t chunk_bytes, const std::vector<size_t>& targets,
                  std::vector<CopyJob>& copies) {
  for (size_t k = 0; k < tensors.size();) {
    const WholeTensor& big = tensors[k];
    if (big.bytes >= kStepBytes) {
      for (uint64_t at = 0; at < big.bytes; at += chunk_bytes) {
        const uint64_t n = std::min(chunk_bytes, big.bytes - at);
        copies.push_back({shard,
                          big.file_offset + at,
                          n,
                          {{0, n, dst_base + big.dst_offset + at, source_base + big.source, at}},
                          targets});
      }
      ++k;
      continue;
    }
    CopyJob run{shard, big.file_offset, 0, {}, targets};
    while (k < tensors.size()) {
      const WholeTensor& small = tensors[k];
      const uint64_t end = small.file_offset + small.bytes;
      if (small.bytes >= kStepBytes || end - run.file_offset > kStepBytes) break;
      run.pieces.push_back({small.file_offset - run.file_offset, small.bytes,
                            dst_base + small.dst_offset, source_base + small.source, 0});
      run.bytes = std::max(run.bytes, end - run.file_offset);  // one of no bytes may come last
      ++k;
    }
    copies.push_back(std::move(run));
  }
}

// A shard laid out as its file has it, for loads that keep every tensor as
// stored: its tensors in file order, each at the next multiple of
// kTensorAlignment. It needs that shard's header alone, so each shard is
// laid out as soon as its header is parsed, many at once; the manifest,
// which needs every shard's tensors by name, is made while the weights
// are read. Offsets count from the start of the shard's run, and sources
// from its first tensor, until the runs are placed. (The jobs are made
// only once the segment is: sizes from a sparse file could claim more
// jobs than memory holds, and the allocation refuses such sizes first.)
struct ShardRun {
  std::vector<uint64_t> offsets;    // of each tensor, in the header's order (by name)
  std::vector<WholeTensor> placed;  // in file order
  uint64_t bytes = 0;               // every tensor padded
  uint64_t dims = 0;
  uint64_t name_bytes = 0;
  // Samples can be hashed in name order as the reads pass.
  bool file_order_is_name_order = true;
};

Result<ShardRun> LayOutShard(const format::Shard& shard) {
  const format::ShardHeader& h = shard.header;
  const std::vector<format::TensorInfo>& tensors = h.tensors;
  std::vector<size_t> order(tensors.size());
  for (size_t t = 0; t < order.size(); ++t) order[t] = t;
  ShardRun run;
  const auto in_file_order = [&](size_t a, size_t b) {  // a tensor of no bytes first
    return std::pair(tensors[a].begin, tensors[a].end) <
           std::pair(tensors[b].begin, tensors[b].end);
  };
  if (!std::is_sorted(order.begin(), order.end(), in_file_order)) {
    run.file_order_is_name_order = false;
    std::sort(order.begin(), order.end(), in_file_order);
  }
  run.offsets.resize(tensors.size());
  run.placed.reserve(tensors.size());
  uint64_t at = 0;
  for (size_t t : order) {
    const format::TensorInfo& info = tensors[t];
    // What a processing plan refuses of any tensor: rows too long to count
    // (a first dimension of 0 lets the file's rules pass any others).
    uint64_t row = 1;
    for (size_t d = 1; d < info.shape.size(); ++d) {
      if (__builtin_mul_overflow(row, info.shape[d], &row)) {
        return Error(shard.path + ": tensor `" + std::string(info.name) + "`: too many elements");
      }
    }
    run.offsets[t] = at;
    run.placed.push_back({h.data_offset() + info.begin, info.bytes(), at, t});
    // Sizes come from files: sparse ones can claim more than fits in 64 bits.
    if (__builtin_add_overflow(at, info.bytes(), &at) ||
        __builtin_add_overflow(at, memory::kTensorAlignment - 1, &at)) {
      return Error(shard.path + ": the tensors' sizes add up to more than a segment can hold");
    }
    at = at / memory::kTensorAlignment * memory::kTensorAlignment;
    run.dims += info.shape.size();
    run.name_bytes += info.name.size();
  }
  run.bytes = at;
  return run;
}

// Writes a run's pieces. Those that are neighbours in the segment too are
// laid out there in `staging`, with their alignment padding, and written
// at once: one write of many pieces would cost a host segment more, as the
// kernel walks them under the file's lock, which every writer waits for
// (70,000 small tensors: 4.5 ms of pieces there, 2 ms of copies here). A
// piece without neighbours is written as it is.
Status WriteRun(memory::Segment& segment, const CopyJob& job, const std::byte* run,
                std::vector<std::byte>& staging) {
  const std::vector<CopyJob::Piece>& pieces = job.pieces;
  for (size_t first = 0; first < pieces.size();) {
    size_t last = first + 1;  // past the neighbours of pieces[first]
    while (last < pieces.size()) {
      const uint64_t end = pieces[last - 1].dst_offset + pieces[last - 1].bytes;
      const uint64_t at = pieces[last].dst_offset;
      if (at < end || at - end >= memory::kTensorAlignment) break;
      ++last;
    }
    const CopyJob::Piece& head = pieces[first];
    if (last == first + 1) {
      WEIGHTD_RETURN_IF_ERROR(segment.Write(
          head.dst_offset, std::span(run + head.run_offset, static_cast<size_t>(head.bytes))));
    } else {
      staging.clear();
      for (size_t i = first; i < last; ++i) {
        const CopyJob::Piece& p = pieces[i];
        staging.resize(static_cast<size_t>(p.dst_offset - head.dst_offset), std::byte{0});
        staging.insert(staging.end(), run + p.run_offset, run + p.run_offset + p.bytes);
      }
      WEIGHTD_RETURN_IF_ERROR(segment.Write(head.dst_offset, staging));
    }
    first = last;
  }
  return OkStatus();
}

// Everything a worker needs to run jobs.
struct Context {
  const std::atomic<bool>* cancel;  // may be null
  // Told of the bytes of a big tensor's range as each step of it is read
  // (progress within a job of megabytes); set before any job runs.
  const std::function<void(uint64_t)>* advanced;
  const std::vector<OpenShard>& shards;
  const std::vector<Source>& sources;
  const std::vector<format::DType>& source_dtypes;
  const transform::TensorPlan& plan;
  const std::vector<uint64_t>& offsets;  // of each output in every segment
  const std::vector<Target>& targets;
  Samples& samples;
  // Set where each shard's samples are hashed as its jobs read them (one
  // worker runs a shard's jobs, in name order): the shard's digest so far.
  fingerprint::SampledShardHasher* const* streams;
};

// Hands a tensor's sample, found at the start of `data`, to its shard's
// digest when samples are hashed as they are read, else to `samples`.
void Sample(const Context& c, size_t shard, size_t source, uint64_t tensor_offset,
            std::span<const std::byte> data) {
  const Source& s = c.sources[source];
  if (c.streams == nullptr) {
    c.samples.Offer(s, source, tensor_offset, data);
  } else if (tensor_offset == 0) {
    c.streams[shard]->Add(data.first(static_cast<size_t>(s.sample_bytes)));
  }
}

// A worker's buffers, grown to the largest job it meets.
struct Buffers {
  std::vector<std::byte> in, out, scales, staging;
  std::span<std::byte> Get(std::vector<std::byte>& v, uint64_t n) {
    if (v.size() < n) v.resize(static_cast<size_t>(n));
    return std::span(v.data(), static_cast<size_t>(n));
  }
};

// A range of a big tensor, read a step at a time; else a run of tensors,
// read at once.
bool ReadInSteps(const CopyJob& job) { return job.pieces.size() == 1 && job.bytes > kStepBytes; }

// Returns the bytes read that were not told to c.advanced as they came.
Result<uint64_t> RunCopy(const Context& c, const CopyJob& job, Buffers& buf) {
  const io::RandomAccessFile& file = *c.shards[job.shard].file;
  if (ReadInSteps(job)) {
    const CopyJob::Piece& p = job.pieces[0];
    for (uint64_t at = 0; at < job.bytes; at += kStepBytes) {
      // A job is megabytes: a slow file system makes it seconds, and a
      // daemon stopping does not wait for them.
      if (c.cancel != nullptr && c.cancel->load()) return Error("the load was cancelled");
      const std::span<std::byte> chunk = buf.Get(buf.in, std::min(kStepBytes, job.bytes - at));
      WEIGHTD_RETURN_IF_ERROR(file.ReadExactly(job.file_offset + at, chunk));
      Sample(c, job.shard, p.source, p.tensor_offset + at, chunk);
      for (size_t t : job.targets) {
        WEIGHTD_RETURN_IF_ERROR(c.targets[t].segment->Write(p.dst_offset + at, chunk));
      }
      (*c.advanced)(chunk.size());
    }
    return 0;  // every byte told as it came
  }
  const std::span<std::byte> run = buf.Get(buf.in, job.bytes);
  WEIGHTD_RETURN_IF_ERROR(file.ReadExactly(job.file_offset, run));
  for (const CopyJob::Piece& p : job.pieces) {
    Sample(c, job.shard, p.source, p.tensor_offset,
           run.subspan(static_cast<size_t>(p.run_offset), static_cast<size_t>(p.bytes)));
  }
  for (size_t t : job.targets)
    WEIGHTD_RETURN_IF_ERROR(WriteRun(*c.targets[t].segment, job, run.data(), buf.staging));
  return job.bytes;
}

Result<uint64_t> RunBand(const Context& c, const BandJob& job, Buffers& buf) {
  const transform::OutputTensor& out = c.plan.outputs[job.output];
  const Source& src = c.sources[out.source];
  const format::DType dtype = c.source_dtypes[out.source];
  const io::RandomAccessFile& file = *c.shards[src.shard].file;
  const uint64_t in_row = transform::SourceRowBytes(out, dtype);
  const uint64_t out_row = transform::OutputRowBytes(out);
  const uint64_t rows = job.row1 - job.row0;
  const std::span<std::byte> dst = buf.Get(buf.out, rows * out_row);
  const bool quantize = out.op == transform::Op::kQuantize;
  const transform::OutputTensor* scale = quantize ? &c.plan.outputs[out.scale] : nullptr;
  const uint64_t scale_row = scale ? transform::OutputRowBytes(*scale) : 0;
  const uint64_t scale_rows = scale ? transform::CeilDiv(rows, transform::kFp8Block) : 0;
  const std::span<std::byte> scales = buf.Get(buf.scales, scale_rows * scale_row);
  // Replicated outputs are the same for every rank: made once, written to all.
  const bool same_for_all = out.split == transform::Split::kReplicate;
  uint64_t read_rows_first = UINT64_MAX, read_bytes = 0;
  std::span<std::byte> in;
  for (size_t i = 0; i < job.targets.size(); ++i) {
    const Target& target = c.targets[job.targets[i]];
    if (i == 0 || !same_for_all) {
      const transform::RowRange need =
          transform::SourceRowsFor(out, target.rank, job.row0, job.row1);
      if (need.first != read_rows_first) {  // a row split's ranks share one read
        in = buf.Get(buf.in, (need.last - need.first) * in_row);
        WEIGHTD_RETURN_IF_ERROR(file.ReadExactly(src.file_offset + need.first * in_row, in));
        c.samples.Offer(src, out.source, need.first * in_row, in);
        read_rows_first = need.first;
        read_bytes += in.size();
      }
      transform::ApplyRows(out, dtype, target.rank, job.row0, job.row1, in, dst, scales);
    }
    WEIGHTD_RETURN_IF_ERROR(target.segment->Write(c.offsets[job.output] + job.row0 * out_row, dst));
    if (scale != nullptr) {
      WEIGHTD_RETURN_IF_ERROR(target.segment->Write(
          c.offsets[out.scale] + job.row0 / transform::kFp8Block * scale_row, scales));
    }
  }
  return read_bytes;
}

Result<std::unique_ptr<memory::Segment>> DefaultAllocate(uint64_t bytes, const std::string& name) {
  return memory::CreateHostSegment(bytes, name);
}

std::vector<size_t> AllTargets(size_t n) {
  std::vector<size_t> all(n);
  for (size_t i = 0; i < n; ++i) all[i] = i;
  return all;
}

}  // namespace

Result<LoadedModel> LoadCheckpoint(io::FileSystem& fs, const std::string& path,
                                   const LoadOptions& options) {
  const auto start = std::chrono::steady_clock::now();
  auto since = [](std::chrono::steady_clock::time_point t) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
  };
  const transform::Processing& processing = options.processing;
  const bool identity = processing.tp_size == 1 && !processing.dtype && !processing.fp8_block;
  if (!identity && processing.plan == nullptr) return Error("processing without a shard plan");
  std::vector<int> ranks = options.ranks;
  if (ranks.empty()) {
    for (int r = 0; r < processing.tp_size; ++r) ranks.push_back(r);
  }
  for (int r : ranks) {
    if (r < 0 || r >= processing.tp_size) {
      return Error("--tp-rank " + std::to_string(r) + " is not below --tp-size " +
                   std::to_string(processing.tp_size));
    }
  }
  if (options.chunk_bytes == 0) return Error("reads of no bytes");
  LoadedModel model;
  WEIGHTD_ASSIGN_OR_RETURN(format::ShardListing listing, format::ListShards(fs, path));

  // Headers: every shard open, many at once; where every tensor is kept as
  // it is stored, each shard laid out as soon as its header is parsed.
  std::vector<OpenShard> shards(listing.shards.size());
  std::vector<format::Shard> headers(shards.size());
  std::vector<ShardRun> runs(identity ? shards.size() : 0);
  std::vector<std::optional<Error>> errors(shards.size());
  std::atomic<size_t> next{0};
  std::atomic<bool> any_uncached{false};
  format::HeaderAllowance allowance;  // all are kept until every one is read
  io::RunTeam(static_cast<int>(std::min<size_t>(shards.size(), kParallelHeaderReads)), [&](int) {
    for (size_t i; (i = next.fetch_add(1)) < shards.size();) {
      if (Status s = ReadHead(fs, listing.shards[i], shards[i], headers[i], allowance); !s.ok()) {
        errors[i] = s.error();
        continue;
      }
      // Once one shard is not, none needs asking (on kernels without
      // cachestat, each is a mapping).
      shards[i].in_page_cache = !any_uncached.load() && shards[i].file->InPageCache();
      if (!shards[i].in_page_cache) any_uncached.store(true);
      if (!identity) continue;
      auto run = LayOutShard(headers[i]);
      if (!run.ok()) {
        errors[i] = run.error();
        continue;
      }
      runs[i] = std::move(run).value();
    }
  });
  for (auto& e : errors) {
    if (e) return *e;
  }
  const auto planning = std::chrono::steady_clock::now();
  model.phases.headers = std::chrono::duration<double>(planning - start).count();

  // Every tensor of every shard: the sources of the plan.
  std::vector<Source> sources;
  std::vector<format::DType> source_dtypes;
  std::vector<std::vector<size_t>> index_of(shards.size());  // shard's tensor -> source
  transform::TensorPlan plan;
  std::vector<uint64_t> offsets;  // of each output
  // Where tensors are kept as they are stored, the shards' runs back to back
  // after the manifest, which is planned by the worker that writes it;
  // else the segment planned here, each output by name.
  std::optional<memory::SegmentPlan> segment_plan;
  std::vector<uint64_t> run_at(runs.size());
  uint64_t total_bytes = 0, tensor_count = 0;
  std::vector<CopyJob> copies;
  // The checks across shards (a tensor in one shard only, the index),
  // before any room is made for the load: a daemon would evict idle models
  // for one that cannot finish. Where tensors are kept as stored, the
  // manifest is made of the same merge while the weights are read.
  const std::vector<std::pair<size_t, size_t>> by_name = format::TensorsByName(headers);
  WEIGHTD_RETURN_IF_ERROR(format::CheckAcrossShards(path, headers, listing.weight_map, by_name));
  if (identity) {
    uint64_t dims = 0, name_bytes = 0;
    for (const ShardRun& r : runs) {
      tensor_count += r.offsets.size();
      dims += r.dims;
      name_bytes += r.name_bytes;
    }
    total_bytes = memory::DataOffsetAfter(memory::ManifestBytes(tensor_count, dims, name_bytes));
    sources.reserve(tensor_count);
    for (size_t s = 0; s < runs.size(); ++s) {
      run_at[s] = total_bytes;
      if (__builtin_add_overflow(total_bytes, runs[s].bytes, &total_bytes)) {
        return Error(path + ": the tensors' sizes add up to more than a segment can hold");
      }
      const format::ShardHeader& h = headers[s].header;
      index_of[s].resize(h.tensors.size());
      for (size_t t = 0; t < h.tensors.size(); ++t) {
        const format::TensorInfo& info = h.tensors[t];
        index_of[s][t] = sources.size();
        const uint64_t sample = std::min(kSampleBytes, info.bytes());
        sources.push_back({s, h.data_offset() + info.begin, info.bytes(), 0, sample});
        sources.back().whole_at = run_at[s] + runs[s].offsets[t];
      }
    }
  } else {
    std::vector<transform::SourceTensor> source_tensors;
    source_tensors.reserve(by_name.size());
    sources.reserve(by_name.size());
    for (size_t s = 0; s < shards.size(); ++s) index_of[s].resize(headers[s].header.tensors.size());
    for (const auto& [s, t] : by_name) {
      const format::ShardHeader& h = headers[s].header;
      const format::TensorInfo& info = h.tensors[t];
      index_of[s][t] = sources.size();
      source_tensors.push_back({info.name, info.dtype, info.shape, info.bytes()});
      source_dtypes.push_back(info.dtype);
      const uint64_t sample = std::min(kSampleBytes, info.bytes());
      sources.push_back({s, h.data_offset() + info.begin, info.bytes(), 0, sample});
    }
    // The processing, checked against the headers before any weight byte.
    auto planned = transform::PlanTensors(source_tensors, processing);
    if (!planned.ok()) return Error(path + ": " + planned.error().message());
    plan = std::move(planned).value();
    source_tensors.clear();
    std::vector<memory::TensorLayout> layout;
    layout.reserve(plan.outputs.size());
    for (const transform::OutputTensor& o : plan.outputs) {
      layout.push_back({o.name, format::DTypeName(o.dtype), o.shape, o.bytes, 0});
    }
    WEIGHTD_ASSIGN_OR_RETURN(segment_plan, memory::PlanSegment(std::move(layout)));
    offsets.resize(plan.outputs.size());
    for (size_t i = 0; i < offsets.size(); ++i) offsets[i] = segment_plan->tensors[i].offset;
    total_bytes = segment_plan->total_bytes;
    tensor_count = plan.outputs.size();
  }

  // Every rank's segment. Its manifest (the same for all ranks) is written
  // by the first worker, while the others read.
  std::vector<Target> targets;
  {
    for (int r : ranks) {
      auto allocated =
          options.allocate
              ? options.allocate(total_bytes, r)
              : DefaultAllocate(total_bytes,
                                options.segment_name +
                                    (processing.tp_size > 1 ? "-rank" + std::to_string(r) : ""));
      if (!allocated.ok()) return allocated.error();
      if ((*allocated)->size() < total_bytes) {
        return Error("the segment allocated is too small");
      }
      model.ranks.push_back({r, std::move(allocated).value()});
      targets.push_back({r, model.ranks.back().segment.get()});
    }
  }
  if (targets.empty()) return Error("no rank to load");
  // Samples of tensors copied whole are hashed from the first segment, as
  // soon as their shard is written, where it can be read while the rest is
  // written; else caught as the reads pass, as for the others.
  // (A view made at Seal, where none could be made early, may not be this
  // one: `wholes` is taken again then, for the shards hashed after it.)
  const std::byte* wholes = targets.front().segment->readable().data();
  const bool hash_from_segment =
      wholes != nullptr && targets.front().segment->readable().size() >= total_bytes;

  // The jobs. Bytes kept as they are go by runs of small neighbours (in
  // file order) and chunks of big tensors; whatever is cut by columns,
  // cast or quantized goes by bands of rows.
  std::vector<BandJob> bands;
  std::vector<std::pair<size_t, std::pair<uint64_t, uint64_t>>> zeros;  // target, [offset, bytes)
  const std::vector<size_t> all_targets = AllTargets(targets.size());
  if (identity) {  // every tensor copied whole, shard by shard as laid out
    for (Source& s : sources) s.whole = hash_from_segment;
    size_t first = 0;  // each shard's first source
    for (size_t s = 0; s < runs.size(); ++s) {
      AppendCopies(s, runs[s].placed, run_at[s], first, options.chunk_bytes, all_targets, copies);
      first += runs[s].offsets.size();
      runs[s].placed = {};
    }
  }
  std::vector<std::vector<size_t>> replicated_by_shard(shards.size());  // outputs copied whole
  for (size_t i = 0; i < plan.outputs.size(); ++i) {
    const transform::OutputTensor& o = plan.outputs[i];
    const Source& src = sources[o.source];
    if (o.op == transform::Op::kScale) continue;  // made with the weight before it
    if (o.op == transform::Op::kCopy && o.split == transform::Split::kReplicate) {
      replicated_by_shard[src.shard].push_back(i);
      sources[o.source].whole = hash_from_segment;
      sources[o.source].whole_at = offsets[i];
      continue;
    }
    if (o.op == transform::Op::kCopy && o.split != transform::Split::kRow) {
      // A column or vocab split kept as is: each rank's rows are one range.
      const uint64_t row_bytes = transform::SourceRowBytes(o, source_dtypes[o.source]);
      for (size_t t = 0; t < targets.size(); ++t) {
        const transform::RowRange rows = transform::SourceRowsFor(o, targets[t].rank, 0, o.rows);
        const uint64_t bytes = (rows.last - rows.first) * row_bytes;
        for (uint64_t at = 0; at < bytes; at += options.chunk_bytes) {
          const uint64_t n = std::min(options.chunk_bytes, bytes - at);
          const uint64_t tensor_offset = rows.first * row_bytes + at;
          copies.push_back({src.shard,
                            src.file_offset + tensor_offset,
                            n,
                            {{0, n, offsets[i] + at, o.source, tensor_offset}},
                            {t}});
        }
        if (bytes < o.bytes) zeros.push_back({t, {offsets[i] + bytes, o.bytes - bytes}});
      }
      continue;
    }
    // Bands: about kBandBytes of source rows, whole 128-row blocks when
    // quantizing. Rows of no bytes (a dimension of 0 after the first) have
    // nothing to read or write, however many there are: a header may say
    // [2^62, 0].
    const uint64_t source_row = transform::SourceRowBytes(o, source_dtypes[o.source]);
    const uint64_t output_row = transform::OutputRowBytes(o);
    if (source_row == 0 && output_row == 0) continue;
    const uint64_t row_bytes = std::max<uint64_t>({source_row, output_row, 1});
    uint64_t band = std::max<uint64_t>(1, kBandBytes / row_bytes);
    if (o.op == transform::Op::kQuantize) {
      band = std::max<uint64_t>(1, band / transform::kFp8Block) * transform::kFp8Block;
    }
    const bool per_rank =
        o.split == transform::Split::kColumn || o.split == transform::Split::kVocab;
    for (uint64_t r0 = 0; r0 < o.rows; r0 += band) {
      const uint64_t r1 = std::min(o.rows, r0 + band);
      if (per_rank) {
        for (size_t t = 0; t < targets.size(); ++t) bands.push_back({i, r0, r1, {t}});
      } else {
        bands.push_back({i, r0, r1, all_targets});
      }
    }
  }
  for (size_t s = 0; s < shards.size(); ++s) {
    std::vector<size_t>& outs = replicated_by_shard[s];
    // Writers mostly store tensors by name, as the outputs come: checking
    // is cheaper than sorting 70,000 again.
    const auto in_file_order = [&](size_t a, size_t b) {
      return sources[plan.outputs[a].source].file_offset <
             sources[plan.outputs[b].source].file_offset;
    };
    if (!std::is_sorted(outs.begin(), outs.end(), in_file_order)) {
      std::sort(outs.begin(), outs.end(), in_file_order);
    }
    std::vector<WholeTensor> wholes_of_shard;
    wholes_of_shard.reserve(outs.size());
    for (size_t i : outs) {
      const Source& src = sources[plan.outputs[i].source];
      wholes_of_shard.push_back({src.file_offset, src.bytes, offsets[i], plan.outputs[i].source});
    }
    AppendCopies(s, wholes_of_shard, 0, 0, options.chunk_bytes, all_targets, copies);
  }

  // The workers' buffers, all together, stay within buffer_bytes (each
  // worker's as big as its largest job): fewer workers for big jobs, one
  // at least; and an error for rows too long for one band within
  // kBufferBudget.
  uint64_t largest_band = 0;
  for (const BandJob& j : bands) {
    const transform::OutputTensor& o = plan.outputs[j.output];
    const uint64_t rows = j.row1 - j.row0;
    uint64_t bytes = 0;
    if (__builtin_mul_overflow(
            rows,
            transform::SourceRowBytes(o, source_dtypes[o.source]) + transform::OutputRowBytes(o),
            &bytes) ||
        bytes > kBufferBudget) {
      return Error(path + ": tensor `" + std::string(o.name) + "`: rows of " +
                   std::to_string(transform::SourceRowBytes(o, source_dtypes[o.source])) +
                   " bytes are too long to process " + std::to_string(rows) + " at a time");
    }
    largest_band = std::max(largest_band, bytes);
  }
  uint64_t largest_job = largest_band;
  for (const CopyJob& j : copies) {
    largest_job = std::max(largest_job, ReadInSteps(j) ? kStepBytes : j.bytes);
  }
  int max_inflight = std::max(options.max_inflight, 1);
  if (largest_job > 0) {
    max_inflight = static_cast<int>(std::min<uint64_t>(
        max_inflight, std::max<uint64_t>(1, options.buffer_bytes / largest_job)));
  }

  // Reads the page cache answers never wait: beyond a worker per CPU,
  // workers only take turns on a segment's lock and push each other's
  // buffers out of the CPUs' caches (on 2 cores, 2 workers preload a
  // 70,000-tensor model 12% faster than 32). Reads from storage keep many
  // in flight.
  const bool cached =
      std::all_of(shards.begin(), shards.end(), [](const OpenShard& s) { return s.in_page_cache; });
  if (cached) max_inflight = std::min(max_inflight, memory::HostCpus());
  const size_t jobs = 1 + copies.size() + bands.size();  // the manifests first
  const int workers = static_cast<int>(std::min<size_t>(jobs, static_cast<size_t>(max_inflight)));
  model.workers = workers;

  // Samples hashed as they are read. Hashing them afterwards, from the
  // segment, reads a model of small tensors (whose samples are most of
  // their bytes) a second time from memory: 20 ms of 100 for 70,000 tensors
  // on 2 cores. As they pass, they are in the CPU's cache, but a shard's
  // digest takes them in name order: so each worker takes a whole shard's
  // jobs in turn, in file order. Worth it where samples are a good part of
  // the bytes (an eighth or more; a model of big tensors has a KiB in
  // megabytes, and whole shards per worker would only balance the work
  // worse). It needs every read answered from memory (from storage, many
  // reads in flight matter more than their order), every tensor copied as
  // it is, each shard's tensors in the same order by name as in the file
  // (as writers store them), a shard for every worker, and a tensor's
  // sample within its first read.
  uint64_t sample_bytes = 0, data_bytes = 0;
  for (const Source& s : sources) {
    sample_bytes += s.sample_bytes;
    data_bytes += s.bytes;
  }
  bool stream =
      cached && identity && bands.empty() && zeros.empty() && sample_bytes >= data_bytes / 8 &&
      shards.size() >= static_cast<size_t>(workers) && options.chunk_bytes >= kSampleBytes &&
      std::is_sorted(copies.begin(), copies.end(),
                     [](const CopyJob& a, const CopyJob& b) { return a.shard < b.shard; });
  for (size_t s = 0; stream && s < shards.size(); ++s) {
    if (identity) {
      stream = runs[s].file_order_is_name_order;
      continue;
    }
    for (size_t t = 1; t < index_of[s].size(); ++t) {
      if (sources[index_of[s][t]].file_offset < sources[index_of[s][t - 1]].file_offset) {
        stream = false;
        break;
      }
    }
  }
  std::vector<std::unique_ptr<fingerprint::SampledShardHasher>> hashers;
  std::vector<fingerprint::SampledShardHasher*> streams;
  std::vector<size_t> shard_jobs;  // streaming: shard s's are [shard_jobs[s], shard_jobs[s + 1])
  if (stream) {
    for (size_t s = 0; s < shards.size(); ++s) {
      hashers.push_back(std::make_unique<fingerprint::SampledShardHasher>(
          headers[s].file_size, shards[s].raw_header.raw()));
      streams.push_back(hashers.back().get());
    }
    shard_jobs.assign(shards.size() + 1, 0);
    for (const CopyJob& j : copies) ++shard_jobs[j.shard + 1];
    shard_jobs[0] = 1;  // after the manifests
    for (size_t s = 0; s < shards.size(); ++s) shard_jobs[s + 1] += shard_jobs[s];
  }

  // Run them all, many at once.
  Samples samples;
  {
    uint64_t total = 0;
    for (Source& s : sources) {
      if (s.whole || stream) continue;
      s.sample_at = total;
      total += s.sample_bytes;
    }
    samples.bytes.reset(new std::byte[total]);
  }
  samples.caught.reset(new std::atomic<bool>[sources.size()]);
  // Caught already: a sample hashed from the segment, or one of no bytes
  // (a tensor of no elements, which no job reads).
  for (size_t i = 0; i < sources.size(); ++i) {
    samples.caught[i].store(stream || sources[i].whole || sources[i].sample_bytes == 0);
  }
  std::function<void(uint64_t)> advanced;
  const Context context{
      options.cancel, &advanced, shards,  sources, source_dtypes,
      plan,           offsets,   targets, samples, stream ? streams.data() : nullptr};
  // The manifest of runs placed already: every shard's tensors by name,
  // made while the others read (an error still publishes nothing).
  auto plan_placed = [&]() -> Result<memory::SegmentPlan> {
    std::vector<memory::TensorLayout> layout;
    layout.reserve(by_name.size());
    for (const auto& [s, t] : by_name) {
      const format::TensorInfo& info = headers[s].header.tensors[t];
      layout.push_back({info.name, format::DTypeName(info.dtype), info.shape, info.bytes(),
                        run_at[s] + runs[s].offsets[t]});
    }
    auto placed = memory::PlanPlacedSegment(std::move(layout), total_bytes);
    if (!placed.ok()) return Error(path + ": " + placed.error().message());
    if (!runs.empty() && placed->data_offset != run_at[0]) {
      return Error(path + ": the manifest planned does not fit before the tensors placed");
    }
    return placed;
  };
  auto write_manifests = [&]() -> Status {
    if (!segment_plan) {
      WEIGHTD_ASSIGN_OR_RETURN(segment_plan, plan_placed());
    }
    // A piece at a time: 70,000 tensors' manifest is 8 MB, which a buffer
    // of its own would take in fresh pages. A segment this process cannot
    // read (a GPU's) needs the manifest kept here too: it gets it whole.
    const bool all_readable = std::all_of(
        targets.begin(), targets.end(), [](const Target& t) { return t.segment->readable_here(); });
    if (!all_readable) model.manifest.reserve(static_cast<size_t>(segment_plan->manifest_bytes));
    return memory::StreamManifest(
        *segment_plan,
        all_readable ? kStepBytes : static_cast<size_t>(segment_plan->manifest_bytes),
        [&](uint64_t at, std::span<const std::byte> piece) -> Status {
          for (const Target& t : targets) WEIGHTD_RETURN_IF_ERROR(t.segment->Write(at, piece));
          if (!all_readable)
            model.manifest.insert(model.manifest.end(), piece.begin(), piece.end());
          return OkStatus();
        });
  };
  // The sampled fingerprint of what was read, shard by shard: of a shard as
  // soon as its last job is done and every sample of it was caught (while
  // other shards are read), of the others at the end.
  std::vector<fingerprint::ShardFingerprint> digests(shards.size());
  auto digest_shard = [&](size_t s) {
    std::vector<std::span<const std::byte>> shard_samples;
    shard_samples.reserve(index_of[s].size());
    for (size_t i : index_of[s]) {
      const Source& src = sources[i];
      const std::byte* at = src.whole ? wholes + src.whole_at : samples.bytes.get() + src.sample_at;
      shard_samples.push_back(std::span(at, static_cast<size_t>(src.sample_bytes)));
    }
    digests[s].name = headers[s].name;
    digests[s].digest = fingerprint::SampledShardDigest(headers[s].file_size,
                                                        shards[s].raw_header.raw(), shard_samples);
  };
  auto shard_of = [&](size_t job) {
    return job < copies.size()
               ? copies[job].shard
               : sources[plan.outputs[bands[job - copies.size()].output].source].shard;
  };
  std::unique_ptr<std::atomic<size_t>[]> jobs_left(new std::atomic<size_t>[shards.size()]);
  for (size_t s = 0; s < shards.size(); ++s) jobs_left[s].store(0);
  for (size_t j = 0; j + 1 < jobs; ++j) jobs_left[shard_of(j)].fetch_add(1);
  std::vector<char> digested(shards.size(), 0);  // each set by one worker, read after all end
  auto all_caught = [&](size_t s) {
    return std::all_of(index_of[s].begin(), index_of[s].end(),
                       [&](size_t i) { return samples.caught[i].load(); });
  };
  uint64_t total = 0;
  for (const CopyJob& j : copies) total += j.bytes;
  for (const BandJob& j : bands) {
    const transform::OutputTensor& o = plan.outputs[j.output];
    total += (j.row1 - j.row0) * transform::SourceRowBytes(o, source_dtypes[o.source]);
  }
  model.phases.plan = since(planning);
  const auto reading = std::chrono::steady_clock::now();
  std::atomic<size_t> next_job{0};
  std::atomic<bool> failed{false};
  std::mutex mu;  // guards error, progress and stats
  std::optional<Error> error;
  uint64_t done = 0, reported = 0, reads = 0;
  const uint64_t progress_batch =
      std::clamp(total / 64, kMinProgressBatchBytes, kMaxProgressBatchBytes);
  // REQUIRES: mu held. Counts bytes read, and reports a batch's worth.
  auto account = [&](uint64_t bytes) {
    done += bytes;
    // The end once (a job's end may tell no new byte), and an empty load's.
    const bool end = done == total && (done != reported || total == 0);
    if (options.progress && (done - reported >= progress_batch || end)) {
      reported = done;
      options.progress(done, total);
    }
  };
  advanced = [&](uint64_t bytes) {
    std::lock_guard lock(mu);
    account(bytes);
  };
  // The next job for a worker: the next in one order for all, or, where
  // samples are hashed as they are read, the next of the shard it holds,
  // else the first of the next shard no worker has taken (the manifests
  // go to the first to ask). `jobs` when none is left.
  std::atomic<size_t> next_held{0};
  auto take = [&](size_t& at, size_t& end) -> size_t {
    if (!stream) return next_job.fetch_add(1);
    if (next_job.fetch_add(1) == 0) return 0;
    while (at == end) {
      const size_t s = next_held.fetch_add(1);
      if (s >= shards.size()) return jobs;
      at = shard_jobs[s];
      end = shard_jobs[s + 1];
    }
    return at++;
  };
  io::RunTeam(workers, [&](int) {
    Buffers buffers;
    size_t at = 0, end = 0;  // the jobs left of the shard this worker holds
    for (size_t i; !failed.load() && (i = take(at, end)) < jobs;) {
      if (options.cancel != nullptr && options.cancel->load()) {
        std::lock_guard lock(mu);
        if (!error) error = Error("the load was cancelled");
        failed.store(true);
        return;
      }
      Result<uint64_t> read = uint64_t{0};
      try {
        if (i == 0) {
          if (Status s = write_manifests(); !s.ok()) read = s.error();
        } else {
          const size_t job = i - 1;
          read = job < copies.size() ? RunCopy(context, copies[job], buffers)
                                     : RunBand(context, bands[job - copies.size()], buffers);
          // The last job of its shard: its digest now, on this worker,
          // while the others read on.
          if (const size_t s = shard_of(job);
              read.ok() && jobs_left[s].fetch_sub(1) == 1 && all_caught(s)) {
            if (stream) {
              digests[s].name = headers[s].name;
              digests[s].digest = streams[s]->Digest();
            } else {
              digest_shard(s);
            }
            digested[s] = 1;
          }
        }
      } catch (...) {
        // An allocation refused, say: the others stop at their next job,
        // and RunTeam hands this to the caller.
        failed.store(true);
        throw;
      }
      std::lock_guard lock(mu);
      if (!read.ok()) {
        if (!error) error = read.error();
        failed.store(true);
        return;
      }
      if (i == 0) continue;  // the manifests: no read, no progress
      ++reads;
      account(*read);
    }
  });
  if (error) return *error;
  const auto finishing = std::chrono::steady_clock::now();
  // Vocab padding, from one small buffer: a crafted shape can make it as
  // big as the segment, which may be a GPU's (not zeroed when made).
  if (!zeros.empty()) {
    const std::vector<std::byte> zero(static_cast<size_t>(kBandBytes));
    for (const auto& [t, range] : zeros) {
      for (uint64_t at = 0; at < range.second; at += zero.size()) {
        const auto n = static_cast<size_t>(std::min<uint64_t>(zero.size(), range.second - at));
        WEIGHTD_RETURN_IF_ERROR(
            targets[t].segment->Write(range.first + at, std::span(zero).first(n)));
      }
    }
  }

  // Samples no read passed by (a rank that reads only part of a tensor).
  for (size_t i = 0; i < sources.size(); ++i) {
    if (samples.caught[i].load() || sources[i].sample_bytes == 0) continue;
    const Source& s = sources[i];
    WEIGHTD_RETURN_IF_ERROR(shards[s.shard].file->ReadExactly(
        s.file_offset,
        std::span(samples.bytes.get() + s.sample_at, static_cast<size_t>(s.sample_bytes))));
    ++reads;
    done += s.sample_bytes;
  }

  for (LoadedRank& r : model.ranks) WEIGHTD_RETURN_IF_ERROR(r.segment->Seal());
  if (hash_from_segment) {
    wholes = targets.front().segment->readable().data();
    if (wholes == nullptr || targets.front().segment->readable().size() < total_bytes) {
      return Error("the sealed segment cannot be read back");
    }
  }

  // The files must be what they were when their headers were read.
  for (size_t s = 0; s < shards.size(); ++s) {
    WEIGHTD_ASSIGN_OR_RETURN(io::StatSignature now, shards[s].file->Stat());
    if (!(now == shards[s].signature)) {
      return Error(headers[s].path + ": changed while being loaded");
    }
    model.read_shards.push_back({headers[s].name, now});
  }

  // The shards not digested yet, many at once.
  std::atomic<size_t> next_shard{0};
  io::RunTeam(static_cast<int>(std::min<size_t>(shards.size(), kDigestThreads)), [&](int) {
    for (size_t s; (s = next_shard.fetch_add(1)) < shards.size();) {
      if (!digested[s]) digest_shard(s);
    }
  });
  model.checkpoint_digest = fingerprint::CombineSampledShards(digests);
  model.shards = shards.size();
  model.tensors = tensor_count;
  model.data_bytes = done;
  model.reads = reads + 2 * shards.size();
  model.phases.read = std::chrono::duration<double>(finishing - reading).count();
  model.phases.finish = since(finishing);
  model.seconds = since(start);
  return model;
}

}  // namespace weightd::loader
