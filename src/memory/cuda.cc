#include "memory/cuda.h"

#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <charconv>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <system_error>
#include <thread>

#ifdef WEIGHTD_CUDA_HEADERS
#include <cuda.h>
// cuGetProcAddress_v2 and its query result came with CUDA 12.0.
#if CUDA_VERSION >= 12000
#define WEIGHTD_CUDA_DRIVER 1
#endif
#endif

namespace weightd::memory {

Result<DeviceSpec> ParseDevice(std::string_view text) {
  DeviceSpec spec;
  if (text == "cpu" || text == "host") return spec;
  const auto bad = [&] {
    return Error("device `" + std::string(text) +
                 "`: one of cpu, cuda:N (this process's numbering) or cuda:GPU-<uuid>");
  };
  if (text.substr(0, 5) != "cuda:") return bad();
  const std::string_view rest = text.substr(5);
  if (rest.substr(0, 4) == "GPU-" || rest.substr(0, 4) == "MIG-") {
    // 8-4-4-4-12 hex digits.
    const std::string_view hex = rest.substr(4);
    const auto bad_uuid = [&] {
      return Error("device `" + std::string(text) + "`: a GPU's UUID is " +
                   std::string(rest.substr(0, 4)) +
                   " and 8-4-4-4-12 lowercase hex digits, as nvidia-smi -L prints it");
    };
    if (hex.size() != 36) return bad_uuid();
    for (size_t i = 0; i < hex.size(); ++i) {
      const bool dash = i == 8 || i == 13 || i == 18 || i == 23;
      const char c = hex[i];
      const bool is_hex = (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f');
      if (dash ? c != '-' : !is_hex) return bad_uuid();
    }
    spec.kind = DeviceSpec::Kind::kCudaUuid;
    spec.uuid = std::string(rest);
    return spec;
  }
  int n = -1;
  auto [end, ec] = std::from_chars(rest.data(), rest.data() + rest.size(), n);
  if (ec != std::errc() || end != rest.data() + rest.size() || n < 0 || rest.empty()) return bad();
  spec.kind = DeviceSpec::Kind::kCudaOrdinal;
  spec.ordinal = n;
  return spec;
}

std::string FormatGpuUuid(const std::array<uint8_t, 16>& b) {
  char out[64];
  std::snprintf(out, sizeof out,
                "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0],
                b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13],
                b[14], b[15]);
  return out;
}

std::optional<uint64_t> RoundToGranularity(uint64_t size, uint64_t granularity) {
  if (granularity == 0) return std::nullopt;
  uint64_t padded;
  if (__builtin_add_overflow(size, granularity - 1, &padded)) return std::nullopt;
  return padded / granularity * granularity;
}

namespace {

// The allocation's size for a segment of `size` bytes on a GPU of this
// granularity: what the segment takes and what a budget reserves for it.
Result<uint64_t> SegmentBytes(uint64_t size, uint64_t granularity) {
  auto bytes = RoundToGranularity(std::max<uint64_t>(size, 1), granularity);
  if (!bytes) {
    return Error("a segment of " + std::to_string(size) +
                 " bytes cannot be allocated (granularity " + std::to_string(granularity) + ")");
  }
  return *bytes;
}

}  // namespace

Result<uint64_t> CudaSegmentBytes(uint64_t size, const std::string& uuid) {
  WEIGHTD_ASSIGN_OR_RETURN(const std::vector<CudaDevice> gpus, ListCudaDevices());
  for (const CudaDevice& g : gpus) {
    if (SameGpu(g.uuid, uuid)) return SegmentBytes(size, g.granularity);
  }
  return Error("cuda:" + uuid + ": no such GPU in this process (CUDA_VISIBLE_DEVICES applies)");
}

Result<std::string> ResolveCudaOrdinal(int ordinal, const std::vector<CudaDevice>& visible) {
  for (const CudaDevice& d : visible) {
    if (d.ordinal == ordinal) return d.uuid;
  }
  return Error("cuda:" + std::to_string(ordinal) + ": this process sees " +
               std::to_string(visible.size()) + " CUDA device(s) (CUDA_VISIBLE_DEVICES applies)");
}

bool SameGpu(std::string_view a, std::string_view b) {
  return a.size() == 40 && b.size() == 40 && a.substr(4) == b.substr(4);
}

Result<Device> ResolveDevice(std::string_view text) {
  WEIGHTD_ASSIGN_OR_RETURN(DeviceSpec spec, ParseDevice(text));
  switch (spec.kind) {
    case DeviceSpec::Kind::kHost:
      return Device{};
    case DeviceSpec::Kind::kCudaUuid:
      // As the driver's UUIDs are written (a MIG instance's too): one
      // spelling per GPU in keys.
      return Device{DeviceKind::kCuda, "GPU-" + spec.uuid.substr(4)};
    case DeviceSpec::Kind::kCudaOrdinal:
      break;
  }
  auto visible = ListCudaDevices();
  if (!visible.ok())
    return Error("--device " + std::string(text) + ": " + visible.error().message());
  WEIGHTD_ASSIGN_OR_RETURN(std::string uuid, ResolveCudaOrdinal(spec.ordinal, *visible));
  return Device{DeviceKind::kCuda, uuid};
}

#ifdef WEIGHTD_CUDA_DRIVER
namespace {

// The API version every entry point is asked for: the functions' behaviour
// is the one documented for CUDA 12.0, whatever newer driver is installed.
constexpr int kApiVersion = 12000;

struct Driver {
  CUresult (*cuInit)(unsigned int) = nullptr;
  CUresult (*cuGetErrorString)(CUresult, const char**) = nullptr;
  CUresult (*cuDriverGetVersion)(int*) = nullptr;
  CUresult (*cuDeviceGetCount)(int*) = nullptr;
  CUresult (*cuDeviceGet)(CUdevice*, int) = nullptr;
  CUresult (*cuDeviceGetName)(char*, int, CUdevice) = nullptr;
  CUresult (*cuDeviceGetUuid)(CUuuid*, CUdevice) = nullptr;
  CUresult (*cuDeviceTotalMem)(size_t*, CUdevice) = nullptr;
  CUresult (*cuDeviceGetAttribute)(int*, CUdevice_attribute, CUdevice) = nullptr;
  CUresult (*cuMemGetAllocationGranularity)(size_t*, const CUmemAllocationProp*,
                                            CUmemAllocationGranularity_flags) = nullptr;
  // The segment's.
  CUresult (*cuDevicePrimaryCtxRetain)(CUcontext*, CUdevice) = nullptr;
  CUresult (*cuDevicePrimaryCtxRelease)(CUdevice) = nullptr;
  CUresult (*cuCtxPushCurrent)(CUcontext) = nullptr;
  CUresult (*cuCtxPopCurrent)(CUcontext*) = nullptr;
  CUresult (*cuCtxSynchronize)() = nullptr;
  CUresult (*cuMemGetInfo)(size_t*, size_t*) = nullptr;
  CUresult (*cuMemCreate)(CUmemGenericAllocationHandle*, size_t, const CUmemAllocationProp*,
                          unsigned long long) = nullptr;
  CUresult (*cuMemRelease)(CUmemGenericAllocationHandle) = nullptr;
  CUresult (*cuMemAddressReserve)(CUdeviceptr*, size_t, size_t, CUdeviceptr,
                                  unsigned long long) = nullptr;
  CUresult (*cuMemAddressFree)(CUdeviceptr, size_t) = nullptr;
  CUresult (*cuMemMap)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle,
                       unsigned long long) = nullptr;
  CUresult (*cuMemUnmap)(CUdeviceptr, size_t) = nullptr;
  CUresult (*cuMemSetAccess)(CUdeviceptr, size_t, const CUmemAccessDesc*, size_t) = nullptr;
  CUresult (*cuMemGetAccess)(unsigned long long*, const CUmemLocation*, CUdeviceptr) = nullptr;
  CUresult (*cuMemExportToShareableHandle)(void*, CUmemGenericAllocationHandle,
                                           CUmemAllocationHandleType, unsigned long long) = nullptr;
  CUresult (*cuMemImportFromShareableHandle)(CUmemGenericAllocationHandle*, void*,
                                             CUmemAllocationHandleType) = nullptr;
  CUresult (*cuMemcpyHtoD)(CUdeviceptr, const void*, size_t) = nullptr;
  CUresult (*cuMemcpyDtoH)(void*, CUdeviceptr, size_t) = nullptr;
  CUresult (*cuMemcpyDtoDAsync)(CUdeviceptr, CUdeviceptr, size_t, CUstream) = nullptr;
  CUresult (*cuMemsetD8)(CUdeviceptr, unsigned char, size_t) = nullptr;
  // Staged and registered copies.
  CUresult (*cuMemAllocHost)(void**, size_t) = nullptr;
  CUresult (*cuMemFreeHost)(void*) = nullptr;
  CUresult (*cuMemHostRegister)(void*, size_t, unsigned int) = nullptr;
  CUresult (*cuMemHostUnregister)(void*) = nullptr;
  CUresult (*cuMemcpyHtoDAsync)(CUdeviceptr, const void*, size_t, CUstream) = nullptr;
  CUresult (*cuStreamCreate)(CUstream*, unsigned int) = nullptr;
  CUresult (*cuStreamDestroy)(CUstream) = nullptr;
  CUresult (*cuStreamSynchronize)(CUstream) = nullptr;
  CUresult (*cuEventCreate)(CUevent*, unsigned int) = nullptr;
  CUresult (*cuEventRecord)(CUevent, CUstream) = nullptr;
  CUresult (*cuEventSynchronize)(CUevent) = nullptr;
  CUresult (*cuEventDestroy)(CUevent) = nullptr;
  // Optional (a tool's write by a kernel; a driver without them still serves).
  CUresult (*cuModuleLoadData)(CUmodule*, const void*) = nullptr;
  CUresult (*cuModuleUnload)(CUmodule) = nullptr;
  CUresult (*cuModuleGetFunction)(CUfunction*, CUmodule, const char*) = nullptr;
  CUresult (*cuLaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                             unsigned, CUstream, void**, void**) = nullptr;

  std::string Describe(CUresult r) const {
    const char* s = nullptr;
    if (cuGetErrorString != nullptr && cuGetErrorString(r, &s) == CUDA_SUCCESS && s != nullptr) {
      return s;
    }
    return "CUDA error " + std::to_string(static_cast<int>(r));
  }
};

// Loads libcuda.so.1 and every entry point once; the reason when it cannot.
Result<const Driver*> LoadDriver() {
  static std::once_flag once;
  static Driver driver;
  static std::string failure;
  std::call_once(once, [] {
    void* lib = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      const char* why = ::dlerror();
      failure = std::string("no CUDA driver: ") + (why ? why : "libcuda.so.1 not found");
      return;
    }
    using GetProc =
        CUresult (*)(const char*, void**, int, cuuint64_t, CUdriverProcAddressQueryResult*);
    auto get = reinterpret_cast<GetProc>(::dlsym(lib, "cuGetProcAddress_v2"));
    if (get == nullptr) {
      failure = "the CUDA driver is older than 12.0 (no cuGetProcAddress_v2)";
      return;
    }
    auto load = [&](const char* name, auto& fn, bool required = true) {
      void* p = nullptr;
      CUdriverProcAddressQueryResult found{};
      if (get(name, &p, kApiVersion, CU_GET_PROC_ADDRESS_DEFAULT, &found) != CUDA_SUCCESS ||
          found != CU_GET_PROC_ADDRESS_SUCCESS || p == nullptr) {
        if (required && failure.empty()) failure = std::string("the CUDA driver has no ") + name;
        return;
      }
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(p);
    };
    load("cuInit", driver.cuInit);
    load("cuGetErrorString", driver.cuGetErrorString);
    load("cuDriverGetVersion", driver.cuDriverGetVersion);
    load("cuDeviceGetCount", driver.cuDeviceGetCount);
    load("cuDeviceGet", driver.cuDeviceGet);
    load("cuDeviceGetName", driver.cuDeviceGetName);
    load("cuDeviceGetUuid", driver.cuDeviceGetUuid);
    load("cuDeviceTotalMem", driver.cuDeviceTotalMem);
    load("cuDeviceGetAttribute", driver.cuDeviceGetAttribute);
    load("cuMemGetAllocationGranularity", driver.cuMemGetAllocationGranularity);
    load("cuDevicePrimaryCtxRetain", driver.cuDevicePrimaryCtxRetain);
    load("cuDevicePrimaryCtxRelease", driver.cuDevicePrimaryCtxRelease);
    load("cuCtxPushCurrent", driver.cuCtxPushCurrent);
    load("cuCtxPopCurrent", driver.cuCtxPopCurrent);
    load("cuCtxSynchronize", driver.cuCtxSynchronize);
    load("cuMemGetInfo", driver.cuMemGetInfo);
    load("cuMemCreate", driver.cuMemCreate);
    load("cuMemRelease", driver.cuMemRelease);
    load("cuMemAddressReserve", driver.cuMemAddressReserve);
    load("cuMemAddressFree", driver.cuMemAddressFree);
    load("cuMemMap", driver.cuMemMap);
    load("cuMemUnmap", driver.cuMemUnmap);
    load("cuMemSetAccess", driver.cuMemSetAccess);
    load("cuMemGetAccess", driver.cuMemGetAccess);
    load("cuMemExportToShareableHandle", driver.cuMemExportToShareableHandle);
    load("cuMemImportFromShareableHandle", driver.cuMemImportFromShareableHandle);
    load("cuMemcpyHtoD", driver.cuMemcpyHtoD);
    load("cuMemcpyDtoH", driver.cuMemcpyDtoH);
    load("cuMemcpyDtoDAsync", driver.cuMemcpyDtoDAsync);
    load("cuMemsetD8", driver.cuMemsetD8);
    load("cuMemAllocHost", driver.cuMemAllocHost);
    load("cuMemFreeHost", driver.cuMemFreeHost);
    load("cuMemHostRegister", driver.cuMemHostRegister);
    load("cuMemHostUnregister", driver.cuMemHostUnregister);
    load("cuMemcpyHtoDAsync", driver.cuMemcpyHtoDAsync);
    load("cuStreamCreate", driver.cuStreamCreate);
    load("cuStreamDestroy", driver.cuStreamDestroy);
    load("cuStreamSynchronize", driver.cuStreamSynchronize);
    load("cuEventCreate", driver.cuEventCreate);
    load("cuEventRecord", driver.cuEventRecord);
    load("cuEventSynchronize", driver.cuEventSynchronize);
    load("cuEventDestroy", driver.cuEventDestroy);
    if (!failure.empty()) return;
    load("cuModuleLoadData", driver.cuModuleLoadData, /*required=*/false);
    load("cuModuleUnload", driver.cuModuleUnload, /*required=*/false);
    load("cuModuleGetFunction", driver.cuModuleGetFunction, /*required=*/false);
    load("cuLaunchKernel", driver.cuLaunchKernel, /*required=*/false);
    if (CUresult r = driver.cuInit(0); r == CUDA_ERROR_NO_DEVICE) {
      failure = "no CUDA device: " + driver.Describe(r);
    } else if (r != CUDA_SUCCESS) {
      failure = "the CUDA driver did not start: " + driver.Describe(r);
    }
  });
  if (!failure.empty()) return Error(failure);
  return &driver;
}

// What a segment's allocation asks for: pinned device memory on `dev`,
// exportable as a POSIX file descriptor.
CUmemAllocationProp SegmentProp(CUdevice dev) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = dev;
  return prop;
}

}  // namespace

namespace {

// Why `dev` cannot hold segments, or "" when it can (and then the
// granularity of what a segment asks for). The driver's own error is kept:
// on a GPU machine it is the first thing to know.
std::string WhyNotServed(const Driver& d, CUdevice dev, uint64_t* granularity) {
  int vmm = 0, fd = 0;
  if (CUresult r = d.cuDeviceGetAttribute(
          &vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev);
      r != CUDA_SUCCESS) {
    return "cannot ask whether it supports virtual memory management: " + d.Describe(r);
  }
  if (vmm == 0) return "it does not support virtual memory management (cuMemCreate)";
  if (CUresult r = d.cuDeviceGetAttribute(
          &fd, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, dev);
      r != CUDA_SUCCESS) {
    return "cannot ask whether it exports memory as file descriptors: " + d.Describe(r);
  }
  if (fd == 0) return "it cannot export memory as file descriptors";
  const CUmemAllocationProp prop = SegmentProp(dev);
  size_t g = 0;
  if (CUresult r = d.cuMemGetAllocationGranularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
      r != CUDA_SUCCESS) {
    return "cuMemGetAllocationGranularity: " + d.Describe(r);
  }
  if (g == 0) return "the driver gives no allocation granularity";
  *granularity = g;
  return "";
}

Result<std::vector<CudaDevice>> AskForCudaDevices() {
  WEIGHTD_ASSIGN_OR_RETURN(const Driver* d, LoadDriver());
  int count = 0;
  if (CUresult r = d->cuDeviceGetCount(&count); r != CUDA_SUCCESS) {
    return Error("no CUDA device: " + d->Describe(r));
  }
  if (count == 0) return Error("no CUDA device (the driver sees none)");
  std::vector<CudaDevice> out;
  for (int i = 0; i < count; ++i) {
    CUdevice dev;
    if (CUresult r = d->cuDeviceGet(&dev, i); r != CUDA_SUCCESS) {
      return Error("cuda:" + std::to_string(i) + ": " + d->Describe(r));
    }
    CudaDevice info;
    info.ordinal = i;
    CUuuid uuid{};
    char name[256] = {};
    size_t total = 0;
    if (d->cuDeviceGetUuid(&uuid, dev) != CUDA_SUCCESS ||
        d->cuDeviceGetName(name, sizeof name - 1, dev) != CUDA_SUCCESS ||
        d->cuDeviceTotalMem(&total, dev) != CUDA_SUCCESS) {
      return Error("cuda:" + std::to_string(i) + ": cannot read its UUID, name or memory");
    }
    std::array<uint8_t, 16> bytes{};
    for (size_t k = 0; k < 16; ++k) bytes[k] = static_cast<uint8_t>(uuid.bytes[k]);
    info.uuid = FormatGpuUuid(bytes);
    info.name = name;
    info.total_bytes = total;
    info.not_served = WhyNotServed(*d, dev, &info.granularity);
    out.push_back(std::move(info));
  }
  return out;
}

}  // namespace

// The driver fixes what a process sees at cuInit (CUDA_VISIBLE_DEVICES
// included): asked once, not at every segment made or mapped.
Result<std::vector<CudaDevice>> ListCudaDevices() {
  static const Result<std::vector<CudaDevice>> devices = AskForCudaDevices();
  return devices;
}

namespace {

Error CudaError(const Driver& d, const char* call, CUresult r) {
  return Error(std::string(call) + ": " + d.Describe(r));
}

// The GPU's primary context current on this thread while this lives, and
// whatever was current before it again afterwards: an engine's own context
// (or device) is left as it was.
class ContextScope {
 public:
  ContextScope(const Driver& d, bool pushed) : d_(&d), pushed_(pushed) {}
  ContextScope(ContextScope&& o) noexcept : d_(o.d_), pushed_(std::exchange(o.pushed_, false)) {}
  ContextScope(const ContextScope&) = delete;
  ContextScope& operator=(const ContextScope&) = delete;
  ~ContextScope() {
    CUcontext popped = nullptr;
    if (pushed_) d_->cuCtxPopCurrent(&popped);
  }

 private:
  const Driver* d_;
  bool pushed_;
};

// One GPU, found by UUID, with its primary context retained for as long as
// this lives; Enter() makes the context current on the calling thread for a
// scope (the loader writes from many threads).
class GpuContext {
 public:
  static Result<std::unique_ptr<GpuContext>> Open(const std::string& uuid) {
    WEIGHTD_ASSIGN_OR_RETURN(const Driver* d, LoadDriver());
    WEIGHTD_ASSIGN_OR_RETURN(std::vector<CudaDevice> devices, ListCudaDevices());
    // By the 32 hex digits: a MIG instance's UUID is listed with GPU- too.
    for (const CudaDevice& info : devices) {
      if (!SameGpu(info.uuid, uuid)) continue;
      if (!info.served()) return Error("cuda:" + uuid + ": " + info.not_served);
      auto g = std::unique_ptr<GpuContext>(new GpuContext(*d, info.granularity));
      if (CUresult r = d->cuDeviceGet(&g->dev_, info.ordinal); r != CUDA_SUCCESS) {
        return CudaError(*d, "cuDeviceGet", r);
      }
      if (CUresult r = d->cuDevicePrimaryCtxRetain(&g->ctx_, g->dev_); r != CUDA_SUCCESS) {
        return CudaError(*d, "cuDevicePrimaryCtxRetain", r);
      }
      g->retained_ = true;
      return g;
    }
    return Error("cuda:" + uuid + ": no such GPU in this process (CUDA_VISIBLE_DEVICES applies)");
  }
  GpuContext(const GpuContext&) = delete;
  GpuContext& operator=(const GpuContext&) = delete;
  ~GpuContext() {
    if (retained_) d_.cuDevicePrimaryCtxRelease(dev_);
  }

  Result<ContextScope> Enter() const {
    if (CUresult r = d_.cuCtxPushCurrent(ctx_); r != CUDA_SUCCESS) {
      return CudaError(d_, "cuCtxPushCurrent", r);
    }
    return ContextScope(d_, true);
  }
  const Driver& driver() const { return d_; }
  CUdevice device() const { return dev_; }
  uint64_t granularity() const { return granularity_; }

 private:
  GpuContext(const Driver& d, uint64_t granularity) : d_(d), granularity_(granularity) {}
  const Driver& d_;
  uint64_t granularity_;
  CUdevice dev_ = 0;
  CUcontext ctx_ = nullptr;
  bool retained_ = false;
};

// An allocation mapped at an address of this process, released in reverse
// order of what was done, whatever failed.
struct VmmMapping {
  std::unique_ptr<GpuContext> gpu;
  uint64_t bytes = 0;  // the allocation's, a multiple of the granularity
  CUmemGenericAllocationHandle handle = 0;
  bool have_handle = false;
  CUdeviceptr address = 0;
  bool mapped = false;

  ~VmmMapping() {
    if (!gpu) return;
    const Driver& d = gpu->driver();
    const auto scope = gpu->Enter();
    if (mapped) d.cuMemUnmap(address, bytes);
    if (address != 0) d.cuMemAddressFree(address, bytes);
    if (have_handle) d.cuMemRelease(handle);
  }

  // Reserves an address range, maps the handle there and sets `flags`.
  CUresult Map(CUmemAccess_flags flags) {
    const Driver& d = gpu->driver();
    CUdeviceptr reserved = 0;
    if (CUresult r = d.cuMemAddressReserve(&reserved, bytes, 0, 0, 0); r != CUDA_SUCCESS) return r;
    address = reserved;
    if (CUresult r = d.cuMemMap(address, bytes, 0, handle, 0); r != CUDA_SUCCESS) return r;
    mapped = true;
    return SetAccess(flags);
  }
  CUresult SetAccess(CUmemAccess_flags flags) {
    CUmemAccessDesc desc{};
    desc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    desc.location.id = gpu->device();
    desc.flags = flags;
    return gpu->driver().cuMemSetAccess(address, bytes, &desc, 1);
  }
  // Copies [offset, +out.size()) of a segment of `size` bytes to the host.
  Status ReadBack(uint64_t offset, std::span<std::byte> out, uint64_t size) const {
    WEIGHTD_RETURN_IF_ERROR(InRange(offset, out.size(), size));
    WEIGHTD_ASSIGN_OR_RETURN(const ContextScope scope, gpu->Enter());
    if (CUresult r = gpu->driver().cuMemcpyDtoH(out.data(), address + offset, out.size());
        r != CUDA_SUCCESS) {
      return CudaError(gpu->driver(), "cuMemcpyDtoH", r);
    }
    return OkStatus();
  }
  Status InRange(uint64_t offset, uint64_t n, uint64_t size) const {
    if (offset > size || n > size - offset) {
      return Error("bytes [" + std::to_string(offset) + ", +" + std::to_string(n) +
                   ") pass the segment's end (" + std::to_string(size) + ")");
    }
    return OkStatus();
  }
};

// Host-to-device copies of a segment being filled go through pinned staging
// buffers, each with its own stream: a writer copies its pieces into a free
// buffer, queues the copy and goes back to reading while the GPU copies. A
// buffer is reused once its last copy is done (its event), so with more
// buffers than writers reading and copying overlap (double buffering).
// The buffers are pinned host memory: made at the first write, freed at Seal.
class Staging {
 public:
  static constexpr size_t kBuffers = 16;
  static constexpr size_t kBufferBytes = 4 << 20;

  explicit Staging(const GpuContext& gpu) : gpu_(gpu) {}
  Staging(const Staging&) = delete;
  Staging& operator=(const Staging&) = delete;
  ~Staging() { (void)Drain(/*free=*/true); }

  // Copies `pieces` to `address` on the GPU, at most kBufferBytes a copy.
  // The copies may still run when this returns; Drain waits for them.
  // REQUIRES: the GPU's context current on this thread.
  Status Copy(CUdeviceptr address, std::span<const std::span<const std::byte>> pieces) {
    const Driver& d = gpu_.driver();
    size_t piece = 0, within = 0;
    while (piece < pieces.size()) {
      WEIGHTD_ASSIGN_OR_RETURN(Buffer * b, Take());
      size_t filled = 0;
      while (piece < pieces.size() && filled < kBufferBytes) {
        const std::span<const std::byte> p = pieces[piece];
        const size_t n = std::min(kBufferBytes - filled, p.size() - within);
        std::memcpy(static_cast<std::byte*>(b->host) + filled, p.data() + within, n);
        filled += n;
        within += n;
        if (within == p.size()) {
          ++piece;
          within = 0;
        }
      }
      CUresult r =
          filled == 0 ? CUDA_SUCCESS : d.cuMemcpyHtoDAsync(address, b->host, filled, b->stream);
      if (r == CUDA_SUCCESS && filled > 0) {
        if (CUresult e = d.cuEventRecord(b->done, b->stream); e != CUDA_SUCCESS) {
          // No event to wait on: the copy must end before the buffer is reused.
          d.cuStreamSynchronize(b->stream);
          r = e;
        } else {
          b->queued = true;
        }
      }
      Give(b);
      if (r != CUDA_SUCCESS) return CudaError(d, "a host-to-device copy", r);
      address += filled;
    }
    return OkStatus();
  }

  // Waits for every queued copy; the first error any of them met. With
  // `free`, the buffers and streams go too.
  // REQUIRES: no Copy running; the GPU's context current.
  Status Drain(bool free) {
    const Driver& d = gpu_.driver();
    std::optional<Error> error;
    for (Buffer& b : buffers_) {
      if (b.queued) {
        if (CUresult r = d.cuEventSynchronize(b.done); r != CUDA_SUCCESS && !error) {
          error = CudaError(d, "a host-to-device copy", r);
        }
        b.queued = false;
      }
      if (!free) continue;
      if (b.done != nullptr) d.cuEventDestroy(b.done);
      if (b.stream != nullptr) d.cuStreamDestroy(b.stream);
      if (b.host != nullptr) d.cuMemFreeHost(b.host);
    }
    if (free) {
      buffers_.clear();
      idle_.clear();
    }
    if (error) return *error;
    return OkStatus();
  }

 private:
  struct Buffer {
    void* host = nullptr;
    CUstream stream = nullptr;
    CUevent done = nullptr;
    bool queued = false;  // a copy from `host` may still run
  };

  // A buffer no other writer holds, its last copy finished: the one given
  // back longest ago, whose copy is the likeliest to be done.
  Result<Buffer*> Take() {
    Buffer* b = nullptr;
    {
      std::unique_lock lock(mu_);
      if (buffers_.empty()) WEIGHTD_RETURN_IF_ERROR(MakeBuffersLocked());
      free_.wait(lock, [&] { return !idle_.empty(); });
      b = idle_.front();
      idle_.pop_front();
    }
    if (b->queued) {
      b->queued = false;
      if (CUresult r = gpu_.driver().cuEventSynchronize(b->done); r != CUDA_SUCCESS) {
        Give(b);
        return CudaError(gpu_.driver(), "a host-to-device copy", r);
      }
    }
    return b;
  }
  void Give(Buffer* b) {
    {
      std::lock_guard lock(mu_);
      idle_.push_back(b);
    }
    free_.notify_one();
  }
  // REQUIRES: mu_ held.
  Status MakeBuffersLocked() {
    const Driver& d = gpu_.driver();
    buffers_.resize(kBuffers);
    for (Buffer& b : buffers_) {
      CUresult r = d.cuMemAllocHost(&b.host, kBufferBytes);
      if (r == CUDA_SUCCESS) r = d.cuStreamCreate(&b.stream, CU_STREAM_NON_BLOCKING);
      if (r == CUDA_SUCCESS) r = d.cuEventCreate(&b.done, CU_EVENT_DISABLE_TIMING);
      if (r != CUDA_SUCCESS) {
        (void)Drain(/*free=*/true);
        return CudaError(d, "making pinned staging buffers", r);
      }
    }
    for (Buffer& b : buffers_) idle_.push_back(&b);
    return OkStatus();
  }

  const GpuContext& gpu_;
  std::mutex mu_;
  std::condition_variable free_;
  std::vector<Buffer> buffers_;  // made once; never resized while in use
  std::deque<Buffer*> idle_;     // oldest first
};

class CudaSegment final : public Segment {
 public:
  CudaSegment(std::unique_ptr<VmmMapping> m, uint64_t size, std::string uuid)
      : m_(std::move(m)), size_(size), uuid_(std::move(uuid)), staging_(*m_->gpu) {}
  ~CudaSegment() override {
    const auto scope = m_->gpu->Enter();
    (void)staging_.Drain(/*free=*/true);  // before the memory it copies into goes
  }

  Device device() const override { return {DeviceKind::kCuda, uuid_}; }
  uint64_t size() const override { return size_; }
  uint64_t reserved_bytes() const override { return m_->bytes; }
  bool huge_pages() const override { return false; }
  uint64_t device_address() const override { return m_->address; }

  Status Write(uint64_t offset, std::span<const std::span<const std::byte>> pieces) override {
    if (sealed_) return Error("segment written after it was sealed");
    uint64_t total = 0;
    for (const auto& p : pieces) total += p.size();
    WEIGHTD_RETURN_IF_ERROR(m_->InRange(offset, total, size_));
    WEIGHTD_ASSIGN_OR_RETURN(const ContextScope scope, m_->gpu->Enter());
    return staging_.Copy(m_->address + offset, pieces);
  }

  // Copies `host` to `offset` straight from where it is, registered as
  // pinned memory (read-only: a sealed mapping qualifies). Registering pins
  // every page and costs more than the copy (on an H200's host, 0.71 s for
  // 8 GiB of a memfd's pages in one call, against 0.16 s to copy them), so
  // the parts are registered by several threads at once, then copied on
  // several streams. All are registered before any is copied: a build
  // that registered and copied part by part on each thread was no faster
  // than one call, which suggests that a registration waits for the copies
  // in flight. A part the driver will not register goes through the
  // staging buffers. `staged_because` is empty when every part was
  // registered, else why the driver would not (and how many parts it would
  // not register, when it did some).
  Status WriteFromHost(uint64_t offset, std::span<const std::byte> host,
                       std::string* staged_because) {
    if (sealed_) return Error("segment written after it was sealed");
    WEIGHTD_RETURN_IF_ERROR(m_->InRange(offset, host.size(), size_));
    staged_because->clear();
    if (host.empty()) {
      *staged_because = "nothing to copy";
      return OkStatus();
    }
    // Entered before anything is registered: nothing can fail between the
    // registrations and their release below.
    WEIGHTD_ASSIGN_OR_RETURN(const ContextScope scope, m_->gpu->Enter());
    // Parts of 16 to 256 MiB in whole 2 MiB pages (no page is pinned by two
    // registrations), at least two per thread where the size allows.
    constexpr size_t kPage = 2 << 20;
    const size_t threads = std::clamp<size_t>(std::thread::hardware_concurrency() / 2, 2, 8);
    const size_t part =
        (std::clamp<size_t>(host.size() / (2 * threads), 16 << 20, 256 << 20) + kPage - 1) / kPage *
        kPage;
    const size_t parts = (host.size() + part - 1) / part;
    auto piece = [&](size_t i) {
      return host.subspan(i * part, std::min(part, host.size() - i * part));
    };
    const Driver& d = m_->gpu->driver();
    // 1. Register, several threads taking parts in turn. A thread that
    // cannot enter the context takes no part; the others take them all.
    std::vector<CUresult> registered(parts, CUDA_ERROR_INVALID_CONTEXT);
    std::atomic<size_t> next_part{0};
    auto register_parts = [&] {
      const auto own = m_->gpu->Enter();  // on the calling thread, pushed once more
      if (!own.ok()) return;
      while (true) {
        const size_t i = next_part++;
        if (i >= parts) return;
        registered[i] = d.cuMemHostRegister(const_cast<std::byte*>(piece(i).data()),
                                            piece(i).size(), CU_MEMHOSTREGISTER_READ_ONLY);
      }
    };
    std::vector<std::thread> helpers;
    helpers.reserve(threads);
    for (size_t t = 1; t < std::min(threads, parts); ++t) {
      try {
        helpers.emplace_back(register_parts);
      } catch (const std::system_error&) {
        break;  // no thread to be had: fewer register the parts
      }
    }
    register_parts();
    for (std::thread& t : helpers) t.join();
    // 2. Copy: the registered parts straight, on streams of their own; the
    // others staged.
    constexpr size_t kStreams = 4;
    CUstream streams[kStreams] = {};
    CUresult r = CUDA_SUCCESS;
    for (size_t i = 0; i < kStreams && r == CUDA_SUCCESS; ++i) {
      r = d.cuStreamCreate(&streams[i], CU_STREAM_NON_BLOCKING);
    }
    Status staged = OkStatus();
    size_t staged_parts = 0;
    for (size_t i = 0; i < parts && r == CUDA_SUCCESS && staged.ok(); ++i) {
      const std::span<const std::byte> p = piece(i);
      if (registered[i] == CUDA_SUCCESS) {
        r = d.cuMemcpyHtoDAsync(m_->address + offset + i * part, p.data(), p.size(),
                                streams[i % kStreams]);
        continue;
      }
      if (staged_parts++ == 0) *staged_because = "cuMemHostRegister: " + d.Describe(registered[i]);
      staged = staging_.Copy(m_->address + offset + i * part, std::span(&p, 1));
    }
    // 3. The pages stay pinned until the copies from them are done.
    CUresult sync = CUDA_SUCCESS;
    for (CUstream st : streams) {
      if (st == nullptr) continue;
      if (CUresult e = d.cuStreamSynchronize(st); e != CUDA_SUCCESS && sync == CUDA_SUCCESS) {
        sync = e;
      }
      d.cuStreamDestroy(st);
    }
    for (size_t i = 0; i < parts; ++i) {
      if (registered[i] == CUDA_SUCCESS)
        d.cuMemHostUnregister(const_cast<std::byte*>(piece(i).data()));
    }
    if (r != CUDA_SUCCESS) return CudaError(d, "cuMemcpyHtoDAsync", r);
    if (sync != CUDA_SUCCESS) return CudaError(d, "a host-to-device copy", sync);
    WEIGHTD_RETURN_IF_ERROR(staged);
    if (staged_parts > 0 && staged_parts < parts) {
      *staged_because = std::to_string(staged_parts) + " of " + std::to_string(parts) + " parts, " +
                        *staged_because;
    }
    return OkStatus();
  }

  // Copies device memory at `from` (on the same GPU) into the segment, on a
  // stream of its own: an engine's work in the same context is not waited for.
  Status WriteFromDevice(uint64_t offset, CUdeviceptr from, uint64_t bytes) {
    if (sealed_) return Error("segment written after it was sealed");
    WEIGHTD_RETURN_IF_ERROR(m_->InRange(offset, bytes, size_));
    WEIGHTD_ASSIGN_OR_RETURN(const ContextScope scope, m_->gpu->Enter());
    const Driver& d = m_->gpu->driver();
    CUstream stream = nullptr;
    CUresult r = d.cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING);
    if (r == CUDA_SUCCESS) r = d.cuMemcpyDtoDAsync(m_->address + offset, from, bytes, stream);
    if (stream != nullptr) {
      if (CUresult sync = d.cuStreamSynchronize(stream); r == CUDA_SUCCESS) r = sync;
      d.cuStreamDestroy(stream);
    }
    if (r != CUDA_SUCCESS) return CudaError(d, "a device-to-device copy", r);
    return OkStatus();
  }

  // Every copy into the segment ran on a stream of ours, synchronized by
  // the time it returned or drained here: nothing else in the context (an
  // engine's kernels) is waited for.
  Status Seal() override {
    if (sealed_) return OkStatus();
    WEIGHTD_ASSIGN_OR_RETURN(const ContextScope scope, m_->gpu->Enter());
    WEIGHTD_RETURN_IF_ERROR(staging_.Drain(/*free=*/true));
    sealed_ = true;
    return OkStatus();
  }
  bool readable_here() const override { return false; }
  std::span<const std::byte> readable() const override { return {}; }
  Status ReadBack(uint64_t offset, std::span<std::byte> out) const override {
    if (!sealed_) return Error("segment read before it was sealed");
    return m_->ReadBack(offset, out, size_);
  }

  Result<UniqueFd> Export() const override {
    if (!sealed_) return Error("segment exported before it was sealed");
    WEIGHTD_ASSIGN_OR_RETURN(const ContextScope scope, m_->gpu->Enter());
    int fd = -1;
    if (CUresult r = m_->gpu->driver().cuMemExportToShareableHandle(
            &fd, m_->handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
        r != CUDA_SUCCESS) {
      return CudaError(m_->gpu->driver(), "cuMemExportToShareableHandle", r);
    }
    return UniqueFd(fd);
  }

 private:
  std::unique_ptr<VmmMapping> m_;
  uint64_t size_;
  std::string uuid_;
  Staging staging_;
  bool sealed_ = false;
};

class ImportedMapping final : public CudaMapping {
 public:
  ImportedMapping(std::unique_ptr<VmmMapping> m, uint64_t size, std::string uuid, bool read_only)
      : m_(std::move(m)), size_(size), uuid_(std::move(uuid)), read_only_(read_only) {}
  uint64_t device_address() const override { return m_->address; }
  uint64_t size() const override { return size_; }
  bool read_only() const override { return read_only_; }
  Status ReadBack(uint64_t offset, std::span<std::byte> out) const override {
    return m_->ReadBack(offset, out, size_);
  }
  Result<std::unique_ptr<Segment>> Copy() const override;

 private:
  std::unique_ptr<VmmMapping> m_;
  uint64_t size_;
  std::string uuid_;
  bool read_only_;
};

}  // namespace

Result<std::unique_ptr<Segment>> CreateCudaSegment(uint64_t size, const std::string& uuid) {
  auto m = std::make_unique<VmmMapping>();
  WEIGHTD_ASSIGN_OR_RETURN(m->gpu, GpuContext::Open(uuid));
  WEIGHTD_ASSIGN_OR_RETURN(m->bytes, SegmentBytes(size, m->gpu->granularity()));
  WEIGHTD_ASSIGN_OR_RETURN(const ContextScope scope, m->gpu->Enter());
  const Driver& d = m->gpu->driver();
  const CUmemAllocationProp prop = SegmentProp(m->gpu->device());
  if (CUresult r = d.cuMemCreate(&m->handle, m->bytes, &prop, 0); r != CUDA_SUCCESS) {
    // What the GPU has left says whether engines (or a daemon before this
    // one, whose segments engines still map) hold what the budget allows.
    size_t free = 0, total = 0;
    const std::string left = d.cuMemGetInfo(&free, &total) == CUDA_SUCCESS
                                 ? " (the GPU has " + std::to_string(free >> 20) + " MiB free of " +
                                       std::to_string(total >> 20) + " MiB)"
                                 : "";
    return Error("cannot allocate " + std::to_string(m->bytes) + " bytes on cuda:" + uuid +
                 ": cuMemCreate: " + d.Describe(r) + left);
  }
  m->have_handle = true;
  if (CUresult r = m->Map(CU_MEM_ACCESS_FLAGS_PROT_READWRITE); r != CUDA_SUCCESS) {
    return CudaError(d, "mapping a new segment", r);
  }
  return std::unique_ptr<Segment>(new CudaSegment(std::move(m), size, uuid));
}

Result<std::unique_ptr<CudaMapping>> MapCudaSegment(const UniqueFd& fd, uint64_t size,
                                                    const std::string& uuid) {
  if (!fd.valid()) return Error("no descriptor to import a CUDA segment from");
  auto m = std::make_unique<VmmMapping>();
  WEIGHTD_ASSIGN_OR_RETURN(m->gpu, GpuContext::Open(uuid));
  WEIGHTD_ASSIGN_OR_RETURN(m->bytes, SegmentBytes(size, m->gpu->granularity()));
  WEIGHTD_ASSIGN_OR_RETURN(const ContextScope scope, m->gpu->Enter());
  const Driver& d = m->gpu->driver();
  if (CUresult r = d.cuMemImportFromShareableHandle(
          &m->handle, reinterpret_cast<void*>(static_cast<uintptr_t>(fd.get())),
          CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
      r != CUDA_SUCCESS) {
    return CudaError(d, "cuMemImportFromShareableHandle", r);
  }
  m->have_handle = true;
  // Read-only where the driver grants it; read-write (the caller warns)
  // where it refuses, or where it accepts the request but records another
  // access (what it recorded is what it would enforce, if anything).
  bool read_only = true;
  if (CUresult r = m->Map(CU_MEM_ACCESS_FLAGS_PROT_READ); r != CUDA_SUCCESS) {
    if (!m->mapped) return CudaError(d, "mapping an imported segment", r);
    read_only = false;
    if (CUresult rw = m->SetAccess(CU_MEM_ACCESS_FLAGS_PROT_READWRITE); rw != CUDA_SUCCESS) {
      return CudaError(d, "cuMemSetAccess", rw);
    }
  } else {
    CUmemLocation where{};
    where.type = CU_MEM_LOCATION_TYPE_DEVICE;
    where.id = m->gpu->device();
    unsigned long long recorded = 0;
    if (d.cuMemGetAccess(&recorded, &where, m->address) == CUDA_SUCCESS &&
        recorded != CU_MEM_ACCESS_FLAGS_PROT_READ) {
      read_only = false;
    }
  }
  return std::unique_ptr<CudaMapping>(new ImportedMapping(std::move(m), size, uuid, read_only));
}

Result<std::unique_ptr<Segment>> ImportedMapping::Copy() const {
  WEIGHTD_ASSIGN_OR_RETURN(std::unique_ptr<Segment> copy, CreateCudaSegment(size_, uuid_));
  auto& segment = static_cast<CudaSegment&>(*copy);
  WEIGHTD_RETURN_IF_ERROR(segment.WriteFromDevice(0, m_->address, size_));
  WEIGHTD_RETURN_IF_ERROR(segment.Seal());
  return copy;
}

// One thread flips the byte at its argument: a store into device memory
// by a kernel. PTX, compiled by the driver for whatever GPU it runs on.
constexpr char kFlipBytePtx[] = R"(.version 7.8
.target sm_52
.address_size 64
.visible .entry weightd_flip_byte(.param .u64 at)
{
  .reg .b16 %rs<3>;
  .reg .b64 %rd<3>;
  ld.param.u64 %rd1, [at];
  cvta.to.global.u64 %rd2, %rd1;
  ld.global.u8 %rs1, [%rd2];
  not.b16 %rs2, %rs1;
  st.global.u8 [%rd2], %rs2;
  ret;
}
)";

Result<WriteAttempt> TryWriteOnGpu(const std::string& uuid, uint64_t address, uint64_t bytes,
                                   const std::function<void()>& while_changed) {
  WEIGHTD_ASSIGN_OR_RETURN(std::unique_ptr<GpuContext> gpu, GpuContext::Open(uuid));
  WEIGHTD_ASSIGN_OR_RETURN(const ContextScope scope, gpu->Enter());
  const Driver& d = gpu->driver();
  std::vector<std::byte> before(static_cast<size_t>(bytes)), after(before.size());
  if (CUresult r = d.cuMemcpyDtoH(before.data(), address, before.size()); r != CUDA_SUCCESS) {
    return CudaError(d, "reading the bytes before", r);
  }
  WriteAttempt out;
  auto describe = [&](CUresult r) { return r == CUDA_SUCCESS ? "accepted" : d.Describe(r); };
  // A write's error may come from the call or only from the
  // synchronization; a fault is sticky: every later call returns it.
  auto usable = [&] { return d.cuCtxSynchronize() == CUDA_SUCCESS; };
  bool asked = false;
  // After a write: reads the bytes back, and puts them back if they moved.
  // False when this context can do no more.
  // Puts the bytes from before back: by a copy, unless the write was one a
  // copy may not undo (a kernel's store, where copies are refused).
  auto copy_back = [&] { return d.cuMemcpyHtoD(address, before.data(), before.size()); };
  auto check = [&](const std::function<CUresult()>& put_back) -> bool {
    if (CUresult r = d.cuMemcpyDtoH(after.data(), address, after.size()); r != CUDA_SUCCESS) {
      out.read_back = d.Describe(r);
      if (out.changed && out.restored.empty()) out.restored = "no (" + out.read_back + ")";
      return false;
    }
    out.read_back = "ok";
    if (after == before) return true;
    out.changed = true;
    if (while_changed && !asked) {
      asked = true;
      while_changed();
    }
    CUresult r = put_back();
    if (r == CUDA_SUCCESS) r = d.cuCtxSynchronize();
    if (r == CUDA_SUCCESS) r = d.cuMemcpyDtoH(after.data(), address, after.size());
    out.restored = r != CUDA_SUCCESS ? "no (" + d.Describe(r) + ")"
                   : after == before ? "yes"
                                     : "no (the bytes read back still differ)";
    return r == CUDA_SUCCESS && after == before;
  };
  std::vector<std::byte> flipped(before.size());
  for (size_t i = 0; i < before.size(); ++i) flipped[i] = ~before[i];
  CUresult r = d.cuMemcpyHtoD(address, flipped.data(), flipped.size());
  if (r == CUDA_SUCCESS) r = d.cuCtxSynchronize();
  out.copy = describe(r);
  if (r != CUDA_SUCCESS && !usable()) {
    out.memset = "not tried (the copy's error left the context unusable)";
    out.kernel = out.memset;
    check(copy_back);  // fails, and says why: the bytes cannot be known here
    return out;
  }
  if (!check(copy_back)) {
    out.memset = "not tried (the bytes the copy left could not be read back or put back)";
    out.kernel = out.memset;
    return out;
  }
  r = d.cuMemsetD8(address, 0xA5, before.size());
  if (r == CUDA_SUCCESS) r = d.cuCtxSynchronize();
  out.memset = describe(r);
  if (r != CUDA_SUCCESS && !usable()) {
    out.kernel = "not tried (the memset's error left the context unusable)";
    out.read_back = out.kernel;
    return out;
  }
  if (!check(copy_back)) {
    out.kernel = "not tried (the bytes the memset left could not be read back or put back)";
    return out;
  }
  // Last: a store by a kernel, as an engine's own kernel writing in place
  // would do it, past the driver's API checks. Its fault is sticky.
  if (d.cuModuleLoadData == nullptr || d.cuModuleGetFunction == nullptr ||
      d.cuLaunchKernel == nullptr || d.cuModuleUnload == nullptr) {
    out.kernel = "not tried (the driver has no module or launch entry points)";
    return out;
  }
  CUmodule module = nullptr;
  if (r = d.cuModuleLoadData(&module, kFlipBytePtx); r != CUDA_SUCCESS) {
    out.kernel = "not tried (loading its PTX: " + d.Describe(r) + ")";
    return out;
  }
  // What went wrong before the store ran is told apart from the store's
  // own answer, which only the synchronization gives.
  CUfunction flip = nullptr;
  CUdeviceptr at = address;
  void* params[] = {&at};
  auto launch = [&] {
    return d.cuLaunchKernel(flip, 1, 1, 1, 1, 1, 1, 0, nullptr, params, nullptr);
  };
  if (r = d.cuModuleGetFunction(&flip, module, "weightd_flip_byte"); r != CUDA_SUCCESS) {
    out.kernel = "not tried (cuModuleGetFunction: " + d.Describe(r) + ")";
  } else if (r = launch(); r != CUDA_SUCCESS) {
    out.kernel = "not tried (the launch was refused: " + d.Describe(r) + ")";
  } else {
    r = d.cuCtxSynchronize();
    out.kernel = describe(r);
    if (r != CUDA_SUCCESS && !usable()) {
      out.read_back = "not tried (the kernel's error left the context unusable)";
      d.cuModuleUnload(module);  // refused, likely: it goes with the context
      return out;
    }
    // A changed byte is put back by the same store (the flip undoes
    // itself): a driver that let the store through may refuse copies.
    check(launch);
  }
  d.cuModuleUnload(module);
  return out;
}

namespace {
class HeldContext final : public CudaContextHold {
 public:
  explicit HeldContext(std::unique_ptr<GpuContext> gpu) : gpu_(std::move(gpu)) {}

 private:
  std::unique_ptr<GpuContext> gpu_;
};
}  // namespace

Result<std::unique_ptr<CudaContextHold>> HoldCudaContext(const std::string& uuid) {
  WEIGHTD_ASSIGN_OR_RETURN(std::unique_ptr<GpuContext> gpu, GpuContext::Open(uuid));
  return std::unique_ptr<CudaContextHold>(new HeldContext(std::move(gpu)));
}

Result<std::unique_ptr<Segment>> CopyToCudaSegment(std::span<const std::byte> host,
                                                   const std::string& uuid,
                                                   std::string* staged_because) {
  WEIGHTD_ASSIGN_OR_RETURN(std::unique_ptr<Segment> copy, CreateCudaSegment(host.size(), uuid));
  auto& segment = static_cast<CudaSegment&>(*copy);
  std::string why;
  WEIGHTD_RETURN_IF_ERROR(segment.WriteFromHost(0, host, &why));
  WEIGHTD_RETURN_IF_ERROR(segment.Seal());
  if (staged_because != nullptr) *staged_because = std::move(why);
  return copy;
}

#else  // no CUDA 12 headers at build time

namespace {
Error BuiltWithoutCuda() {
  return Error("this weightd was built without the CUDA 12 (or newer) driver header");
}
}  // namespace

Result<std::vector<CudaDevice>> ListCudaDevices() { return BuiltWithoutCuda(); }

Result<std::unique_ptr<Segment>> CreateCudaSegment(uint64_t, const std::string&) {
  return BuiltWithoutCuda();
}

Result<std::unique_ptr<CudaMapping>> MapCudaSegment(const UniqueFd&, uint64_t, const std::string&) {
  return BuiltWithoutCuda();
}

Result<std::unique_ptr<Segment>> CopyToCudaSegment(std::span<const std::byte>, const std::string&,
                                                   std::string*) {
  return BuiltWithoutCuda();
}

Result<WriteAttempt> TryWriteOnGpu(const std::string&, uint64_t, uint64_t,
                                   const std::function<void()>&) {
  return BuiltWithoutCuda();
}

Result<std::unique_ptr<CudaContextHold>> HoldCudaContext(const std::string&) {
  return BuiltWithoutCuda();
}

#endif

}  // namespace weightd::memory
