// A checkpoint: one .safetensors file, or a directory of shards with an
// optional model.safetensors.index.json. With an index, only the shards its
// weight_map names belong to the checkpoint; without one, every *.safetensors
// file in the directory does. Shards are kept in basename order, the order
// the fingerprint hashes them in.
//
// Shard names come from an untrusted file: a name that would leave the
// checkpoint directory (absolute, "..", a symlink resolving outside) is an
// error. The one exception is the Hugging Face hub cache, whose snapshot
// directories hold symlinks into the repository's blobs/ folder
// (models--org--name/snapshots/REV/x -> ../../blobs/SHA): a symlink from
// `<repo>/snapshots/<rev>/` into `<repo>/blobs/` is accepted.
//
// Thread safety: pure functions over the FileSystem given; safe from any thread.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "format/safetensors.h"
#include "io/file.h"

namespace weightd::format {

inline constexpr std::string_view kIndexFileName = "model.safetensors.index.json";

struct ShardRef {
  std::string name;  // relative to the checkpoint directory, as the index spells it
  std::string path;  // directory joined with name, for messages
  // With every symlink resolved, as checked against escapes: what to open,
  // following `symlinks`. In a directory's checkpoint that is none: the
  // check and the open are not one step, and a symlink put in the way
  // between them (by someone who may write the directory) fails the open
  // rather than being followed out of the checkpoint. A single file is the
  // path the user named, symlinks and all.
  std::string resolved;
  io::Symlinks symlinks = io::Symlinks::kFollow;
};

struct Shard {
  std::string name;
  std::string path;
  uint64_t file_size = 0;
  ShardHeader header;
};

struct Checkpoint {
  std::string path;  // what the caller gave
  bool is_directory = false;
  bool has_index = false;
  std::vector<Shard> shards;  // by name

  uint64_t tensor_count() const;
  uint64_t data_bytes() const;
  uint64_t file_bytes() const;
};

// An index's weight_map: each tensor it names, by name, and its shard. The
// names are views into the index's text, which the map keeps (an index of
// 70,000 tensors is read once and copied never, not 140,000 allocations).
class WeightMap {
 public:
  struct Entry {
    std::string_view tensor;
    uint32_t shard;  // into shards()
  };
  const std::vector<Entry>& entries() const { return entries_; }
  // Every shard the map names, in the order first named.
  const std::vector<std::string>& shards() const { return shards_; }
  const std::string& shard_of(const Entry& e) const { return shards_[e.shard]; }

 private:
  friend struct IndexParser;           // checkpoint.cc: ParseIndex, and ListShards without a copy
  std::shared_ptr<const void> names_;  // what the views are into; shared: copies keep them valid
  std::vector<Entry> entries_;
  std::vector<std::string> shards_;
};

struct ShardListing {
  std::vector<ShardRef> shards;  // by name
  bool has_index = false;
  // Whether a stat was seen to cost a round trip (a network or FUSE file
  // system): callers then spread their per-shard work over many threads.
  bool remote = false;
  // The directory with every symlink resolved (a file's own path for a
  // single-file checkpoint): a shard whose `resolved` is this joined with its
  // name is the regular file the listing saw, not a symlink.
  std::string real_dir;
  // The index's weight_map, when there is one.
  std::optional<WeightMap> weight_map;
  // File-system operations one after another that the listing cost (stat,
  // index lookup/open/read or directory read, shard lookups): what it costs
  // in round trips on a latency-bound file system.
  uint64_t round_trips = 0;
  // What reading the index cost.
  uint64_t reads = 0;
  uint64_t bytes_read = 0;
};

// Lets a caller that keeps a cache skip reading an index it has seen: the
// shard names are recalled by the index file's stat signature.
struct ListOptions {
  // The shard names an index with this signature listed, if known.
  std::function<std::optional<std::vector<std::string>>(const io::StatSignature&)> recall_index;
  // Called after an index was read, with the signature of the bytes read.
  std::function<void(const io::StatSignature&, const std::vector<std::string>&)> remember_index;
  // When a stat turns out to cost a round trip, start growing the shared
  // WorkerPool to this many threads, so the caller's many reads find them
  // ready instead of creating them on the critical path.
  int reserve_workers = 0;
  // Called once, from another thread, with the directory's entries when the
  // directory was listed early (see ListShards), before the index has been
  // read: lets a caller start opening the shards it expects while the index
  // is still on its way. Must return quickly; what it starts is the caller's
  // to check against the final listing.
  std::function<void(const std::vector<io::DirEntry>&)> on_early_listing;
};

// The shards of a checkpoint, without reading their headers: from the index
// when there is one (checked for escapes and missing files), else every
// *.safetensors file. A path to a single file gives that file. The shards'
// paths are checked many at once, recalled ones too. weight_map is set only
// when the index was read.
Result<ShardListing> ListShards(io::FileSystem& fs, const std::string& path,
                                const ListOptions& options = {});

// Parses an index's weight_map: tensor name -> shard name, sorted by tensor;
// a name listed twice is an error.
Result<WeightMap> ParseIndex(std::string_view label, std::string_view json);

// Every tensor of `shards` in name order, as (shard index, tensor index):
// a merge of the headers' own name order, cheaper than sorting the names.
std::vector<std::pair<size_t, size_t>> TensorsByName(const std::vector<Shard>& shards);

// The checks across shards, once every header is read: a tensor name in one
// shard only, and (with an index) each tensor the index maps found in the
// shard it names. `shards` by name.
Status CheckAcrossShards(const std::string& path, const std::vector<Shard>& shards,
                         const std::optional<WeightMap>& weight_map);
// The same, for a caller that has TensorsByName(shards) already.
Status CheckAcrossShards(const std::string& path, const std::vector<Shard>& shards,
                         const std::optional<WeightMap>& weight_map,
                         const std::vector<std::pair<size_t, size_t>>& by_name);

// Lists the shards and reads and validates every header (many at once).
// With an index, also checks that each tensor it maps is in the shard it
// names; across shards, a tensor name may appear once.
Result<Checkpoint> OpenCheckpoint(io::FileSystem& fs, const std::string& path);

}  // namespace weightd::format
