// The CUDA driver, loaded at run time: `dlopen("libcuda.so.1")` and every
// entry point by `cuGetProcAddress` at an explicit API version, so one
// build runs on hosts with and without a driver, and a host without one
// (or without a GPU) is told why, not crashed. Compiled wherever the
// toolkit's headers are (only the header is used, never libcudart).
//
// Devices are named by UUID ("cuda:GPU-6f0e...") in keys and status, since
// ordinals depend on each process's CUDA_VISIBLE_DEVICES: `--device cuda:N`
// is resolved through this process's own numbering (the driver applies
// CUDA_VISIBLE_DEVICES), so a daemon and an engine that number the GPUs
// differently still agree on the physical one.
//
// The segment: one VMM allocation per model-rank (cuMemCreate with POSIX
// file descriptor handles, sized to the allocation granularity), filled by
// host-to-device copies, exported as a file descriptor; another process
// imports it and maps it read-only (CudaMapping). On an H200 the driver
// enforced that: copies and memsets into the mapping were refused, a
// kernel's store faulted (docs/gpu-results.md; scripts/gpu-check tests it).
//
// Thread safety: everything here may be called from any thread.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "memory/segment.h"
#include "weightd/result.h"

namespace weightd::memory {

// What a --device flag names.
struct DeviceSpec {
  enum class Kind { kHost, kCudaOrdinal, kCudaUuid };
  Kind kind = Kind::kHost;
  int ordinal = 0;   // kCudaOrdinal
  std::string uuid;  // kCudaUuid: "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx"
};

// "cpu" or "host"; "cuda:N"; "cuda:GPU-<uuid>" or "cuda:MIG-<uuid>" (as
// nvidia-smi -L prints them). Anything else is an error that lists the forms.
Result<DeviceSpec> ParseDevice(std::string_view text);

// 16 UUID bytes as nvidia-smi prints a GPU's: "GPU-" and 8-4-4-4-12 hex
// digits. (A MIG instance's UUID comes out with "GPU-" too; nvidia-smi
// shows it as "MIG-": not yet told apart.)
std::string FormatGpuUuid(const std::array<uint8_t, 16>& bytes);

// `size` rounded up to a multiple of `granularity` (a VMM allocation's
// size must be one), or nullopt on overflow or a zero granularity.
std::optional<uint64_t> RoundToGranularity(uint64_t size, uint64_t granularity);

struct CudaDevice {
  int ordinal = 0;  // in this process's numbering
  std::string uuid = {};
  std::string name = {};
  uint64_t total_bytes = 0;
  // Why the device cannot hold segments (VMM allocations exported as file
  // descriptors), with the driver's error; empty when it can.
  std::string not_served = "not asked";
  bool served() const { return not_served.empty(); }
  uint64_t granularity = 0;  // of a pinned device allocation
};

// What the driver sees, or why there is no CUDA here ("libcuda.so.1 not
// found: ...", "no CUDA device: ..."). Asked once per process: the driver
// fixes what a process sees when it starts.
Result<std::vector<CudaDevice>> ListCudaDevices();

// The device an ordinal names in this process, by UUID.
// `visible` is what ListCudaDevices returned.
Result<std::string> ResolveCudaOrdinal(int ordinal, const std::vector<CudaDevice>& visible);

// Whether two UUIDs ("GPU-…" or "MIG-…", 8-4-4-4-12 hex digits) name the
// same GPU: the driver lists a MIG instance's with GPU- too.
bool SameGpu(std::string_view a, std::string_view b);

// What a --device flag names, resolved: the host, or a GPU by UUID (an
// ordinal through this process's numbering, which needs the driver).
Result<Device> ResolveDevice(std::string_view text);

// A segment of `size` bytes in the memory of the GPU `uuid` ("GPU-..."),
// mapped read-write into this process (at device_address()). Write()
// copies from host memory through pinned staging buffers, the copies
// running on their own streams while the writer goes on (the bytes are on
// the GPU once Seal() returns; the buffers are freed then); readable()
// stays empty, ReadBack() copies the bytes back. Each call makes the GPU's
// primary context current on the calling thread.
Result<std::unique_ptr<Segment>> CreateCudaSegment(uint64_t size, const std::string& uuid);

// The GPU `uuid`'s primary context, started (the driver too) and held for
// as long as this lives: what an engine has before it asks for weights, so
// a tool can time an acquire apart from starting CUDA.
class CudaContextHold {
 public:
  CudaContextHold() = default;
  CudaContextHold(const CudaContextHold&) = delete;
  CudaContextHold& operator=(const CudaContextHold&) = delete;
  virtual ~CudaContextHold() = default;
};
Result<std::unique_ptr<CudaContextHold>> HoldCudaContext(const std::string& uuid);

// What a segment of `size` bytes takes on the GPU `uuid`: its allocation,
// in whole granules of the device's granularity. A budget reserves this
// before CreateCudaSegment makes it.
Result<uint64_t> CudaSegmentBytes(uint64_t size, const std::string& uuid);

// The host-tier reload: `host` (a mapped host segment, say) copied into a
// new, sealed segment on the GPU `uuid`, registered as pinned memory
// (read-only, so a sealed mapping qualifies) so that the GPU copies it
// straight at the bus's speed; through the staging buffers where the driver
// will not register it. `staged_because` (optional) is set to why the driver
// would not register it, or to "" when it did.
Result<std::unique_ptr<Segment>> CopyToCudaSegment(std::span<const std::byte> host,
                                                   const std::string& uuid,
                                                   std::string* staged_because = nullptr);

// What writes to memory mapped read-only did (a check, for tools).
struct WriteAttempt {
  std::string copy;    // a host-to-device copy into it: "accepted" or the error
  std::string memset;  // a device memset on it: "accepted", the error, or why not tried
  std::string kernel;  // a kernel's store into it: "accepted", the error, or why not tried
  // "ok", or why the bytes could not be read after a write (a refused
  // write may leave the context unusable: every later call fails).
  std::string read_back;
  bool changed = false;  // whether a read back differed from the bytes before
  // Where they changed: "yes" once the bytes from before are written back
  // (after each write that changed them), else why not; empty where
  // nothing changed.
  std::string restored;
};

// Tries to change `bytes` bytes at `address` on the GPU `uuid` (mapped in
// this process, by the client, say), by a copy, a memset and a kernel's
// store (of one byte), reading them back after each: what the driver does
// with writes to memory mapped read-only. Bytes a write did change are written back as they
// were before the next is tried, after `while_changed` (if given) has run
// the first time: memory other processes share is left as it was found.
// A refused write may leave this process's CUDA context unusable: call it
// in a process that ends after.
Result<WriteAttempt> TryWriteOnGpu(const std::string& uuid, uint64_t address, uint64_t bytes,
                                   const std::function<void()>& while_changed = {});

// A segment another process exported, mapped into this process's address
// space on the same GPU. The physical memory stays while any process maps
// it, its exporter gone or not.
class CudaMapping {
 public:
  virtual ~CudaMapping() = default;
  // The GPU virtual address of the segment's first byte.
  virtual uint64_t device_address() const = 0;
  virtual uint64_t size() const = 0;
  // Whether the driver granted read-only access (else read-write, and a
  // warning is the caller's to give).
  virtual bool read_only() const = 0;
  // Copies [offset, offset + out.size()) to host memory.
  virtual Status ReadBack(uint64_t offset, std::span<std::byte> out) const = 0;
  // A new segment of this process's own on the same GPU, with the same
  // bytes (an engine's `copy` mode), sealed.
  virtual Result<std::unique_ptr<Segment>> Copy() const = 0;
};

// Imports `fd` (from Segment::Export of a CUDA segment of `size` bytes on
// the GPU `uuid`) and maps it, asking for read-only access. The mapping's
// length is `size` rounded to the minimum granularity, as the exporter's
// allocation is.
Result<std::unique_ptr<CudaMapping>> MapCudaSegment(const UniqueFd& fd, uint64_t size,
                                                    const std::string& uuid);

}  // namespace weightd::memory
