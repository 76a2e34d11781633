#include "weightd/client.h"

#include <stdlib.h>
#include <sys/mman.h>
#include <xxhash.h>

#include <chrono>
#include <cstring>
#include <iostream>
#include <optional>
#include <thread>

#include "fingerprint/fingerprint.h"
#include "format/dtype.h"
#include "io/file.h"
#include "loader/loader.h"
#include "memory/cuda.h"
#include "memory/manifest.h"
#include "memory/segment.h"
#include "protocol/cache_key.h"
#include "protocol/channel.h"
#include "protocol/paths.h"
#include "transform/plan.h"

namespace weightd {
namespace {

using nlohmann::json;

constexpr int kReplyTimeoutMs = 30'000;
constexpr auto kConnectRetry = std::chrono::milliseconds(50);

// Private, page-aligned memory for `copy` mode.
class OwnedBytes {
 public:
  static Result<OwnedBytes> Copy(std::span<const std::byte> from) {
    void* p = ::mmap(nullptr, std::max<size_t>(from.size(), 1), PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
      return Error("cannot allocate " + std::to_string(from.size()) + " bytes for a copy");
    }
    std::memcpy(p, from.data(), from.size());
    // Read-only from here on, as every other view is.
    ::mprotect(p, std::max<size_t>(from.size(), 1), PROT_READ);
    OwnedBytes b;
    b.data_ = static_cast<std::byte*>(p);
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
  ~OwnedBytes() {
    if (data_ != nullptr) ::munmap(data_, std::max<size_t>(size_, 1));
  }
  std::span<const std::byte> bytes() const { return {data_, size_}; }

 private:
  std::byte* data_ = nullptr;
  size_t size_ = 0;
};

class WeightsImpl final : public Weights {
 public:
  const std::vector<Tensor>& tensors() const override { return tensors_; }
  std::string_view source() const override { return source_; }
  const std::string& reason() const override { return reason_; }
  const std::vector<std::string>& mismatch() const override { return mismatch_; }
  const std::vector<std::string>& mismatch_fields() const override { return fields_; }
  const std::string& checkpoint_digest() const override { return digest_; }

  // Builds the tensor views over `segment` (which this object keeps alive).
  Status Index(std::span<const std::byte> bytes) {
    WEIGHTD_ASSIGN_OR_RETURN(memory::ManifestView view, memory::ReadManifest(bytes));
    tensors_.reserve(view.tensors.size());
    for (const memory::TensorRecord& r : view.tensors) {
      // The engine will index the data by shape: shape and dtype must
      // account for exactly the bytes the record gives.
      auto dtype = format::ParseDType(r.dtype);
      if (!dtype) return Error("segment tensor `" + std::string(r.name) + "`: unknown dtype");
      uint64_t elements = 1;
      for (uint64_t d : r.shape) {
        if (__builtin_mul_overflow(elements, d, &elements)) elements = UINT64_MAX;
      }
      uint64_t bits;
      if (__builtin_mul_overflow(elements, format::DTypeBits(*dtype), &bits) ||
          (bits + 7) / 8 != r.bytes) {
        return Error("segment tensor `" + std::string(r.name) + "`: its shape does not match its " +
                     std::to_string(r.bytes) + " bytes");
      }
      tensors_.push_back(
          {r.name, r.dtype, r.shape,
           bytes.subspan(static_cast<size_t>(r.offset), static_cast<size_t>(r.bytes))});
    }
    return OkStatus();
  }

  // What keeps the bytes alive: one of these.
  std::unique_ptr<memory::Mapping> mapping;
  std::optional<protocol::Channel> lease;  // zero_copy: the connection holds the lease
  OwnedBytes owned;
  std::unique_ptr<memory::Segment> segment;

  std::vector<Tensor> tensors_;
  std::string source_;
  std::string reason_;
  std::vector<std::string> mismatch_;
  std::vector<std::string> fields_;
  std::string digest_;
};

struct Miss {
  std::string reason;
  std::vector<std::string> mismatch;
  std::vector<std::string> fields;
  bool daemon_reachable = false;
};

Result<protocol::Channel> ConnectWaiting(const std::string& socket_dir, double wait_seconds) {
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::duration<double>(wait_seconds);
  while (true) {
    auto ch = protocol::ConnectToDaemon(socket_dir);
    if (ch.ok() || std::chrono::steady_clock::now() >= deadline) return ch;
    std::this_thread::sleep_for(kConnectRetry);
  }
}

Result<protocol::Message> Expect(protocol::Channel& ch, const std::string& want) {
  WEIGHTD_ASSIGN_OR_RETURN(protocol::Message m, ch.Receive(kReplyTimeoutMs));
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

// Asks the daemon; on a hit returns the weights, else fills `miss`.
std::unique_ptr<WeightsImpl> TryDaemon(const protocol::CacheKey& key, const AcquireOptions& o,
                                       Miss& miss) {
  auto ch = ConnectWaiting(protocol::SocketDirectory(o.socket_dir), o.wait_for_daemon_seconds);
  if (!ch.ok()) {
    miss.reason = "no daemon: " + ch.error().message();
    return nullptr;
  }
  miss.daemon_reachable = true;
  auto fail = [&](const std::string& what, const Error& e) {
    miss.reason = what + ": " + e.message();
    return nullptr;
  };
  // Hello and acquire go out together: one round trip, not two. A daemon
  // that cannot speak our version answers the hello with an error.
  json request = {{"type", "acquire"}, {"key", protocol::ToJson(key)}};
  if (!o.trust.empty()) request["trust"] = o.trust;
  if (Status s = ch->Send({{"type", "hello"}, {"versions", {protocol::kProtocolVersion}}});
      !s.ok()) {
    return fail("protocol error", s.error());
  }
  if (Status s = ch->Send(request); !s.ok()) return fail("protocol error", s.error());
  if (auto hello = Expect(*ch, "hello"); !hello.ok()) return fail("protocol error", hello.error());
  auto reply = Expect(*ch, "acquired");
  if (!reply.ok()) return fail("protocol error", reply.error());
  const json& body = reply->body;
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
    if (!miss.mismatch.empty()) {
      miss.reason += ": ";
      for (size_t i = 0; i < miss.mismatch.size(); ++i) {
        miss.reason += (i ? "; " : "") + miss.mismatch[i];
      }
    }
    return nullptr;
  }
  if (reply->fds.size() != 1 || !body.contains("bytes") || !body["bytes"].is_number_unsigned() ||
      !body.contains("key")) {
    miss.reason = "protocol error: an `acquired` reply without one segment and its size";
    return nullptr;
  }
  auto held = protocol::KeyFromJson(body["key"]);
  if (!held.ok()) return fail("protocol error", held.error());
  if (!protocol::Compare(*held, key, !o.trust.empty()).empty()) {
    miss.reason = "protocol error: the daemon served a model with another key";
    return nullptr;
  }
  auto mapping = memory::MapHostSegment(reply->fds[0], body["bytes"].get<uint64_t>());
  if (!mapping.ok()) return fail("mapping error", mapping.error());

  auto w = std::make_unique<WeightsImpl>();
  w->source_ = "daemon";
  w->digest_ = held->checkpoint;
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
  w->lease.emplace(std::move(ch).value());
  w->reason_ = "resident in the daemon (mapped read-only)";
  return w;
}

// Fire and forget: the daemon goes on loading after this connection closes.
void AskToPopulate(const LoadSpec& spec, const protocol::Processing& p, const AcquireOptions& o,
                   const std::function<void(const std::string&)>& log) {
  auto real = io::PosixFileSystem().RealPath(spec.path);
  // The daemon reads a plan file too, from its own working directory.
  protocol::Processing absolute = p;
  if (transform::IsPlanFile(p.shard_plan)) {
    auto plan = io::PosixFileSystem().RealPath(p.shard_plan);
    if (!plan.ok()) return;
    absolute.shard_plan = *plan;
  }
  auto ch = protocol::ConnectToDaemon(protocol::SocketDirectory(o.socket_dir));
  if (!real.ok() || !ch.ok()) return;
  if (ch->Send({{"type", "preload"}, {"path", *real}, {"processing", protocol::ToJson(absolute)}})
          .ok()) {
    log("asked the daemon to preload " + *real + " for the next start");
  }
}

}  // namespace

const Tensor* Weights::Find(std::string_view name) const {
  const auto& all = tensors();
  auto it = std::lower_bound(all.begin(), all.end(), name,
                             [](const Tensor& t, std::string_view n) { return t.name < n; });
  return it != all.end() && it->name == name ? &*it : nullptr;
}

uint64_t Weights::bytes() const {
  uint64_t n = 0;
  for (const Tensor& t : tensors()) n += t.data.size();
  return n;
}

std::string Weights::Checksum() const {
  XXH3_state_t* state = XXH3_createState();
  XXH3_128bits_reset(state);
  for (const Tensor& t : tensors()) {
    const uint64_t name_size = t.name.size(), data_size = t.data.size();
    XXH3_128bits_update(state, &name_size, sizeof name_size);
    XXH3_128bits_update(state, t.name.data(), t.name.size());
    XXH3_128bits_update(state, &data_size, sizeof data_size);
    XXH3_128bits_update(state, t.data.data(), t.data.size());
  }
  XXH128_canonical_t c;
  XXH128_canonicalFromHash(&c, XXH3_128bits_digest(state));
  XXH3_freeState(state);
  static const char* kHex = "0123456789abcdef";
  std::string out = "xxh3-128:";
  for (unsigned char b : c.digest) {
    out += kHex[b >> 4];
    out += kHex[b & 0xf];
  }
  return out;
}

Result<std::unique_ptr<Weights>> Acquire(const LoadSpec& spec, const AcquireOptions& options) {
  auto log = options.log ? options.log : [](const std::string& line) {
    std::cerr << "weightd: " << line << "\n";
  };
  const protocol::Processing processing{spec.tp_size, spec.tp_rank,    spec.dtype,
                                        spec.quant,   spec.shard_plan, spec.device};
  // The plan (a file's included) is read and checked before anything else.
  WEIGHTD_ASSIGN_OR_RETURN(
      transform::Processing resolved,
      transform::ResolveProcessing(spec.tp_size, spec.dtype, spec.quant, spec.shard_plan));
  WEIGHTD_RETURN_IF_ERROR(protocol::CheckSupported(processing));
  const std::string& plan_name = resolved.plan->name();
  const std::string& plan_digest = resolved.plan->digest();
  // A GPU is named by its UUID in the key: this process's cuda:N may be
  // another process's cuda:M.
  protocol::Processing keyed = processing;
  WEIGHTD_ASSIGN_OR_RETURN(memory::DeviceSpec device, memory::ParseDevice(processing.device));
  if (device.kind == memory::DeviceSpec::Kind::kCudaOrdinal) {
    auto visible = memory::ListCudaDevices();
    if (!visible.ok())
      return Error("--device " + processing.device + ": " + visible.error().message());
    WEIGHTD_ASSIGN_OR_RETURN(std::string uuid,
                             memory::ResolveCudaOrdinal(device.ordinal, *visible));
    keyed.device = "cuda:" + uuid;
  }

  protocol::CacheKey key;
  if (options.trust.empty()) {
    std::unique_ptr<fingerprint::StatCache> cache;
    if (options.stat_cache) {
      cache = fingerprint::StatCache::Load(fingerprint::StatCache::DefaultDirectory());
    }
    fingerprint::Options fo;
    fo.cache = cache.get();
    WEIGHTD_ASSIGN_OR_RETURN(
        fingerprint::Fingerprint fp,
        fingerprint::FingerprintCheckpoint(io::PosixFileSystem(), spec.path, fo));
    if (cache) (void)cache->Save();
    key = protocol::MakeKey(fp.digest, keyed, plan_name, plan_digest);
  } else {
    key = protocol::MakeKey("", keyed, plan_name, plan_digest);
  }

  Miss miss;
  if (auto hit = TryDaemon(key, options, miss)) {
    if (!options.trust.empty()) {
      log("TRUSTING resident model `" + options.trust + "` for " + spec.path +
          " without comparing its content: changes to that checkpoint are not seen until it is "
          "preloaded again");
    }
    return std::unique_ptr<Weights>(std::move(hit));
  }
  if (!options.fallback) return Error("not served by the daemon: " + miss.reason);
  if (device.kind != memory::DeviceSpec::Kind::kHost) {
    return Error("--device " + keyed.device + ": not served by the daemon (" + miss.reason +
                 "), and loading onto a GPU from disk is not built yet");
  }
  log("loading " + spec.path + " from disk: " + miss.reason);

  // The same loader as the daemon's, for this rank only.
  loader::LoadOptions lo;
  lo.segment_name = io::BaseName(spec.path);
  lo.processing = resolved;
  lo.ranks = {spec.tp_rank};
  WEIGHTD_ASSIGN_OR_RETURN(loader::LoadedModel loaded,
                           loader::LoadCheckpoint(io::PosixFileSystem(), spec.path, lo));
  auto w = std::make_unique<WeightsImpl>();
  w->source_ = "disk";
  w->reason_ = miss.reason;
  w->mismatch_ = miss.mismatch;
  w->fields_ = miss.fields;
  w->digest_ = loaded.checkpoint_digest;
  w->segment = std::move(loaded.ranks[0].segment);
  WEIGHTD_RETURN_IF_ERROR(w->Index(w->segment->readable()));
  // After our own load, so the two do not read the checkpoint at once.
  if (options.populate && miss.daemon_reachable) AskToPopulate(spec, processing, options, log);
  return std::unique_ptr<Weights>(std::move(w));
}

}  // namespace weightd
