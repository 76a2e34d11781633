#include "memory/cuda.h"

#include <dlfcn.h>

#include <charconv>
#include <cstdio>
#include <mutex>

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
    if (hex.size() != 36) return bad();
    for (size_t i = 0; i < hex.size(); ++i) {
      const bool dash = i == 8 || i == 13 || i == 18 || i == 23;
      const char c = hex[i];
      const bool is_hex = (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f');
      if (dash ? c != '-' : !is_hex) return bad();
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

Result<std::string> ResolveCudaOrdinal(int ordinal, const std::vector<CudaDevice>& visible) {
  for (const CudaDevice& d : visible) {
    if (d.ordinal == ordinal) return d.uuid;
  }
  return Error("cuda:" + std::to_string(ordinal) + ": this process sees " +
               std::to_string(visible.size()) + " CUDA device(s) (CUDA_VISIBLE_DEVICES applies)");
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
    auto load = [&](const char* name, auto& fn) {
      void* p = nullptr;
      CUdriverProcAddressQueryResult found{};
      if (get(name, &p, kApiVersion, CU_GET_PROC_ADDRESS_DEFAULT, &found) != CUDA_SUCCESS ||
          found != CU_GET_PROC_ADDRESS_SUCCESS || p == nullptr) {
        if (failure.empty()) failure = std::string("the CUDA driver has no ") + name;
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
    if (!failure.empty()) return;
    if (CUresult r = driver.cuInit(0); r != CUDA_SUCCESS) {
      failure = "the CUDA driver did not start: " + driver.Describe(r);
    }
  });
  if (!failure.empty()) return Error(failure);
  return &driver;
}

}  // namespace

Result<std::vector<CudaDevice>> ListCudaDevices() {
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
    int vmm = 0, fd = 0;
    d->cuDeviceGetAttribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev);
    d->cuDeviceGetAttribute(&fd, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
                            dev);
    info.posix_fd_handles = vmm != 0 && fd != 0;
    CUmemAllocationProp prop{};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = dev;
    size_t granularity = 0;
    if (info.posix_fd_handles &&
        d->cuMemGetAllocationGranularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM) ==
            CUDA_SUCCESS) {
      info.granularity = granularity;
    }
    out.push_back(std::move(info));
  }
  return out;
}

#else  // no CUDA 12 headers at build time

Result<std::vector<CudaDevice>> ListCudaDevices() {
  return Error("this weightd was built without the CUDA 12 (or newer) driver header");
}

#endif

}  // namespace weightd::memory
