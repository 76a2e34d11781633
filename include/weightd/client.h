// The engine's side of weightd: ask for a checkpoint's weights and get a
// read-only view of every tensor, from the daemon when it holds exactly
// what this engine would have loaded, from disk otherwise.
//
//   weightd::LoadSpec spec{.path = "/models/llama-3-8b"};
//   auto weights = weightd::Acquire(spec, {});
//   if (!weights.ok()) ...;  // the disk load failed too (a missing or broken
//                            // checkpoint, no memory), or fallback is off
//   for (const weightd::Tensor& t : (*weights)->tensors()) use(t.name, t.data);
//
// The engine computes the checkpoint's content key itself (the sampled
// fingerprint, with the stat shortcut) and the daemon compares it with what
// it holds, field by field; any difference is a miss that names the fields,
// and the engine loads from disk through the same loader the daemon uses, so
// the bytes are the same either way (Weights::Checksum proves it). The
// sampled fingerprint reads each tensor's first KiB: an edit past it alone
// is not seen (docs/fingerprint.md).
//
// Thread safety: Acquire may be called from many threads (AcquireOptions::
// log may then be called from several at once); a Weights object is
// immutable and may be read from any thread while it lives.
//
// What lives how long: everything a Tensor holds (name, dtype, shape, data,
// device_address) points into the Weights it came from, and is valid while
// that object lives, no longer; copy what must outlive it. The daemon
// stopping, being killed or evicting the model does not end it: a mapping
// keeps its memory. On a GPU, destroying the Weights frees or unmaps its
// memory at once: synchronize every stream that reads it first.
//
// Across fork(): a child keeps its copy of host Weights (the same bytes,
// also after the parent lets go and the daemon evicts the model), but not
// the lease, which stays the parent's: the model is idle once the parent
// lets go, whatever its children do. Weights on a GPU are not for a child
// to use or destroy (CUDA does not survive fork).
//
// Weights are for reading. Host bytes are read-only in every mode and from
// every source (mapped PROT_READ: a write faults); an engine that rewrites
// weights in place (repacking, fused scales) copies them into its own
// buffers first. On a GPU, the daemon's memory is mapped read-only where the
// driver allows it (a kernel's store into it faults and costs the engine its
// CUDA context); the engine's own copies there are not protected, but are
// not the engine's to write either.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "weightd/result.h"

namespace weightd {

struct LoadSpec {
  std::string path;  // checkpoint directory or single .safetensors file
  // Processing: this rank's share of a tensor-parallel split (by the shard
  // plan: "llama", "replicate" or a TOML plan file's path; it must be named
  // to split or quantize), cast to `dtype` (keep, bf16, fp16, fp32),
  // quantized (none, fp8-block). Whether the daemon or the disk fallback
  // does it, the bytes are the same.
  int tp_size = 1;
  int tp_rank = 0;
  std::string dtype = "keep";
  std::string quant = "none";
  std::string shard_plan = {};  // empty: none named
  // Where the weights are wanted: cpu (host memory), cuda:N (this process's
  // numbering, CUDA_VISIBLE_DEVICES applied) or cuda:GPU-<uuid>; or one of
  // those per rank, comma-separated (this rank's is used).
  std::string device = "cpu";
};

// Why the daemon did not serve the weights, for an engine that acts on it
// (an alert on kFailed, say) without reading the reason's words.
enum class MissKind {
  kNone,         // it served them
  kNoDaemon,     // no daemon answered on the socket: not running, or not yet
  kNotResident,  // the daemon holds nothing like them: a cold start, or one it is
                 // still loading, or whose last preload failed (the reason says)
  kDifferent,    // it holds the model with other key fields (see the mismatch):
                 // changed content, other processing, another device
  kFailed,       // it was reached, but the exchange failed: no answer, a refusal,
                 // a protocol, mapping or copy error; or what is at its socket will
                 // not do (an unsafe socket directory, another user's daemon)
};
// "none", "no_daemon", "not_resident", "different", "failed".
std::string_view MissKindName(MissKind kind);

enum class AcquireMode {
  kZeroCopy,  // map the daemon's segment; the lease lasts as long as the Weights
  // Copy into this process's own memory (on a GPU: its own allocation
  // there) and give the lease back at once.
  kCopy,
};
// Either way, asked for a GPU, a model the daemon holds in its host memory
// only is copied up into the engine's own GPU memory (the host-tier reload:
// at the bus's speed, faster than the disk) and the lease given back; with
// `populate`, the daemon is asked to keep it on the GPU for next time.

struct AcquireOptions {
  AcquireMode mode = AcquireMode::kZeroCopy;
  // Load from disk on any miss or error; false turns those into errors.
  bool fallback = true;
  // Wait this long for a daemon that is starting (its socket not there
  // yet), and for a load of exactly this model that the daemon has in
  // flight (its config's preloads at start, another engine's --populate):
  // once for the whole call, however many requests it sends (an hour at
  // most). Besides it, each request waits up to reply_timeout_seconds for
  // an answer from a daemon that has stopped answering.
  double wait_for_daemon_seconds = 0;
  // How long a request waits for the daemon's answer before the call gives
  // up on the daemon (and falls back, with fallback): a daemon stopped
  // (SIGSTOP) or hung accepts connections and never answers. Not a bound
  // on a load the engine was told to wait for, which comes on top. A
  // connect to a daemon whose queue of connections is full waits no longer
  // either (10 s at most). Above 0, an hour at most (more means an hour);
  // 0, less or nan mean the default.
  double reply_timeout_seconds = 30;
  // After a miss, ask the daemon to preload the checkpoint for next time.
  bool populate = false;
  // Trust the resident model pinned under this name without comparing its
  // content with the checkpoint on disk (every other key field is checked).
  std::string trust;
  // Socket directory; empty: $WEIGHTD_SOCKET_DIR, $XDG_RUNTIME_DIR/weightd,
  // /tmp/weightd-$UID.
  std::string socket_dir;
  // Use the fingerprint's stat cache (false: read the samples every time).
  bool stat_cache = true;
  // How the checkpoint's content key is made: "sampled" (each tensor's
  // first KiB: fast on network storage, blind to an edit past it) or
  // "full" (every byte: sees any edit; read once per change of the files,
  // the stat cache answering after that). The daemon's model must have been
  // preloaded the same way to match; --populate asks for it so.
  std::string fingerprint = "sampled";
  // Where the one-line reasons go (fallbacks, trust); default: stderr, with
  // control characters written as \xNN. A line given here is as it came:
  // paths and the daemon's words may hold control characters, to escape
  // before a terminal sees them.
  std::function<void(const std::string&)> log;
  // When set, receives the daemon's miss (why, and the key fields that
  // differed), also when Acquire then fails (no fallback) or loads from disk;
  // emptied first by every call (a hit, or an error before the daemon was
  // asked, leaves it empty).
  struct Miss {
    MissKind kind = MissKind::kNone;
    std::string reason;
    std::vector<std::string> mismatch;  // "checkpoint: daemon has ..., engine wants ..."
    std::vector<std::string> fields;    // "checkpoint", "tp_rank", ...
  };
  Miss* miss = nullptr;
  // When set, receives how long Acquire waited for the daemon, as
  // wait_for_daemon_seconds let it (to start, or to load this model): a
  // part of the time it took, not the load's own; 0 when it did not wait
  // (a daemon that was there and answered at once).
  double* waited_seconds = nullptr;
};

struct Tensor {
  std::string_view name;
  std::string_view dtype;  // safetensors spelling: "BF16", "F32", ...
  std::span<const uint64_t> shape;
  // The bytes, in host memory; empty for weights on a GPU. Row-major and
  // contiguous, as the file stores them; every tensor starts at a 256-byte
  // boundary of its segment (a GPU's included), itself page-aligned.
  std::span<const std::byte> data;
  uint64_t bytes = 0;
  // On a GPU: the address of the first byte (a CUdeviceptr in this
  // process's unified address space, mapped for that GPU; made current with
  // its primary context, which engines normally use); 0 in host memory.
  uint64_t device_address = 0;
};

class Weights {
 public:
  virtual ~Weights() = default;

  // By name: this object's own table, valid while it lives.
  virtual std::span<const Tensor> tensors() const = 0;
  const Tensor* Find(std::string_view name) const;

  // "daemon" or "disk", and why: in words, and as a kind (kNone from the
  // daemon).
  virtual std::string_view source() const = 0;
  virtual const std::string& reason() const = 0;
  virtual MissKind miss_kind() const = 0;
  // On a miss, the key fields that differed ("checkpoint: daemon has ...").
  virtual const std::vector<std::string>& mismatch() const = 0;
  // The key fields that differed, by name ("checkpoint", "tp_rank").
  virtual const std::vector<std::string>& mismatch_fields() const = 0;
  // The checkpoint's content digest: as the daemon's key carries it when
  // served by the daemon; from a disk load, the sampled digest of what was
  // read (whatever AcquireOptions::fingerprint keyed the acquire by).
  virtual const std::string& checkpoint_digest() const = 0;
  // Where the bytes are: "host" or "cuda:GPU-<uuid>".
  virtual const std::string& device() const = 0;
  // How this process holds them, whatever was asked: kZeroCopy when they
  // are the daemon's memory mapped here (its lease held while this object
  // lives), kCopy when they are this process's own (copied from the daemon,
  // up from its host memory to a GPU, or loaded from disk).
  virtual AcquireMode mode() const = 0;
  // The pinned name the weights were taken on trust under (AcquireOptions::
  // trust), their content not compared with the checkpoint; empty when it
  // was.
  virtual const std::string& trusted() const = 0;

  uint64_t bytes() const;
  // XXH3-128 over every tensor's name and bytes, in name order, tagged:
  // equal whether the weights came from the daemon or from disk, and on
  // whichever device (a GPU's are copied back to host memory for it, a
  // piece at a time).
  Result<std::string> Checksum() const;

  // Copies `out.size()` bytes of `t` (one of tensors()) from `offset` into
  // host memory: a GPU's by a copy off the device.
  virtual Status CopyToHost(const Tensor& t, uint64_t offset, std::span<std::byte> out) const = 0;
};

// Errors found before the daemon is asked (or, with `trust`, between the
// trusted name's lookup and the content's) are returned even with
// fallback, since a disk load would meet them too: a processing option or
// shard plan that cannot be, a device that is not there, a checkpoint whose
// fingerprint cannot be read.
Result<std::unique_ptr<Weights>> Acquire(const LoadSpec& spec, const AcquireOptions& options);

}  // namespace weightd
