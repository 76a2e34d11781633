#include "weightd/client.h"

#include <fcntl.h>
#include <pthread.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <iostream>
#include <limits>
#include <mutex>
#include <new>
#include <optional>
#include <set>

#include "fingerprint/fingerprint.h"
#include "format/dtype.h"
#include "io/file.h"
#include "io/private_memory.h"
#include "loader/loader.h"
#include "memory/cuda.h"
#include "memory/host_memory.h"
#include "memory/manifest.h"
#include "memory/segment.h"
#include "protocol/cache_key.h"
#include "protocol/channel.h"
#include "protocol/paths.h"
#include "protocol/text.h"
#include "transform/plan.h"

namespace weightd {
namespace {

using nlohmann::json;

constexpr double kDefaultReplyTimeoutSeconds = 30;
constexpr double kMaxReplyTimeoutSeconds = 3600;
// A manifest's tables faulted in before they are read, at most: those of
// about 600,000 tensors. Past that, pages come as the reading reaches them.
constexpr uint64_t kMostPrefaultBytes = uint64_t{64} << 20;

// AcquireOptions::reply_timeout_seconds as this call uses it.
double ReplyTimeoutSeconds(const AcquireOptions& o) {
  const double t = o.reply_timeout_seconds;
  return t > 0 ? std::min(t, kMaxReplyTimeoutSeconds)
               : kDefaultReplyTimeoutSeconds;  // nan: > fails
}

// How long a connect waits for a daemon whose queue of connections is
// full (stopped, hung, or swamped): no longer than an answer is waited for.
int BusyConnectTimeoutMs(const AcquireOptions& o) {
  return static_cast<int>(
      std::min<double>(protocol::kConnectBusyTimeoutMs, std::ceil(ReplyTimeoutSeconds(o) * 1000)));
}

// A lease: the connection to the daemon, which drops the lease when the
// socket's last descriptor closes. A child forked while it is open (by
// Python's multiprocessing, a launcher, another thread meanwhile) inherits
// that descriptor and would keep the lease after this process let go of
// it: the model never idle and never evicted until the child ended. So in
// a child each such descriptor is pointed at a socket of its own that
// holds nothing (the number stays valid for the destructor to close): the
// child keeps its mapping, memory that needs no lease, and the lease stays
// this process's alone. Every connection an acquire opens is one, from
// the connect on.
class Lease {
 public:
  explicit Lease(protocol::Channel channel) : channel_(std::move(channel)) {
    static std::once_flag once;
    std::call_once(once, [] { ::pthread_atfork(LockTable, UnlockTable, ForgetInChild); });
    std::lock_guard lock(table_mu_);
    Table().insert(channel_->fd());
  }
  ~Lease() {
    // Closed under the lock: no fork between leaving the table and closing.
    std::lock_guard lock(table_mu_);
    Table().erase(channel_->fd());
    channel_.reset();
  }
  Lease(const Lease&) = delete;
  Lease& operator=(const Lease&) = delete;

  protocol::Channel& channel() { return *channel_; }

 private:
  static std::set<int>& Table() {
    static std::set<int> fds;
    return fds;
  }
  // Held across fork, so that the table is whole in the child.
  static void LockTable() { table_mu_.lock(); }
  static void UnlockTable() { table_mu_.unlock(); }
  // Only calls safe in a forked child; nothing allocated or freed. Where
  // not even a socket can be made (no descriptor left), the child keeps
  // the lease until it ends.
  static void ForgetInChild() {
    for (int fd : Table()) {
      if (int spare = ::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0); spare >= 0) {
        ::dup3(spare, fd, O_CLOEXEC);
        ::close(spare);
      }
    }
    table_mu_.unlock();
  }

  static inline std::mutex table_mu_;
  std::optional<protocol::Channel> channel_;
};

// Private, page-aligned memory for `copy` mode.
class OwnedBytes {
 public:
  static Result<OwnedBytes> Copy(std::span<const std::byte> from) {
    // What would not fit in the memory the kernel would still give this
    // process (its control group's, or the machine's) is refused, rather
    // than the engine killed for it halfway through the copy.
    if (auto room = memory::HostMemoryRoom(); room && from.size() > room->free) {
      return Error("cannot copy " + std::to_string(from.size()) +
                   " bytes into this process: only " + std::to_string(room->free) +
                   " bytes of memory are available (" + room->source +
                   "); zero_copy maps the daemon's copy instead");
    }
    // Huge pages from 2 MiB up (io/private_memory.h).
    std::byte* p = io::MapPrivate(from.size());
    if (p == nullptr) {
      return Error("cannot allocate " + std::to_string(from.size()) + " bytes for a copy");
    }
    std::memcpy(p, from.data(), from.size());
    // Read-only from here on, as every other view is.
    ::mprotect(p, io::PrivateMappedBytes(from.size()), PROT_READ);
    OwnedBytes b;
    b.data_ = p;
    b.size_ = from.size();
    return b;
  }
  OwnedBytes() = default;
  OwnedBytes(OwnedBytes&& o) noexcept : data_(std::exchange(o.data_, nullptr)), size_(o.size_) {}
  OwnedBytes& operator=(OwnedBytes&& o) noexcept {
    std::swap(data_, o.data_);
    std::swap(size_, o.size_);
    return *this;
  }
  ~OwnedBytes() { io::UnmapPrivate(data_, size_); }
  std::span<const std::byte> bytes() const { return {data_, size_}; }

 private:
  std::byte* data_ = nullptr;
  size_t size_ = 0;
};

class WeightsImpl final : public Weights {
 public:
  std::span<const Tensor> tensors() const override { return tensors_; }
  std::string_view source() const override { return source_; }
  const std::string& reason() const override { return reason_; }
  MissKind miss_kind() const override { return miss_kind_; }
  const std::vector<std::string>& mismatch() const override { return mismatch_; }
  const std::vector<std::string>& mismatch_fields() const override { return fields_; }
  const std::string& checkpoint_digest() const override { return digest_; }
  const std::string& device() const override { return device_; }
  const std::string& trusted() const override { return trusted_; }
  AcquireMode mode() const override { return lease ? AcquireMode::kZeroCopy : AcquireMode::kCopy; }

  // Builds the tensor views over a host segment's bytes (which this object
  // keeps alive).
  Status Index(std::span<const std::byte> bytes) {
    device_ = "host";
    return Index(bytes, bytes, 0, bytes.size());
  }
  // The same for a segment of `segment_bytes` on a GPU, mapped at
  // `device_base`, from a copy of its manifest in host memory.
  Status IndexOnGpu(std::span<const std::byte> manifest, uint64_t device_base,
                    uint64_t segment_bytes, std::string device) {
    device_ = std::move(device);
    device_base_ = device_base;
    return Index(manifest, {}, device_base, segment_bytes);
  }

  // What keeps the bytes alive: some of these.
  std::unique_ptr<Lease> lease;              // zero_copy: the connection holds it (let go last)
  std::unique_ptr<memory::Mapping> mapping;  // a host segment, or a GPU segment's manifest
  OwnedBytes owned;
  std::unique_ptr<memory::Segment> segment;           // our own: from disk, or a copy
  std::unique_ptr<memory::CudaMapping> cuda_mapping;  // the daemon's, on a GPU
  std::vector<std::byte> manifest_copy;               // a GPU segment's, in host memory

  // 80 bytes a tensor: 5.6 MB for 70,000, in huge pages.
  std::vector<Tensor, io::PrivateAllocator<Tensor>> tensors_;
  std::string source_;
  std::string reason_;
  MissKind miss_kind_ = MissKind::kNone;
  std::vector<std::string> mismatch_;
  std::vector<std::string> fields_;
  std::string digest_;
  std::string trusted_;      // the pinned name taken on trust, if any
  std::string loaded_from_;  // where the daemon loaded it from, as it says (for people)

  // Where the data starts in the segment last indexed: the manifest before it.
  uint64_t data_offset() const { return data_offset_; }

  Status CopyToHost(const Tensor& asked, uint64_t offset, std::span<std::byte> out) const override {
    // A GPU tensor is found by its offset from this segment's base: one of
    // other weights would read whatever lies there. The record read is
    // this object's own, whatever the caller's copy of it says.
    // (A record of tensors() itself, as Checksum passes, needs no lookup.)
    const std::less<const Tensor*> before;  // a total order, whatever `asked` points into
    const bool listed = !tensors_.empty() && !before(&asked, tensors_.data()) &&
                        before(&asked, tensors_.data() + tensors_.size());
    const Tensor* own = listed ? &asked : Find(asked.name);
    if (own == nullptr || own->device_address != asked.device_address ||
        own->data.data() != asked.data.data()) {
      return Error("tensor `" + std::string(asked.name) + "` is not one of these weights");
    }
    const Tensor& t = *own;
    if (offset > t.bytes || out.size() > t.bytes - offset) {
      return Error("bytes past the end of tensor `" + std::string(t.name) + "`");
    }
    if (out.empty()) return OkStatus();
    if (t.device_address == 0) {
      std::memcpy(out.data(), t.data.data() + offset, out.size());
      return OkStatus();
    }
    const uint64_t at = t.device_address - device_base_ + offset;
    if (cuda_mapping) return cuda_mapping->ReadBack(at, out);
    if (segment) return segment->ReadBack(at, out);
    return Error("no GPU memory behind tensor `" + std::string(t.name) + "`");
  }

 private:
  // `host`: the segment's bytes where this process can read them (empty
  // for a GPU's, which are at `device_base`).
  Status Index(std::span<const std::byte> manifest, std::span<const std::byte> host,
               uint64_t device_base, uint64_t segment_bytes) {
    WEIGHTD_ASSIGN_OR_RETURN(memory::ManifestSummary summary,
                             memory::ReadManifestSummary(manifest, segment_bytes));
    data_offset_ = summary.data_offset;
    // Every record, name and dimension is read below: faulted in at once.
    // Not the size the manifest claims, which a sparse memfd makes cheap to
    // claim: its holes would be filled (and charged to this process).
    memory::PrefaultForReading(
        manifest.first(static_cast<size_t>(std::min(summary.tables_bytes, kMostPrefaultBytes))));
    tensors_.clear();
    // The table is this process's biggest allocation of an attach (80 bytes
    // a tensor): where the memory is not there, an error, not an exception.
    try {
      return IndexRecords(manifest, host, device_base, segment_bytes, summary.tensor_count);
    } catch (const std::bad_alloc&) {
      tensors_.clear();
      return Error("no memory for the table of " + std::to_string(summary.tensor_count) +
                   " tensors");
    }
  }

  Status IndexRecords(std::span<const std::byte> manifest, std::span<const std::byte> host,
                      uint64_t device_base, uint64_t segment_bytes, uint64_t tensor_count) {
    // The count is the daemon's word, and a sparse memfd makes any size
    // look backed: room for at most a million up front, more as records
    // pass their checks.
    tensors_.reserve(static_cast<size_t>(std::min(tensor_count, memory::kReserveRecords)));
    // Neighbours mostly share a dtype: its name is looked up once a run.
    std::string_view last_name;
    std::optional<format::DType> last_dtype;
    return memory::VisitTensors(
        manifest, segment_bytes, [&](const memory::TensorRecord& r) -> Status {
          if (r.dtype != last_name || !last_dtype) {
            last_dtype = format::ParseDType(r.dtype);
            last_name = r.dtype;
          }
          if (!last_dtype)
            return Error("segment tensor `" + std::string(r.name) + "`: unknown dtype");
          // The engine will index the data by shape: shape and dtype must
          // account for exactly the bytes the record gives.
          uint64_t elements = 1;
          for (uint64_t d : r.shape) {
            if (__builtin_mul_overflow(elements, d, &elements)) elements = UINT64_MAX;
          }
          uint64_t bits;  // rounded up to whole bytes without wrapping near 2^64
          if (__builtin_mul_overflow(elements, format::DTypeBits(*last_dtype), &bits) ||
              bits / 8 + (bits % 8 != 0 ? 1 : 0) != r.bytes) {
            return Error("segment tensor `" + std::string(r.name) +
                         "`: its shape does not match its " + std::to_string(r.bytes) + " bytes");
          }
          Tensor t{r.name, r.dtype, r.shape, {}, r.bytes, 0};
          if (host.empty()) {
            t.device_address = device_base + r.offset;
          } else {
            t.data = host.subspan(static_cast<size_t>(r.offset), static_cast<size_t>(r.bytes));
          }
          tensors_.push_back(t);
          return OkStatus();
        });
  }

  std::string device_ = "host";
  uint64_t device_base_ = 0;
  uint64_t data_offset_ = 0;  // where the tensors' data starts
};

struct Miss {
  MissKind kind = MissKind::kNone;
  std::string reason;
  std::vector<std::string> mismatch;
  std::vector<std::string> fields;
  bool daemon_reachable = false;
  // Spent waiting for the daemon (asked to wait): to start, or to load.
  double waited = 0;
};

// Waits for the answer to a `want` request: `reply_seconds` for a daemon
// that answers at all, plus `extra_seconds` it was told it may take.
Result<protocol::Message> Expect(protocol::Channel& ch, const std::string& want,
                                 double reply_seconds, double extra_seconds = 0) {
  // At least a millisecond: poll's 0 would not wait at all.
  const int timeout_ms = static_cast<int>(std::clamp<double>(
      std::ceil((reply_seconds + extra_seconds) * 1000), 1, std::numeric_limits<int>::max()));
  auto received = ch.Receive(timeout_ms);
  if (!received.ok() && received.error().message() == protocol::Channel::kTimedOut) {
    char waited[32];
    std::snprintf(waited, sizeof waited, "%g", reply_seconds + extra_seconds);
    return Error(std::string("the daemon did not answer within ") + waited +
                 " s: stopped (SIGSTOP), or too busy? `weightd status --reply-timeout 2` shows "
                 "whether it serves");
  }
  if (!received.ok()) return received.error();
  protocol::Message m = std::move(received).value();
  if (m.type() == "error") {
    auto it = m.body.find("message");
    return Error("the daemon says: " +
                 (it != m.body.end() && it->is_string() ? it->get<std::string>() : "error"));
  }
  if (m.type() != want && !(want == "acquired" && m.type() == "miss")) {
    return Error("the daemon answered `" + m.type() + "` to a `" + want + "` request");
  }
  return m;
}

// What an acquire's shard list may take, about: a quarter of a request.
constexpr uint64_t kMostShardListBytes = protocol::kMaxRequestBytes / 4;

// What the engine tells the daemon of its checkpoint, only to explain a
// miss: its real path (or empty), and its shard files where it knows them
// (null when trusting a name, which reads none).
struct EngineCheckpoint {
  std::string path;
  json shards;  // as the request carries it; null when none is sent
};

// Asks the daemon; on a hit returns the weights, else fills `miss`.
// `checkpoint` only picks which resident model a miss is explained
// against, and whether it is a changed checkpoint or a cold start: a hit is
// by the key alone.
std::unique_ptr<WeightsImpl> TryDaemon(const protocol::CacheKey& key, const AcquireOptions& o,
                                       const EngineCheckpoint& checkpoint, Miss& miss) {
  // Waiting for the daemon, to start or to finish loading this model: what
  // is left of the call's one wait (Acquire bounds it).
  const double wait = o.wait_for_daemon_seconds;
  const auto started = std::chrono::steady_clock::now();
  // What was waited, as the wait allowed: for the daemon to start (its
  // socket tried again), then for its load (as the daemon says it waited,
  // or, with no answer, the time since asking). Not a round trip answered
  // at once; the reply timeout a silent daemon runs out comes on top.
  double waited_to_connect = 0;
  protocol::ConnectFailure failure = protocol::ConnectFailure::kRefused;
  auto ch = protocol::ConnectToDaemonWaiting(protocol::SocketDirectory(o.socket_dir), wait,
                                             &failure, BusyConnectTimeoutMs(o), &waited_to_connect);
  miss.waited += std::min(wait, waited_to_connect);
  if (!ch.ok()) {
    // Something there that will not do (an unsafe socket directory, another
    // user's daemon) is a failure to alert on, not a daemon not running.
    const bool refused = failure == protocol::ConnectFailure::kRefused;
    miss.kind = refused ? MissKind::kFailed : MissKind::kNoDaemon;
    miss.reason = (refused ? "cannot use the daemon: " : "no daemon: ") + ch.error().message();
    return nullptr;
  }
  // The lease once the daemon grants one; before, a connection no forked
  // child may keep either.
  auto lease = std::make_unique<Lease>(std::move(ch).value());
  protocol::Channel& channel = lease->channel();
  // One wait in all: what finding the daemon took is not waited again for
  // its load.
  const double waited =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  const double wait_left = std::max(0.0, wait - waited);
  miss.daemon_reachable = true;
  // What went wrong on the connection; not the daemon's protocol when this
  // process could not take the descriptors it was sent, or was not answered.
  auto fail = [&](const std::string& what, const Error& e) {
    const std::string& m = e.message();
    const bool ours =
        m.starts_with("no file descriptor left") || m.starts_with("the daemon did not answer");
    miss.kind = MissKind::kFailed;
    miss.reason = ours ? m : what + ": " + m;
    return nullptr;
  };
  // Hello and acquire go out together: one round trip, not two. A daemon
  // that cannot speak our version answers the hello with an error.
  json request = {{"type", "acquire"}, {"key", protocol::ToJson(key)}};
  if (!o.trust.empty()) request["trust"] = o.trust;
  if (wait_left > 0) request["wait_seconds"] = wait_left;
  if (!checkpoint.path.empty()) request["path"] = protocol::PathToJson(checkpoint.path);
  if (!checkpoint.shards.is_null()) request["shards"] = checkpoint.shards;
  auto send_failed = [&](const Error& e) {
    if (auto said = channel.ErrorSentBeforeClosing())
      return fail("refused", Error("the daemon says: " + *said));
    return fail("protocol error", e);
  };
  if (Status s = channel.Send({{"type", "hello"}, {"versions", {protocol::kProtocolVersion}}});
      !s.ok()) {
    return send_failed(s.error());
  }
  if (Status s = channel.Send(request); !s.ok()) return send_failed(s.error());
  const auto asked = std::chrono::steady_clock::now();
  auto waited_unanswered = [&] {
    miss.waited += std::min(
        wait_left, std::chrono::duration<double>(std::chrono::steady_clock::now() - asked).count());
  };
  const double reply_seconds = ReplyTimeoutSeconds(o);
  if (auto hello = Expect(channel, "hello", reply_seconds); !hello.ok()) {
    waited_unanswered();
    return fail("protocol error", hello.error());
  }
  auto reply = Expect(channel, "acquired", reply_seconds, wait_left);
  if (!reply.ok()) {
    waited_unanswered();
    return fail("protocol error", reply.error());
  }
  const json& body = reply->body;
  if (auto it = body.find("waited_seconds"); it != body.end() && it->is_number()) {
    const double said = it->get<double>();  // nan fails both comparisons: not counted
    if (said > 0) miss.waited += std::min(wait_left, said);
  }
  if (reply->type() == "miss") {
    auto strings = [&](const char* field, std::vector<std::string>& out) {
      auto it = body.find(field);
      if (it == body.end() || !it->is_array()) return;
      for (const auto& v : *it) {
        if (v.is_string()) out.push_back(v.get<std::string>());
      }
    };
    auto reason = body.find("reason");
    miss.reason = reason != body.end() && reason->is_string() ? reason->get<std::string>() : "miss";
    strings("mismatch", miss.mismatch);
    strings("fields", miss.fields);
    miss.kind = miss.fields.empty() ? MissKind::kNotResident : MissKind::kDifferent;
    if (!miss.mismatch.empty()) {
      miss.reason += ": ";
      for (size_t i = 0; i < miss.mismatch.size(); ++i) {
        miss.reason += (i ? "; " : "") + miss.mismatch[i];
      }
    }
    return nullptr;
  }
  auto held = body.contains("key") ? protocol::KeyFromJson(body["key"])
                                   : Result<protocol::CacheKey>(Error("no key"));
  if (!held.ok()) return fail("protocol error", held.error());
  if (!protocol::Compare(*held, key, !o.trust.empty()).empty()) {
    miss.kind = MissKind::kFailed;
    miss.reason = "protocol error: the daemon served a model with another key";
    return nullptr;
  }
  // Taken on trust, it must be the model that name pins.
  if (!o.trust.empty() && body.value("name", json()) != json(o.trust)) {
    miss.kind = MissKind::kFailed;
    miss.reason = "protocol error: the daemon served a model not named `" + o.trust + "`";
    return nullptr;
  }
  auto size_field = [&](const char* field) -> std::optional<uint64_t> {
    auto it = body.find(field);
    if (it == body.end() || !it->is_number_unsigned()) return std::nullopt;
    return it->get<uint64_t>();
  };
  const std::optional<uint64_t> bytes = size_field("bytes");
  auto w = std::make_unique<WeightsImpl>();
  w->source_ = "daemon";
  w->digest_ = held->checkpoint;
  if (auto it = body.find("path"); it != body.end()) {
    if (auto path = protocol::PathFromJson(*it); path.ok()) w->loaded_from_ = *path;
  }
  if (held->device != "host") {
    // A GPU's segment, after its manifest in host memory.
    const std::optional<uint64_t> manifest_bytes = size_field("manifest_bytes");
    auto device = memory::ParseDevice(held->device);
    if (reply->fds.size() != 2 || !bytes || !manifest_bytes || !device.ok() ||
        device->kind != memory::DeviceSpec::Kind::kCudaUuid) {
      miss.kind = MissKind::kFailed;
      miss.reason = "protocol error: a GPU's `acquired` reply without its manifest and segment";
      return nullptr;
    }
    auto manifest = memory::MapHostSegment(reply->fds[0], *manifest_bytes);
    if (!manifest.ok()) return fail("mapping error", manifest.error());
    auto gpu = memory::MapCudaSegment(reply->fds[1], *bytes, device->uuid);
    if (!gpu.ok()) return fail("mapping error", gpu.error());
    w->mapping = std::move(manifest).value();
    if (o.mode == AcquireMode::kCopy) {
      auto copy = (*gpu)->Copy();
      if (!copy.ok()) return fail("copy error", copy.error());
      w->segment = std::move(copy).value();
      if (Status s = w->IndexOnGpu(w->mapping->bytes(), w->segment->device_address(), *bytes,
                                   held->device);
          !s.ok()) {
        return fail("segment error", s.error());
      }
      w->reason_ = "resident in the daemon on " + held->device + " (copied; lease given back)";
      return w;
    }
    w->cuda_mapping = std::move(gpu).value();
    if (Status s = w->IndexOnGpu(w->mapping->bytes(), w->cuda_mapping->device_address(), *bytes,
                                 held->device);
        !s.ok()) {
      return fail("segment error", s.error());
    }
    w->lease = std::move(lease);
    w->reason_ = w->cuda_mapping->read_only()
                     ? "resident in the daemon on " + held->device + " (mapped read-only)"
                     : "resident in the daemon on " + held->device +
                           " (mapped READ-WRITE: the driver refused a read-only mapping; do not "
                           "write to the weights, other engines share them)";
    return w;
  }
  if (reply->fds.size() != 1 || !bytes) {
    miss.kind = MissKind::kFailed;
    miss.reason = "protocol error: an `acquired` reply without one segment and its size";
    return nullptr;
  }
  auto mapping = memory::MapHostSegment(reply->fds[0], *bytes);
  if (!mapping.ok()) return fail("mapping error", mapping.error());
  if (o.mode == AcquireMode::kCopy) {
    auto copy = OwnedBytes::Copy((*mapping)->bytes());
    if (!copy.ok()) return fail("copy error", copy.error());
    w->owned = std::move(copy).value();
    if (Status s = w->Index(w->owned.bytes()); !s.ok()) return fail("segment error", s.error());
    w->reason_ = "resident in the daemon (copied; lease given back)";
    return w;  // the connection closes here: the daemon drops the lease
  }
  w->mapping = std::move(mapping).value();
  if (Status s = w->Index(w->mapping->bytes()); !s.ok()) return fail("segment error", s.error());
  w->lease = std::move(lease);
  w->reason_ = "resident in the daemon (mapped read-only)";
  return w;
}

// The host-tier reload: the model resident in the daemon's host memory,
// copied onto the GPU `device` names (registered as pinned memory, so at
// the bus's speed); the lease goes back once copied.
std::unique_ptr<WeightsImpl> ReloadFromHost(const protocol::CacheKey& key,
                                            const memory::Device& device, const AcquireOptions& o,
                                            const EngineCheckpoint& checkpoint, Miss& miss) {
  protocol::CacheKey host_key = key;
  host_key.device = "host";
  AcquireOptions mapped = o;
  mapped.mode = AcquireMode::kZeroCopy;
  Miss host_miss;
  std::unique_ptr<WeightsImpl> w = TryDaemon(host_key, mapped, checkpoint, host_miss);
  miss.waited += host_miss.waited;
  if (!w) {
    miss.reason += "; nor could it be copied up from the daemon's host memory: " + host_miss.reason;
    if (host_miss.kind == MissKind::kFailed) miss.kind = MissKind::kFailed;
    return nullptr;
  }
  std::string staged_because;
  const std::span<const std::byte> host = w->mapping->bytes();
  auto copy = memory::CopyToCudaSegment(host, device.uuid, &staged_because);
  if (!copy.ok()) {
    miss.kind = MissKind::kFailed;
    miss.reason += "; the copy from the daemon's host memory failed: " + copy.error().message();
    return nullptr;
  }
  w->segment = std::move(copy).value();
  // The manifest is kept, not the host mapping: the daemon may evict its
  // copy and free that memory.
  w->manifest_copy.assign(host.begin(), host.begin() + static_cast<ptrdiff_t>(w->data_offset()));
  if (Status s =
          w->IndexOnGpu(w->manifest_copy, w->segment->device_address(), host.size(), device.Name());
      !s.ok()) {
    miss.kind = MissKind::kFailed;
    miss.reason += "; " + s.error().message();
    return nullptr;
  }
  w->mapping.reset();
  w->lease.reset();
  w->reason_ = "resident in the daemon's host memory, copied to " + device.Name() +
               (staged_because.empty() ? " (registered as pinned memory)"
                                       : " (through staging buffers; " + staged_because + ")") +
               "; lease given back";
  return w;
}

// Fire and forget: the daemon goes on loading after this connection closes.
void AskToPopulate(const LoadSpec& spec, const protocol::Processing& p, const AcquireOptions& o,
                   const std::function<void(const std::string&)>& log) {
  auto cannot = [&](const Error& e) {
    log("could not ask the daemon to preload " + spec.path + ": " + e.message());
  };
  auto real = io::PosixFileSystem().RealPath(spec.path);
  if (!real.ok()) return cannot(real.error());
  // The daemon reads a plan file too, from its own working directory.
  protocol::Processing absolute = p;
  if (transform::IsPlanFile(p.shard_plan)) {
    auto plan = io::PosixFileSystem().RealPath(p.shard_plan);
    if (!plan.ok()) return cannot(plan.error());
    absolute.shard_plan = *plan;
  }
  auto ch =
      protocol::ConnectToDaemon(protocol::SocketDirectory(o.socket_dir), BusyConnectTimeoutMs(o));
  if (!ch.ok()) return cannot(ch.error());
  json request = {{"type", "preload"},
                  {"path", protocol::PathToJson(*real)},
                  {"processing", protocol::ToJson(absolute)}};
  // On a GPU, this rank only: the other ranks' engines are on other GPUs,
  // and ask for their own.
  if (p.device != "host" && p.tp_size > 1) request["ranks"] = {p.tp_rank};
  if (Status sent = ch->Send(request); !sent.ok()) return cannot(sent.error());
  log("asked the daemon to preload " + *real + " for the next start");
}

}  // namespace

std::string_view MissKindName(MissKind kind) {
  switch (kind) {
    case MissKind::kNone:
      return "none";
    case MissKind::kNoDaemon:
      return "no_daemon";
    case MissKind::kNotResident:
      return "not_resident";
    case MissKind::kDifferent:
      return "different";
    case MissKind::kFailed:
      return "failed";
  }
  return "failed";  // not a kind: only for a compiler that wants a return here
}

const Tensor* Weights::Find(std::string_view name) const {
  const auto& all = tensors();
  auto it = std::lower_bound(all.begin(), all.end(), name,
                             [](const Tensor& t, std::string_view n) { return t.name < n; });
  return it != all.end() && it->name == name ? &*it : nullptr;
}

uint64_t Weights::bytes() const {
  uint64_t n = 0;
  for (const Tensor& t : tensors()) n += t.bytes;
  return n;
}

Result<std::string> Weights::Checksum() const {
  constexpr uint64_t kPiece = 64 << 20;  // copied off a GPU at a time
  fingerprint::Xxh3 sum;
  std::vector<std::byte> piece;
  for (const Tensor& t : tensors()) {
    sum.U64(t.name.size());
    sum.Update(t.name.data(), t.name.size());
    sum.U64(t.bytes);
    if (t.device_address == 0) {
      sum.Update(t.data.data(), t.data.size());
      continue;
    }
    for (uint64_t at = 0; at < t.bytes; at += kPiece) {
      piece.resize(static_cast<size_t>(std::min(kPiece, t.bytes - at)));
      WEIGHTD_RETURN_IF_ERROR(CopyToHost(t, at, piece));
      sum.Update(piece.data(), piece.size());
    }
  }
  return sum.Tagged();
}

Result<std::unique_ptr<Weights>> Acquire(const LoadSpec& spec, const AcquireOptions& options) {
  auto log = options.log ? options.log : [](const std::string& line) {
    std::cerr << "weightd: " << protocol::Printable(line) << "\n";
  };
  // Said afresh by every call, whichever way it ends: a Miss kept across
  // calls (rank after rank) never shows an earlier call's.
  if (options.miss != nullptr) *options.miss = {};
  if (options.waited_seconds != nullptr) *options.waited_seconds = 0;
  // One wait for the whole call, from the first request on, however many
  // times the daemon is asked (a trusted name, then the content, its
  // fingerprint taken between; a GPU's copy from host memory): an hour at
  // most (inf means that), nan not at all.
  const double wait =
      std::isnan(options.wait_for_daemon_seconds)
          ? 0
          : std::clamp(options.wait_for_daemon_seconds, 0.0, protocol::kMaxAcquireWaitSeconds);
  std::optional<std::chrono::steady_clock::time_point> first_asked;
  auto wait_left = [&](const AcquireOptions& o) {
    const auto now = std::chrono::steady_clock::now();
    if (!first_asked) first_asked = now;
    AcquireOptions timed = o;
    const double spent = std::chrono::duration<double>(now - *first_asked).count();
    timed.wait_for_daemon_seconds = std::max(0.0, wait - spent);
    return timed;
  };
  const protocol::Processing processing{spec.tp_size,       spec.tp_rank,    spec.dtype,
                                        spec.quant,         spec.shard_plan, spec.device,
                                        options.fingerprint};
  // The plan (a file's included) is read and checked before anything else.
  WEIGHTD_ASSIGN_OR_RETURN(
      transform::Processing resolved,
      transform::ResolveProcessing(spec.tp_size, spec.dtype, spec.quant, spec.shard_plan));
  WEIGHTD_RETURN_IF_ERROR(protocol::CheckSupported(processing));
  const std::string& plan_name = resolved.plan->name();
  const std::string& plan_digest = resolved.plan->digest();
  // A GPU is named by its UUID in the key: this process's cuda:N may be
  // another process's cuda:M.
  WEIGHTD_ASSIGN_OR_RETURN(const memory::Device device,
                           memory::ResolveDevice(protocol::DeviceOfRank(processing, spec.tp_rank)));
  protocol::Processing keyed = processing;
  keyed.device = device.Name();

  // The checkpoint's real path and shard files, sent with an acquire only
  // to explain a miss against the engine's own model, or one of its
  // layout: the fingerprint finds both anyway; the path resolved apart
  // only where none ran (trust) or none did (a single file).
  EngineCheckpoint checkpoint;
  // The key with the checkpoint's content digest (the stat cache answers
  // for unchanged shards).
  auto content_key = [&]() -> Result<protocol::CacheKey> {
    std::unique_ptr<fingerprint::StatCache> cache;
    if (options.stat_cache) {
      cache = fingerprint::StatCache::Load(fingerprint::StatCache::DefaultDirectory());
    }
    fingerprint::Options fo;
    fo.cache = cache.get();
    fo.mode = fingerprint::ModeNamed(processing.fingerprint);
    WEIGHTD_ASSIGN_OR_RETURN(
        fingerprint::Fingerprint fp,
        fingerprint::FingerprintCheckpoint(io::PosixFileSystem(), spec.path, fo));
    if (cache) {
      (void)cache->Save();
      if (const std::string w = cache->warning(); !w.empty()) log("stat cache: " + w);
    }
    checkpoint.path = fp.real_path;
    // A single file's name says nothing of its layout: its size alone.
    const bool single_file = fp.real_path.empty();
    std::vector<protocol::ShardSize> shards;
    for (const fingerprint::ShardFingerprint& shard : fp.shards) {
      shards.push_back({single_file ? "" : shard.name, shard.file_bytes});
    }
    // Within what a request may be: a checkpoint of a thousand shards and
    // more says nothing of them (a miss against another model is then
    // called a changed checkpoint, as by an engine that sends none).
    checkpoint.shards = protocol::ToJson(shards);
    if (checkpoint.shards.dump().size() > kMostShardListBytes) checkpoint.shards = nullptr;
    return protocol::MakeKey(fp.digest, keyed, plan_name, plan_digest);
  };

  protocol::CacheKey key;
  Miss miss;
  double waited = 0;
  bool reloaded = false;
  // The daemon asked for `key`; a model it holds in host memory only is
  // copied up to this GPU from there (the host-tier reload).
  auto ask = [&](const AcquireOptions& o) {
    miss = {};
    if (checkpoint.path.empty()) {
      if (auto real = io::PosixFileSystem().RealPath(spec.path); real.ok()) checkpoint.path = *real;
    }
    std::unique_ptr<WeightsImpl> w = TryDaemon(key, wait_left(o), checkpoint, miss);
    if (!w && device.kind == memory::DeviceKind::kCuda &&
        miss.fields == std::vector<std::string>{"device"}) {
      w = ReloadFromHost(key, device, wait_left(o), checkpoint, miss);
      reloaded = w != nullptr;
    }
    waited += miss.waited;
    return w;
  };
  std::unique_ptr<WeightsImpl> hit;
  AcquireOptions checked = options;  // what the lookup that counts was asked with
  if (!options.trust.empty()) {
    key = protocol::MakeKey("", keyed, plan_name, plan_digest);
    hit = ask(options);
    if (!hit && (miss.kind == MissKind::kNotResident || miss.kind == MissKind::kDifferent)) {
      // The name is not (or no longer) on a model like this: the checkpoint
      // may still be resident, found by its content as without --trust.
      // (A daemon that did not answer, or whose model could not be mapped,
      // is not asked again: the disk load follows.)
      log("trusted name `" + options.trust + "` not served (" + miss.reason + "); checking " +
          spec.path + "'s content instead");
      checked.trust.clear();
    }
  }
  // What the daemon said and how long it was waited for: told also when
  // the content's key then fails (a trusted name not served, then the
  // checkpoint unreadable).
  auto tell = [&] {
    if (options.miss != nullptr && !hit) {
      *options.miss = {miss.kind, miss.reason, miss.mismatch, miss.fields};
    }
    if (options.waited_seconds != nullptr) *options.waited_seconds = waited;
  };
  if (!hit && checked.trust.empty()) {
    auto content = content_key();
    if (!content.ok()) {
      tell();
      return content.error();
    }
    key = *std::move(content);
    hit = ask(checked);
  }
  tell();
  if (hit) {
    if (!checked.trust.empty()) {
      hit->trusted_ = checked.trust;
      const std::string& from = hit->loaded_from_;
      log("TRUSTING resident model `" + options.trust + "`" +
          (from.empty() ? "" : " (loaded from " + from + ")") + " for " + spec.path +
          (from.empty() || from == checkpoint.path ? "" : ", another directory,") +
          " without comparing its content: changes to that checkpoint are not seen until it is "
          "preloaded again");
    }
    if (hit->cuda_mapping && !hit->cuda_mapping->read_only()) log(hit->reason_);
    // A copy from host memory is this engine's own: the next start may find
    // the model on the GPU instead.
    if (reloaded && options.populate) AskToPopulate(spec, keyed, options, log);
    return std::unique_ptr<Weights>(std::move(hit));
  }
  if (!options.fallback) {
    // Nothing read here: the daemon may start at once.
    if (options.populate && miss.daemon_reachable) AskToPopulate(spec, keyed, options, log);
    return Error("not served by the daemon: " + miss.reason);
  }
  log("loading " + spec.path + " from disk" +
      (device.kind == memory::DeviceKind::kCuda ? " onto " + device.Name() : "") + ": " +
      miss.reason);

  // The same loader as the daemon's, for this rank only.
  loader::LoadOptions lo;
  lo.segment_name = io::BaseName(spec.path);
  lo.processing = resolved;
  lo.ranks = {spec.tp_rank};
  if (device.kind == memory::DeviceKind::kCuda) {
    lo.allocate = [&](uint64_t bytes, int) {
      return memory::CreateCudaSegment(bytes, device.uuid);
    };
  }
  WEIGHTD_ASSIGN_OR_RETURN(loader::LoadedModel loaded,
                           loader::LoadCheckpoint(io::PosixFileSystem(), spec.path, lo));
  auto w = std::make_unique<WeightsImpl>();
  w->source_ = "disk";
  w->reason_ = miss.reason;
  w->miss_kind_ = miss.kind;
  w->mismatch_ = miss.mismatch;
  w->fields_ = miss.fields;
  w->digest_ = loaded.checkpoint_digest;
  w->segment = std::move(loaded.ranks[0].segment);
  if (device.kind == memory::DeviceKind::kCuda) {
    w->manifest_copy = std::move(loaded.manifest);
    WEIGHTD_RETURN_IF_ERROR(w->IndexOnGpu(w->manifest_copy, w->segment->device_address(),
                                          w->segment->size(), device.Name()));
  } else {
    WEIGHTD_RETURN_IF_ERROR(w->Index(w->segment->readable()));
  }
  // After our own load, so the two do not read the checkpoint at once.
  if (options.populate && miss.daemon_reachable) AskToPopulate(spec, keyed, options, log);
  return std::unique_ptr<Weights>(std::move(w));
}

}  // namespace weightd
