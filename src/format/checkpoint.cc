#include "format/checkpoint.h"

#include <fcntl.h>
#include <simdjson.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <charconv>
#include <chrono>
#include <cstring>
#include <ctime>
#include <deque>
#include <new>
#include <optional>
#include <system_error>
#include <thread>
#include <unordered_map>

#include "format/json.h"
#include "format/rules.h"
#include "io/read_many.h"
#include "io/worker_pool.h"

namespace weightd::format {
namespace {

// An index lists every tensor once; even a 100k-tensor model's index is
// about 10 MB. Anything far beyond is not an index we should trust with
// memory: parsing one takes about ten times its size.
constexpr uint64_t kMaxIndexBytes = 64ull << 20;
constexpr int kMaxParallelHeaderReads = 16;
constexpr size_t kMaxParallelPathChecks = 128;
// A metadata call that waited longer than this for its answer went over a
// network (or to a FUSE daemon): a local stat, or one answered from an
// attribute cache, takes microseconds.
constexpr auto kRoundTripProbe = std::chrono::microseconds(500);

// One metadata call timed, to tell a file system that answers over a
// network (or through a FUSE daemon) from a local one: the call took over
// kRoundTripProbe, and this thread slept that long in it (waiting for the
// answer). On a busy machine a local stat takes as long while the thread
// waits for a core, preempted or after a short sleep (a page reclaimed in
// a full control group); taken for remote, the checkpoint would get
// hundreds of reads in flight, a thread each (seen under a parallel test
// run: 512 threads in a daemon with 256 MiB), and no stat shortcut.
class RoundTripProbe {
 public:
  RoundTripProbe() : start_(Clock::now()), sleeps_(Sleeps()), busy_(BusyNs()) {}
  bool Slow() const {
    const Clock::duration wall = Clock::now() - start_;
    if (wall <= kRoundTripProbe) return false;
    const std::optional<long> sleeps = Sleeps();
    if (sleeps && sleeps_ && *sleeps == *sleeps_) return false;  // never slept
    const std::optional<uint64_t> busy = BusyNs();
    if (!busy || !busy_) return true;  // slept, for how long unknown
    const auto on_or_waiting = std::chrono::nanoseconds(*busy - std::min(*busy, *busy_));
    return wall - on_or_waiting > kRoundTripProbe;
  }

 private:
  using Clock = std::chrono::steady_clock;
  // How many times this thread gave up its core to wait (voluntary
  // context switches).
  static std::optional<long> Sleeps() {
    rusage usage;
    if (::getrusage(RUSAGE_THREAD, &usage) != 0) return std::nullopt;
    return usage.ru_nvcsw;
  }
  // Nanoseconds this thread has run on a core (its CPU clock: the
  // schedstat's own figure lags by up to a tick) and waited in a run queue
  // for one (the second field of its schedstat, up to date since it last
  // got a core), where the kernel tells; time a hypervisor took the core
  // is in neither.
  static std::optional<uint64_t> BusyNs() {
    const int fd = ::open("/proc/thread-self/schedstat", O_RDONLY | O_CLOEXEC);
    if (fd < 0) return std::nullopt;
    char text[96];
    const ssize_t n = ::read(fd, text, sizeof text);
    ::close(fd);
    timespec on;
    if (n <= 0 || ::clock_gettime(CLOCK_THREAD_CPUTIME_ID, &on) != 0) return std::nullopt;
    const char* end = text + n;
    const char* space = std::find(static_cast<const char*>(text), end, ' ');
    uint64_t waiting = 0;
    if (space == end || std::from_chars(space + 1, end, waiting).ec != std::errc()) {
      return std::nullopt;
    }
    return static_cast<uint64_t>(on.tv_sec) * 1'000'000'000u + static_cast<uint64_t>(on.tv_nsec) +
           waiting;
  }
  Clock::time_point start_;
  std::optional<long> sleeps_;
  std::optional<uint64_t> busy_;
};

constexpr std::string_view kShardSuffix = ".safetensors";

bool EndsWith(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

// The name as written must not climb out: no absolute paths, no "..", no
// empty or NUL-bearing names.
bool NameStaysInside(std::string_view name) {
  if (name.empty() || name.front() == '/' || name.find('\0') != std::string_view::npos)
    return false;
  size_t start = 0;
  while (start <= name.size()) {
    size_t end = name.find('/', start);
    if (end == std::string_view::npos) end = name.size();
    if (name.substr(start, end - start) == "..") return false;
    start = end + 1;
  }
  return true;
}

bool IsUnder(const std::string& path, const std::string& dir) {
  return path.size() > dir.size() && path.compare(0, dir.size(), dir) == 0 &&
         (dir.back() == '/' || path[dir.size()] == '/');
}

// Checks that `name` in `dir` resolves inside `real_dir` (or into the hub
// cache's blobs folder, see checkpoint.h) and exists.
Result<std::string> CheckShardPath(io::FileSystem& fs, const std::string& label,
                                   const std::string& real_dir, const std::string& name,
                                   bool named_by_index) {
  if (!NameStaysInside(name)) {
    return Error(label + ": shard `" + name + "`: " + std::string(rules::kShardNameEscapes));
  }
  const std::string path = io::JoinPath(label, name);
  WEIGHTD_ASSIGN_OR_RETURN(bool exists, fs.Exists(path));
  if (!exists) {
    return Error(label + ": shard `" + name + "`: " + std::string(rules::kShardMissing));
  }
  auto real = fs.RealPath(path);
  if (!real.ok()) {
    // A dangling symlink: listed by the directory, its target gone.
    return Error(label + ": shard `" + name + "`: " +
                 (named_by_index ? std::string(rules::kShardMissing)
                                 : std::string("a symlink whose target is missing")) +
                 " (" + real.error().message() + ")");
  }
  if (IsUnder(*real, real_dir)) return *real;
  const std::string snapshots = io::DirName(real_dir);
  if (io::BaseName(snapshots) == "snapshots" &&
      IsUnder(*real, io::JoinPath(io::DirName(snapshots), "blobs"))) {
    return *real;
  }
  return Error(label + ": shard `" + name + "`: " + std::string(rules::kShardNameEscapes) +
               " (it resolves to " + *real + ")");
}

// `size` bytes of JSON to fill, or an error naming `label` where there is no
// memory for them.
Result<json::PaddedText> NewText(std::string_view label, size_t size) {
  try {
    return json::PaddedText(size);
  } catch (const std::bad_alloc&) {
    return Error(std::string(label) + ": no memory for " + std::to_string(size) + " bytes of JSON");
  }
}

// The whole file, read straight into a padded buffer (parsed where it
// lies, not copied: an index of 70,000 tensors is 6 MB), and
// (when `signature` is given) the signature of the bytes read: the same
// before and after the read, or an error. `turn` is taken for the text
// before it is allocated.
Result<json::PaddedText> ReadWholeFile(io::FileSystem& fs, const std::string& path, uint64_t limit,
                                       ParseTurn& turn, io::StatSignature* signature = nullptr) {
  WEIGHTD_ASSIGN_OR_RETURN(auto file, fs.Open(path));
  if (file->size() > limit) {
    return Error(path + ": file of " + std::to_string(file->size()) +
                 " bytes is over the limit of " + std::to_string(limit));
  }
  std::optional<io::StatSignature> before;
  if (signature != nullptr) {
    WEIGHTD_ASSIGN_OR_RETURN(before, file->Stat());
  }
  const auto size = static_cast<size_t>(file->size());
  turn = ParseTurn(size);
  WEIGHTD_ASSIGN_OR_RETURN(json::PaddedText text, NewText(path, size));
  WEIGHTD_RETURN_IF_ERROR(
      file->ReadExactly(0, std::span(reinterpret_cast<std::byte*>(text.data()), text.size())));
  if (signature != nullptr) {
    WEIGHTD_ASSIGN_OR_RETURN(io::StatSignature after, file->Stat());
    if (!(after == *before) || after.size != text.size()) {
      return Error(path + ": changed while being read; try again");
    }
    *signature = after;
  }
  return text;
}

}  // namespace

uint64_t Checkpoint::tensor_count() const {
  uint64_t n = 0;
  for (const Shard& s : shards) n += s.header.tensors.size();
  return n;
}

uint64_t Checkpoint::data_bytes() const {
  uint64_t n = 0;
  for (const Shard& s : shards) n += s.header.data_bytes;
  return n;
}

uint64_t Checkpoint::file_bytes() const {
  uint64_t n = 0;
  for (const Shard& s : shards) n += s.file_size;
  return n;
}

// What a WeightMap's names are views into: the index's text, and the few
// names that spell a character with an escape, unescaped.
struct IndexText {
  json::PaddedText text;
  std::deque<std::string> unescaped;  // a deque: adding moves no name
};

struct IndexParser {
  // `turn` is held for the text, and given back once it is parsed.
  static Result<WeightMap> Parse(std::string_view label, json::PaddedText json,
                                 [[maybe_unused]] ParseTurn turn);
  static Result<WeightMap> Read(std::string_view label, IndexText& text);
};

Result<WeightMap> ParseIndex(std::string_view label, std::string_view json) {
  ParseTurn turn(json.size());
  WEIGHTD_ASSIGN_OR_RETURN(json::PaddedText text, NewText(label, json.size()));
  if (!json.empty()) std::memcpy(text.data(), json.data(), json.size());
  return IndexParser::Parse(label, std::move(text), std::move(turn));
}

Result<WeightMap> IndexParser::Parse(std::string_view label, json::PaddedText json,
                                     [[maybe_unused]] ParseTurn turn) {
  auto text = std::make_shared<IndexText>();
  text->text = std::move(json);
  auto map = Read(label, *text);
  if (!map.ok()) {
    // Reading stops at the first thing amiss, which is the JSON itself
    // where a full parse finds it broken anywhere: then that is the error.
    if (auto err = json::DomError(text->text.data(), text->text.size(), json::kMaxIndexDepth)) {
      return Error(std::string(label) + ": " + std::string(rules::kIndexNotJson) + " (" +
                   simdjson::error_message(err) + ")");
    }
    return map.error();
  }
  map->names_ = std::move(text);
  // Index files are usually written sorted already.
  auto by_tensor = [](const WeightMap::Entry& a, const WeightMap::Entry& b) {
    return a.tensor < b.tensor;
  };
  if (!std::is_sorted(map->entries_.begin(), map->entries_.end(), by_tensor)) {
    std::sort(map->entries_.begin(), map->entries_.end(), by_tensor);
  }
  for (size_t i = 1; i < map->entries_.size(); ++i) {
    if (map->entries_[i].tensor == map->entries_[i - 1].tensor) {
      return Error(std::string(label) + ": " + std::string(rules::kIndexNotJson) + " (tensor `" +
                   std::string(map->entries_[i].tensor) + "` listed twice)");
    }
  }
  return map;
}

// The weight_map of the index, its names views into `text`.
Result<WeightMap> IndexParser::Read(std::string_view label, IndexText& text) {
  const json::PaddedText& json = text.text;
  auto fail = [&](const std::string& detail) {
    return Error(std::string(label) + ": " + std::string(rules::kIndexNotJson) + " (" + detail +
                 ")");
  };
  auto not_json = [&](simdjson::error_code err) { return fail(simdjson::error_message(err)); };
  json::od::parser parser;
  if (parser.allocate(std::max<size_t>(json.size(), 64), json::ParserDepth(json::kMaxIndexDepth)) !=
      simdjson::SUCCESS) {
    return fail("cannot allocate the parser");
  }
  json::od::document doc;
  if (auto err = parser.iterate(json.view()).get(doc)) return not_json(err);
  json::od::object root;
  if (doc.get_object().get(root) != simdjson::SUCCESS) return fail("no weight_map object");
  const char* end = json.data() + json.size();
  WeightMap map;
  bool found = false;
  for (auto item : root) {
    json::od::field field;
    if (auto err = std::move(item).get(field)) return not_json(err);
    std::string_view key;
    if (auto err = json::KeyText(field, end).get(key)) return not_json(err);
    if (key != "weight_map") {
      if (auto err = json::CheckValue(field.value(), 1, json::kMaxIndexDepth)) return not_json(err);
      continue;
    }
    // Readers differ on which of two counts (the first, or the last as
    // Python's json module keeps): neither is taken.
    if (found) return fail("weight_map given twice");
    found = true;
    json::od::object weight_map;
    if (field.value().get_object().get(weight_map) != simdjson::SUCCESS) {
      return fail("no weight_map object");
    }
    size_t count = 0;
    if (auto err = weight_map.count_fields().get(count)) return not_json(err);
    map.entries_.reserve(count);
    std::unordered_map<std::string_view, uint32_t> shard_index;
    for (auto tensor : weight_map) {
      json::od::field f;
      if (auto err = std::move(tensor).get(f)) return not_json(err);
      std::string_view name, shard;
      if (auto plain = json::PlainText(f.key().raw(), end)) {
        name = *plain;
      } else {  // unescaped into the parser's buffer: kept apart
        if (auto err = f.unescaped_key().get(name)) return not_json(err);
        name = text.unescaped.emplace_back(name);
      }
      if (json::StringText(f.value()).get(shard) != simdjson::SUCCESS) {
        return fail("weight_map value for `" + std::string(name) + "` is not a string");
      }
      // Neighbours mostly share a shard.
      uint32_t index;
      if (!map.shards_.empty() && map.shards_[map.entries_.back().shard] == shard) {
        index = map.entries_.back().shard;
      } else if (auto it = shard_index.find(shard); it != shard_index.end()) {
        index = it->second;
      } else {
        index = static_cast<uint32_t>(map.shards_.size());
        map.shards_.emplace_back(shard);
        shard_index.emplace(shard, index);  // into the text or the parser's buffer: both stay put
      }
      map.entries_.push_back({name, index});
    }
  }
  if (!json::AtEnd(doc)) return not_json(simdjson::TRAILING_CONTENT);
  if (!found) return fail("no weight_map object");
  return map;
}

Result<ShardListing> ListShards(io::FileSystem& fs, const std::string& path,
                                const ListOptions& options) {
  ShardListing listing;
  const RoundTripProbe directory_probe;
  WEIGHTD_ASSIGN_OR_RETURN(bool is_dir, fs.IsDirectory(path));
  bool remote = directory_probe.Slow();
  listing.round_trips = 1;
  if (!is_dir) {
    // A checkpoint's index, named by mistake, would be read as a shard and
    // fail on a header length made of JSON text.
    if (io::BaseName(path).ends_with(".json")) {
      return Error(path +
                   ": a JSON file, not a safetensors file; name the checkpoint's directory (" +
                   io::DirName(path) + ") or one of its shards");
    }
    listing.shards.push_back({io::BaseName(path), path, path});
    return listing;
  }

  // Where a stat costs a round trip, list the directory at once, alongside
  // the index read: on file systems with READDIRPLUS (NFS, FUSE) the listing
  // brings every shard's attributes in one round trip, so the per-shard
  // checks below hit the client's cache instead of queuing one lookup each
  // (which Linux's FUSE client was seen to serialize within a directory).
  // Without an index the listing is needed anyway. Where stats are cheap
  // (local disks, warm attribute caches) it would only add round trips. The
  // probes are the directory's stat and then the index's lookup (the
  // directory's attributes may be cached while its entries are not).
  std::optional<Result<std::vector<io::DirEntry>>> entries;
  std::jthread lister;
  auto list_now = [&] {
    try {
      lister = std::jthread([&] {
        try {
          entries = fs.ListDirectory(path);
          if (entries->ok() && options.on_early_listing) options.on_early_listing(entries->value());
        } catch (...) {
          entries.reset();  // out of memory: listed again, if needed, on the caller's thread
        }
      });
    } catch (...) {
      // No thread (or memory) to spare: list later, if the listing is
      // needed at all.
    }
    if (options.reserve_workers > 0) io::WorkerPool::Shared().Reserve(options.reserve_workers);
  };
  if (remote) list_now();

  WEIGHTD_ASSIGN_OR_RETURN(std::string real_dir, fs.RealPath(path));
  listing.real_dir = real_dir;
  const std::string index_path = io::JoinPath(path, std::string(kIndexFileName));
  const RoundTripProbe index_probe;
  WEIGHTD_ASSIGN_OR_RETURN(bool has_index, fs.Exists(index_path));
  if (!remote && index_probe.Slow()) {
    remote = true;
    list_now();
  }
  listing.remote = remote;
  listing.round_trips += 1;
  listing.has_index = has_index;

  std::vector<std::string> names;
  std::optional<io::StatSignature> index_signature;
  if (has_index && options.recall_index) {
    WEIGHTD_ASSIGN_OR_RETURN(index_signature, fs.Stat(index_path));
    listing.round_trips += 1;
    if (auto recalled = options.recall_index(*index_signature)) names = std::move(*recalled);
  }
  if (has_index && names.empty()) {
    io::StatSignature read_signature;
    ParseTurn turn;
    WEIGHTD_ASSIGN_OR_RETURN(json::PaddedText text,
                             ReadWholeFile(fs, index_path, kMaxIndexBytes, turn, &read_signature));
    listing.bytes_read = text.size();
    WEIGHTD_ASSIGN_OR_RETURN(listing.weight_map,
                             IndexParser::Parse(index_path, std::move(text), std::move(turn)));
    // Remember the list under the signature of the bytes actually read.
    if (index_signature && !(*index_signature == read_signature)) index_signature.reset();
    // Neighbouring tensors mostly share a shard: sorted and made unique below.
    names = listing.weight_map->shards();
    listing.round_trips += 2;  // open, read
    listing.reads = 1;
  }
  if (lister.joinable()) lister.join();
  std::string skipped;  // the first *.safetensors entry that is not a file
  if (!has_index) {
    if (!entries) entries = fs.ListDirectory(path);
    if (!entries->ok()) return entries->error();
    for (const io::DirEntry& e : entries->value()) {
      if (!EndsWith(e.name, kShardSuffix)) continue;
      if (e.type == io::EntryType::kRegular || e.type == io::EntryType::kSymlink) {
        names.push_back(e.name);
      } else if (skipped.empty()) {
        skipped = e.name;  // a directory, a FIFO...: not a shard
      }
    }
    listing.round_trips += 2;  // opendir, readdir
  }
  std::sort(names.begin(), names.end());
  names.erase(std::unique(names.begin(), names.end()), names.end());
  if (names.empty() && !skipped.empty()) {
    return Error(path + ": " + std::string(rules::kNoShards) + " (" + skipped +
                 " is not a regular file)");
  }
  if (names.empty()) return Error(path + ": " + std::string(rules::kNoShards));
  if (listing.weight_map && index_signature && options.remember_index) {
    options.remember_index(*index_signature, names);
  }

  // Each check is a lookup or two; on a network file system they must not
  // queue behind each other.
  listing.shards.resize(names.size());
  std::vector<std::optional<Error>> errors(names.size());
  std::atomic<size_t> next{0};
  // Where a check costs microseconds, threads would cost more than they save.
  const size_t checkers =
      listing.remote ? std::min<size_t>(names.size(), kMaxParallelPathChecks) : 1;
  io::RunTeam(static_cast<int>(checkers), [&](int) {
    for (size_t i; (i = next.fetch_add(1)) < names.size();) {
      auto resolved = CheckShardPath(fs, path, real_dir, names[i], listing.has_index);
      if (!resolved.ok()) {
        errors[i] = resolved.error();
        continue;
      }
      listing.shards[i] = {names[i], io::JoinPath(path, names[i]), std::move(resolved).value(),
                           io::Symlinks::kNone};
    }
  });
  for (auto& e : errors) {
    if (e) return *e;
  }
  // One file under two names ("a", "./a", a symlink to it) would be read,
  // kept and parsed twice over, as many times as an index spells it.
  std::vector<const ShardRef*> by_file;
  for (const ShardRef& s : listing.shards) by_file.push_back(&s);
  std::sort(by_file.begin(), by_file.end(),
            [](const ShardRef* a, const ShardRef* b) { return a->resolved < b->resolved; });
  for (size_t i = 1; i < by_file.size(); ++i) {
    if (by_file[i]->resolved == by_file[i - 1]->resolved) {
      return Error(path + ": shards `" + by_file[i - 1]->name + "` and `" + by_file[i]->name +
                   "`: " + std::string(rules::kShardListedTwice) + " (both are " +
                   by_file[i]->resolved + ")");
    }
  }
  listing.round_trips += 2 * ((names.size() + kMaxParallelPathChecks - 1) / kMaxParallelPathChecks);
  return listing;
}

std::vector<std::pair<size_t, size_t>> TensorsByName(const std::vector<Shard>& shards) {
  // A k-way merge: each header's tensors are already sorted by name.
  using Cursor = std::pair<size_t, size_t>;  // shard, position
  auto name = [&](const Cursor& c) { return shards[c.first].header.tensors[c.second].name; };
  auto later = [&](const Cursor& a, const Cursor& b) { return name(b) < name(a); };
  std::vector<Cursor> heap;
  size_t total = 0;
  for (size_t s = 0; s < shards.size(); ++s) {
    total += shards[s].header.tensors.size();
    if (!shards[s].header.tensors.empty()) heap.push_back({s, 0});
  }
  std::make_heap(heap.begin(), heap.end(), later);
  std::vector<std::pair<size_t, size_t>> out;
  out.reserve(total);
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), later);
    Cursor c = heap.back();
    heap.pop_back();
    // Shards mostly hold runs of neighbouring names (a layer, an expert):
    // the run goes out whole, one comparison a tensor, while it stays
    // before every other shard's next name. Ties go to the heap, which
    // orders them as the plain merge did.
    const size_t count = shards[c.first].header.tensors.size();
    out.push_back(c);
    while (++c.second < count && (heap.empty() || later(heap.front(), c))) out.push_back(c);
    if (c.second < count) {
      heap.push_back(c);
      std::push_heap(heap.begin(), heap.end(), later);
    }
  }
  return out;
}

Status CheckAcrossShards(const std::string& path, const std::vector<Shard>& shards,
                         const std::optional<WeightMap>& weight_map) {
  return CheckAcrossShards(path, shards, weight_map, TensorsByName(shards));
}

Status CheckAcrossShards(const std::string& path, const std::vector<Shard>& shards,
                         const std::optional<WeightMap>& weight_map,
                         const std::vector<std::pair<size_t, size_t>>& all) {
  auto name = [&](const std::pair<size_t, size_t>& t) {
    return shards[t.first].header.tensors[t.second].name;
  };
  // A tensor name may appear in one shard only.
  for (size_t i = 1; i < all.size(); ++i) {
    if (name(all[i]) == name(all[i - 1])) {
      return Error(path + ": tensor `" + std::string(name(all[i])) +
                   "`: " + std::string(rules::kTensorInTwoShards) + " (" +
                   shards[all[i - 1].first].name + " and " + shards[all[i].first].name + ")");
    }
  }

  // Each tensor the index maps is in the shard it names: both lists are
  // sorted by tensor name, so one walk checks them all.
  if (weight_map) {
    const std::string index_path = io::JoinPath(path, std::string(kIndexFileName));
    size_t at = 0;
    for (const WeightMap::Entry& e : weight_map->entries()) {
      while (at < all.size() && name(all[at]) < e.tensor) ++at;
      const std::string& shard_name = weight_map->shard_of(e);
      if (at == all.size() || name(all[at]) != e.tensor ||
          shards[all[at].first].name != shard_name) {
        return Error(index_path + ": tensor `" + std::string(e.tensor) +
                     "`: " + std::string(rules::kIndexTensorMissing) + " (" + shard_name + ")");
      }
    }
  }
  return OkStatus();
}

Result<Checkpoint> OpenCheckpoint(io::FileSystem& fs, const std::string& path) {
  Checkpoint ckpt;
  ckpt.path = path;
  WEIGHTD_ASSIGN_OR_RETURN(ckpt.is_directory, fs.IsDirectory(path));
  WEIGHTD_ASSIGN_OR_RETURN(ShardListing listing, ListShards(fs, path));
  const std::vector<ShardRef>& refs = listing.shards;
  ckpt.has_index = listing.weight_map.has_value();

  // Headers are independent: read them many at once (on network storage each
  // costs round trips).
  ckpt.shards.resize(refs.size());
  std::vector<std::optional<Error>> errors(refs.size());
  std::atomic<size_t> next{0};
  HeaderAllowance allowance;  // every header is kept
  const int workers = static_cast<int>(std::min<size_t>(refs.size(), kMaxParallelHeaderReads));
  io::RunTeam(workers, [&](int) {
    for (size_t i; (i = next.fetch_add(1)) < refs.size();) {
      Shard& shard = ckpt.shards[i];
      shard.name = refs[i].name;
      shard.path = refs[i].path;
      auto file = fs.Open(refs[i].resolved, refs[i].symlinks);
      if (!file.ok()) {
        errors[i] = file.error();
        continue;
      }
      shard.file_size = (*file)->size();
      auto header = ReadShardHeader(**file, shard.path, nullptr, &allowance);
      if (!header.ok()) {
        errors[i] = header.error();
        continue;
      }
      shard.header = std::move(header).value();
    }
  });
  for (auto& e : errors) {
    if (e) return *e;
  }

  WEIGHTD_RETURN_IF_ERROR(CheckAcrossShards(path, ckpt.shards, listing.weight_map));
  return ckpt;
}

}  // namespace weightd::format
