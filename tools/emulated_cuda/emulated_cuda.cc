// An emulated CUDA driver: a libcuda.so.1 that keeps "device" memory in
// host memfds, so that weightd's CUDA paths (the segment, its export as a
// file descriptor, the import and read-only mapping in another process, the
// staged and registered copies, the daemon and engines on a GPU device)
// run, as real processes, on machines without a GPU: put its directory on
// LD_LIBRARY_PATH.
//
// It checks weightd's side of the driver's contract as the CUDA 12 driver
// API documents it: a current context for copies, streams and pinned
// memory; VMM sizes and addresses in whole granules; access set on mapped
// ranges only, for the device the memory is on; an exported allocation
// only if it asked for POSIX file descriptor handles; a device pointer is
// never host memory (its address range stays inaccessible to the host, the
// bytes live in a separate view). A call outside the contract fails as the
// driver documents it would, so a misuse shows up here.
//
// It says nothing about what a real driver does where the documentation is
// silent; above all whether an importer's read-only mapping is enforced.
// WEIGHTD_EMULATED_CUDA_READ_ONLY picks one of the answers so each path of
// weightd can be run: `enforce` (default, what an H200's driver did: a
// copy or memset into read-only memory is refused with
// CUDA_ERROR_INVALID_VALUE, the context intact, and a kernel's store
// faults), `fault` (the copy and memset fault too: CUDA_ERROR_ILLEGAL_ADDRESS,
// sticky for the process), `calls-only` (copies and memsets are refused,
// a kernel's store goes through), `refuse` (cuMemSetAccess will not grant
// read-only), `ignore`
// (the write goes through) or `record-readwrite` (read-only is accepted
// but read-write recorded, as cuMemGetAccess tells, and granted). Also:
// WEIGHTD_EMULATED_CUDA_DEVICES (default 1), WEIGHTD_EMULATED_CUDA_MEMORY (per device, default 8G),
// WEIGHTD_EMULATED_CUDA_GRANULARITY (a power of two, default 2M),
// WEIGHTD_EMULATED_CUDA_HOST_REGISTER=refuse (cuMemHostRegister fails;
// refuse-first: only its first call),
// WEIGHTD_EMULATED_CUDA_FD_HANDLES=no (no POSIX file descriptor handles).
// CUDA_VISIBLE_DEVICES applies (ordinals or UUID prefixes).
#include <cuda.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

struct CUctx_st {
  int device = 0;  // visible ordinal
  int retained = 0;
};
struct CUstream_st {
  int device = 0;
};
struct CUmod_st {
  int device;
};
struct CUfunc_st {
  int device;
};
struct CUevent_st {
  int device = 0;
};

namespace {

constexpr int kMaxDevices = 8;
constexpr const char* kMemfdPrefix = "weightd-emulated-cuda-";

enum class ReadOnly { kEnforce, kFault, kCallsOnly, kRefuse, kIgnore, kRecordReadWrite };

std::string Env(const char* name) {
  const char* v = std::getenv(name);
  return v ? v : "";
}

uint64_t ParseBytes(const std::string& text, uint64_t fallback) {
  if (text.empty()) return fallback;
  char* end = nullptr;
  const uint64_t n = std::strtoull(text.c_str(), &end, 10);
  switch (end && *end ? *end : ' ') {
    case 'K':
      return n << 10;
    case 'M':
      return n << 20;
    case 'G':
      return n << 30;
    case 'T':
      return n << 40;
    default:
      return n;
  }
}

// A physical device's UUID bytes: e0 then its index, the rest fixed.
std::string UuidText(int physical) {
  char out[48];
  std::snprintf(out, sizeof out, "GPU-e0%02x0000-0000-4000-8000-000000000000", physical);
  return out;
}

struct Allocation {
  int fd = -1;
  uint64_t bytes = 0;
  int physical = 0;
  bool exportable = false;
  bool owned = false;  // made here (counts in this process's cuMemGetInfo)
  ~Allocation();
};

struct Mapping {
  uint64_t bytes = 0;
  std::shared_ptr<Allocation> allocation;
  std::byte* view = nullptr;  // the bytes, mapped elsewhere in the host
  CUmemAccess_flags access = CU_MEM_ACCESS_FLAGS_PROT_NONE;
};

struct State {
  std::mutex mu;
  bool initialized = false;
  int physical_count = 1;
  uint64_t memory = 8ull << 30;
  uint64_t granularity = 2ull << 20;
  ReadOnly read_only = ReadOnly::kEnforce;
  bool refuse_host_register = false;
  bool refuse_first_host_register = false;
  bool fd_handles = true;
  std::vector<int> visible;  // ordinal -> physical
  CUctx_st contexts[kMaxDevices];
  std::map<CUmemGenericAllocationHandle, std::shared_ptr<Allocation>> handles;
  CUmemGenericAllocationHandle next_handle = 1;
  std::map<uint64_t, uint64_t> reservations;  // address -> bytes
  std::map<uint64_t, Mapping> mappings;       // address -> mapping
  std::map<uintptr_t, uint64_t> pinned;       // cuMemAllocHost: address -> bytes
  std::map<uintptr_t, uint64_t> registered;   // cuMemHostRegister: address -> bytes
  CUresult sticky = CUDA_SUCCESS;             // a fault poisons the process
};

State& S() {
  static State* s = new State;  // never destroyed: engines may call at exit
  return *s;
}

std::atomic<uint64_t> g_used[kMaxDevices];

Allocation::~Allocation() {
  if (owned) g_used[physical] -= bytes;
  if (fd >= 0) ::close(fd);
}

thread_local std::vector<CUctx_st*> t_stack;

// REQUIRES: S().mu held.
CUresult NeedContext(int* device = nullptr) {
  State& s = S();
  if (!s.initialized) return CUDA_ERROR_NOT_INITIALIZED;
  if (t_stack.empty() || t_stack.back() == nullptr) return CUDA_ERROR_INVALID_CONTEXT;
  if (t_stack.back()->retained <= 0) return CUDA_ERROR_CONTEXT_IS_DESTROYED;
  if (s.sticky != CUDA_SUCCESS) return s.sticky;
  if (device) *device = t_stack.back()->device;
  return CUDA_SUCCESS;
}

// Frees a handle this driver made (a module, a stream, an event).
template <class Handle>
CUresult DestroyHandle(Handle* handle) {
  std::lock_guard lock(S().mu);
  if (handle == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  delete handle;
  return CUDA_SUCCESS;
}

bool ValidDevice(int ordinal) {
  return ordinal >= 0 && static_cast<size_t>(ordinal) < S().visible.size();
}

// The host view of [ptr, ptr + n) of device memory: one mapping, with the
// access asked for, from the current context's device (access is granted
// per device; none here has peer access). A fault is sticky, as on a GPU;
// a write refused by the call (read-only memory, `enforce`) is not. A
// kernel's store (`by_kernel`) into read-only memory faults, as it did on
// the H200, unless the READ_ONLY answer lets it through.
// REQUIRES: S().mu held, a current context.
CUresult Resolve(CUdeviceptr ptr, size_t n, bool write, std::byte** out, bool by_kernel = false) {
  State& s = S();
  const int device = t_stack.back()->device;
  auto it = s.mappings.upper_bound(ptr);
  if (it == s.mappings.begin()) return CUDA_ERROR_INVALID_VALUE;
  --it;
  const uint64_t offset = ptr - it->first;
  if (offset >= it->second.bytes || n > it->second.bytes - offset) return CUDA_ERROR_INVALID_VALUE;
  if (s.visible[static_cast<size_t>(device)] != it->second.allocation->physical) {
    return CUDA_ERROR_INVALID_VALUE;  // another GPU's memory, from this GPU's context
  }
  const CUmemAccess_flags access = it->second.access;
  if (access == CU_MEM_ACCESS_FLAGS_PROT_NONE) {
    s.sticky = CUDA_ERROR_ILLEGAL_ADDRESS;
    return s.sticky;
  }
  const bool goes_through =
      s.read_only == ReadOnly::kIgnore || (by_kernel && s.read_only == ReadOnly::kCallsOnly);
  if (write && access != CU_MEM_ACCESS_FLAGS_PROT_READWRITE && !goes_through) {
    if (!by_kernel && s.read_only != ReadOnly::kFault) return CUDA_ERROR_INVALID_VALUE;
    s.sticky = CUDA_ERROR_ILLEGAL_ADDRESS;
    return s.sticky;
  }
  *out = it->second.view + offset;
  return CUDA_SUCCESS;
}

// Whether [p, p + n) of this process's memory is mapped writable, from
// /proc/self/maps (a registration pins pages, which read-only memory
// allows only with CU_MEMHOSTREGISTER_READ_ONLY).
bool HostWritable(uintptr_t p, uint64_t n) {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  uintptr_t at = p;
  const uintptr_t end = p + n;
  while (at < end && std::getline(maps, line)) {
    unsigned long lo = 0, hi = 0;
    char perms[8] = {};
    if (std::sscanf(line.c_str(), "%lx-%lx %7s", &lo, &hi, perms) != 3) continue;
    if (hi <= at || lo > at) continue;
    if (perms[1] != 'w') return false;
    at = hi;
  }
  return at >= end;
}

// ---- initialization and devices ----

CUresult Init(unsigned int flags) {
  State& s = S();
  std::lock_guard lock(s.mu);
  if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
  if (s.initialized) return CUDA_SUCCESS;
  const std::string count = Env("WEIGHTD_EMULATED_CUDA_DEVICES");
  s.physical_count = count.empty() ? 1 : std::atoi(count.c_str());
  if (s.physical_count < 0 || s.physical_count > kMaxDevices) return CUDA_ERROR_INVALID_VALUE;
  s.memory = ParseBytes(Env("WEIGHTD_EMULATED_CUDA_MEMORY"), 8ull << 30);
  s.granularity = ParseBytes(Env("WEIGHTD_EMULATED_CUDA_GRANULARITY"), 2ull << 20);
  if (s.granularity < 4096 || (s.granularity & (s.granularity - 1)) != 0) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  const std::string ro = Env("WEIGHTD_EMULATED_CUDA_READ_ONLY");
  s.read_only = ro == "fault"              ? ReadOnly::kFault
                : ro == "calls-only"       ? ReadOnly::kCallsOnly
                : ro == "refuse"           ? ReadOnly::kRefuse
                : ro == "ignore"           ? ReadOnly::kIgnore
                : ro == "record-readwrite" ? ReadOnly::kRecordReadWrite
                                           : ReadOnly::kEnforce;
  s.refuse_host_register = Env("WEIGHTD_EMULATED_CUDA_HOST_REGISTER") == "refuse";
  s.refuse_first_host_register = Env("WEIGHTD_EMULATED_CUDA_HOST_REGISTER") == "refuse-first";
  s.fd_handles = Env("WEIGHTD_EMULATED_CUDA_FD_HANDLES") != "no";
  // CUDA_VISIBLE_DEVICES: ordinals or UUID prefixes, up to the first that
  // names no device.
  if (const char* v = std::getenv("CUDA_VISIBLE_DEVICES"); v != nullptr) {
    std::string list = v;
    size_t start = 0;
    while (start <= list.size()) {
      const size_t comma = std::min(list.find(',', start), list.size());
      const std::string item = list.substr(start, comma - start);
      start = comma + 1;
      int found = -1;
      if (!item.empty() && item.find_first_not_of("0123456789") == std::string::npos) {
        found = std::atoi(item.c_str());
        if (found >= s.physical_count) found = -1;
      } else if (item.size() > 4) {
        for (int p = 0; p < s.physical_count; ++p) {
          if (UuidText(p).rfind(item, 0) == 0) found = p;
        }
      }
      if (found < 0) break;
      s.visible.push_back(found);
    }
  } else {
    for (int p = 0; p < s.physical_count; ++p) s.visible.push_back(p);
  }
  if (s.visible.empty()) return CUDA_ERROR_NO_DEVICE;
  for (size_t i = 0; i < s.visible.size(); ++i) s.contexts[i].device = static_cast<int>(i);
  s.initialized = true;
  return CUDA_SUCCESS;
}

CUresult GetErrorString(CUresult r, const char** out) {
  if (out == nullptr) return CUDA_ERROR_INVALID_VALUE;
  switch (r) {
    case CUDA_SUCCESS:
      *out = "no error";
      break;
    case CUDA_ERROR_INVALID_VALUE:
      *out = "invalid argument";
      break;
    case CUDA_ERROR_OUT_OF_MEMORY:
      *out = "out of memory";
      break;
    case CUDA_ERROR_NOT_INITIALIZED:
      *out = "initialization error";
      break;
    case CUDA_ERROR_NO_DEVICE:
      *out = "no CUDA-capable device is detected";
      break;
    case CUDA_ERROR_INVALID_DEVICE:
      *out = "invalid device ordinal";
      break;
    case CUDA_ERROR_INVALID_CONTEXT:
      *out = "invalid device context";
      break;
    case CUDA_ERROR_CONTEXT_IS_DESTROYED:
      *out = "context is destroyed";
      break;
    case CUDA_ERROR_ILLEGAL_ADDRESS:
      *out = "an illegal memory access was encountered";
      break;
    case CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED:
      *out = "part or all of the requested memory range is already mapped";
      break;
    case CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED:
      *out = "pointer does not correspond to a registered memory region";
      break;
    case CUDA_ERROR_NOT_SUPPORTED:
      *out = "operation not supported";
      break;
    case CUDA_ERROR_NOT_FOUND:
      *out = "named symbol not found";
      break;
    default:
      *out = nullptr;
      return CUDA_ERROR_INVALID_VALUE;
  }
  return CUDA_SUCCESS;
}

CUresult DriverGetVersion(int* v) {
  if (v == nullptr) return CUDA_ERROR_INVALID_VALUE;
  *v = CUDA_VERSION;
  return CUDA_SUCCESS;
}

CUresult DeviceGetCount(int* n) {
  State& s = S();
  std::lock_guard lock(s.mu);
  if (!s.initialized) return CUDA_ERROR_NOT_INITIALIZED;
  if (n == nullptr) return CUDA_ERROR_INVALID_VALUE;
  *n = static_cast<int>(s.visible.size());
  return CUDA_SUCCESS;
}

CUresult DeviceGet(CUdevice* dev, int ordinal) {
  State& s = S();
  std::lock_guard lock(s.mu);
  if (!s.initialized) return CUDA_ERROR_NOT_INITIALIZED;
  if (dev == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!ValidDevice(ordinal)) return CUDA_ERROR_INVALID_DEVICE;
  *dev = ordinal;
  return CUDA_SUCCESS;
}

CUresult DeviceGetName(char* name, int len, CUdevice dev) {
  std::lock_guard lock(S().mu);
  if (!S().initialized) return CUDA_ERROR_NOT_INITIALIZED;
  if (!ValidDevice(dev)) return CUDA_ERROR_INVALID_DEVICE;
  if (name == nullptr || len <= 0) return CUDA_ERROR_INVALID_VALUE;
  std::snprintf(name, static_cast<size_t>(len), "weightd emulated GPU %d (host memory)",
                S().visible[static_cast<size_t>(dev)]);
  return CUDA_SUCCESS;
}

CUresult DeviceGetUuid(CUuuid* uuid, CUdevice dev) {
  std::lock_guard lock(S().mu);
  if (!S().initialized) return CUDA_ERROR_NOT_INITIALIZED;
  if (!ValidDevice(dev)) return CUDA_ERROR_INVALID_DEVICE;
  if (uuid == nullptr) return CUDA_ERROR_INVALID_VALUE;
  std::memset(uuid->bytes, 0, sizeof uuid->bytes);
  uuid->bytes[0] = static_cast<char>(0xe0);
  uuid->bytes[1] = static_cast<char>(S().visible[static_cast<size_t>(dev)]);
  uuid->bytes[6] = 0x40;
  uuid->bytes[8] = static_cast<char>(0x80);
  return CUDA_SUCCESS;
}

CUresult DeviceTotalMem(size_t* bytes, CUdevice dev) {
  std::lock_guard lock(S().mu);
  if (!S().initialized) return CUDA_ERROR_NOT_INITIALIZED;
  if (!ValidDevice(dev)) return CUDA_ERROR_INVALID_DEVICE;
  if (bytes == nullptr) return CUDA_ERROR_INVALID_VALUE;
  *bytes = S().memory;
  return CUDA_SUCCESS;
}

CUresult DeviceGetAttribute(int* value, CUdevice_attribute attribute, CUdevice dev) {
  std::lock_guard lock(S().mu);
  if (!S().initialized) return CUDA_ERROR_NOT_INITIALIZED;
  if (!ValidDevice(dev)) return CUDA_ERROR_INVALID_DEVICE;
  if (value == nullptr) return CUDA_ERROR_INVALID_VALUE;
  switch (attribute) {
    case CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED:
    case CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING:
      *value = 1;
      break;
    case CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED:
      *value = S().fd_handles ? 1 : 0;
      break;
    case CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED:
      *value = S().refuse_host_register ? 0 : 1;
      break;
    default:
      *value = 0;
  }
  return CUDA_SUCCESS;
}

CUresult CheckProp(const CUmemAllocationProp* prop) {
  if (prop == nullptr || prop->type != CU_MEM_ALLOCATION_TYPE_PINNED ||
      prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  if (!ValidDevice(prop->location.id)) return CUDA_ERROR_INVALID_DEVICE;
  return CUDA_SUCCESS;
}

CUresult MemGetAllocationGranularity(size_t* granularity, const CUmemAllocationProp* prop,
                                     CUmemAllocationGranularity_flags) {
  std::lock_guard lock(S().mu);
  if (!S().initialized) return CUDA_ERROR_NOT_INITIALIZED;
  if (granularity == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (CUresult r = CheckProp(prop); r != CUDA_SUCCESS) return r;
  *granularity = S().granularity;
  return CUDA_SUCCESS;
}

// ---- contexts ----

CUresult DevicePrimaryCtxRetain(CUcontext* ctx, CUdevice dev) {
  std::lock_guard lock(S().mu);
  if (!S().initialized) return CUDA_ERROR_NOT_INITIALIZED;
  if (!ValidDevice(dev)) return CUDA_ERROR_INVALID_DEVICE;
  if (ctx == nullptr) return CUDA_ERROR_INVALID_VALUE;
  CUctx_st& c = S().contexts[dev];
  ++c.retained;
  *ctx = &c;
  return CUDA_SUCCESS;
}

CUresult DevicePrimaryCtxRelease(CUdevice dev) {
  std::lock_guard lock(S().mu);
  if (!S().initialized) return CUDA_ERROR_NOT_INITIALIZED;
  if (!ValidDevice(dev)) return CUDA_ERROR_INVALID_DEVICE;
  CUctx_st& c = S().contexts[dev];
  if (c.retained <= 0) return CUDA_ERROR_INVALID_CONTEXT;
  --c.retained;
  return CUDA_SUCCESS;
}

CUresult CtxPushCurrent(CUcontext ctx) {
  std::lock_guard lock(S().mu);
  if (!S().initialized) return CUDA_ERROR_NOT_INITIALIZED;
  if (ctx == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (ctx->retained <= 0) return CUDA_ERROR_CONTEXT_IS_DESTROYED;
  t_stack.push_back(ctx);
  return CUDA_SUCCESS;
}

CUresult CtxPopCurrent(CUcontext* ctx) {
  std::lock_guard lock(S().mu);
  if (!S().initialized) return CUDA_ERROR_NOT_INITIALIZED;
  if (t_stack.empty()) return CUDA_ERROR_INVALID_CONTEXT;
  if (ctx != nullptr) *ctx = t_stack.back();
  t_stack.pop_back();
  return CUDA_SUCCESS;
}

CUresult CtxSetCurrent(CUcontext ctx) {
  std::lock_guard lock(S().mu);
  if (!S().initialized) return CUDA_ERROR_NOT_INITIALIZED;
  if (t_stack.empty()) {
    if (ctx != nullptr) t_stack.push_back(ctx);
  } else if (ctx == nullptr) {
    t_stack.pop_back();
  } else {
    t_stack.back() = ctx;
  }
  return CUDA_SUCCESS;
}

CUresult CtxSynchronize() {
  std::lock_guard lock(S().mu);
  return NeedContext();
}

CUresult MemGetInfo(size_t* free, size_t* total) {
  std::lock_guard lock(S().mu);
  int dev = 0;
  if (CUresult r = NeedContext(&dev); r != CUDA_SUCCESS) return r;
  if (free == nullptr || total == nullptr) return CUDA_ERROR_INVALID_VALUE;
  const uint64_t used = g_used[S().visible[static_cast<size_t>(dev)]];
  *total = S().memory;
  *free = used < S().memory ? S().memory - used : 0;
  return CUDA_SUCCESS;
}

// ---- virtual memory management ----

CUresult MemCreate(CUmemGenericAllocationHandle* handle, size_t size,
                   const CUmemAllocationProp* prop, unsigned long long flags) {
  State& s = S();
  std::lock_guard lock(s.mu);
  if (!s.initialized) return CUDA_ERROR_NOT_INITIALIZED;
  if (handle == nullptr || flags != 0 || size == 0 || size % S().granularity != 0) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  if (CUresult r = CheckProp(prop); r != CUDA_SUCCESS) return r;
  if (!s.fd_handles && (prop->requestedHandleTypes & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)) {
    return CUDA_ERROR_NOT_SUPPORTED;
  }
  const int physical = s.visible[static_cast<size_t>(prop->location.id)];
  if (g_used[physical] + size > s.memory) return CUDA_ERROR_OUT_OF_MEMORY;
  const std::string name = kMemfdPrefix + std::to_string(physical);
  const int fd = ::memfd_create(name.c_str(), MFD_CLOEXEC);
  if (fd < 0) return CUDA_ERROR_OUT_OF_MEMORY;
  if (::ftruncate(fd, static_cast<off_t>(size)) != 0) {
    ::close(fd);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  auto a = std::make_shared<Allocation>();
  a->fd = fd;
  a->bytes = size;
  a->physical = physical;
  a->exportable = (prop->requestedHandleTypes & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) != 0;
  a->owned = true;
  g_used[physical] += size;
  *handle = s.next_handle++;
  s.handles[*handle] = std::move(a);
  return CUDA_SUCCESS;
}

CUresult MemRelease(CUmemGenericAllocationHandle handle) {
  std::lock_guard lock(S().mu);
  if (!S().initialized) return CUDA_ERROR_NOT_INITIALIZED;
  return S().handles.erase(handle) == 1 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUresult MemAddressReserve(CUdeviceptr* ptr, size_t size, size_t alignment, CUdeviceptr addr,
                           unsigned long long flags) {
  State& s = S();
  std::lock_guard lock(s.mu);
  if (!s.initialized) return CUDA_ERROR_NOT_INITIALIZED;
  if (ptr == nullptr || size == 0 || size % S().granularity != 0 || flags != 0 ||
      (alignment & (alignment - 1)) != 0) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  (void)addr;  // a hint
  const uint64_t align = std::max<uint64_t>(alignment, S().granularity);
  // Never host-accessible: a device pointer dereferenced on the host faults.
  void* base =
      ::mmap(nullptr, size + align, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (base == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
  const uint64_t start = (reinterpret_cast<uint64_t>(base) + align - 1) / align * align;
  const uint64_t head = start - reinterpret_cast<uint64_t>(base);
  if (head > 0) ::munmap(base, head);
  if (align - head > 0) ::munmap(reinterpret_cast<void*>(start + size), align - head);
  s.reservations[start] = size;
  *ptr = start;
  return CUDA_SUCCESS;
}

CUresult MemAddressFree(CUdeviceptr ptr, size_t size) {
  State& s = S();
  std::lock_guard lock(s.mu);
  if (!s.initialized) return CUDA_ERROR_NOT_INITIALIZED;
  auto it = s.reservations.find(ptr);
  if (it == s.reservations.end() || it->second != size) return CUDA_ERROR_INVALID_VALUE;
  auto m = s.mappings.lower_bound(ptr);
  if (m != s.mappings.end() && m->first < ptr + size) return CUDA_ERROR_INVALID_VALUE;  // mapped
  ::munmap(reinterpret_cast<void*>(ptr), size);
  s.reservations.erase(it);
  return CUDA_SUCCESS;
}

CUresult MemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                unsigned long long flags) {
  State& s = S();
  std::lock_guard lock(s.mu);
  if (!s.initialized) return CUDA_ERROR_NOT_INITIALIZED;
  auto h = s.handles.find(handle);
  if (h == s.handles.end() || flags != 0 || offset != 0 || size == 0 ||
      size % S().granularity != 0 || ptr % S().granularity != 0 || size > h->second->bytes) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  auto r = s.reservations.upper_bound(ptr);
  if (r == s.reservations.begin()) return CUDA_ERROR_INVALID_VALUE;
  --r;
  if (ptr + size > r->first + r->second) return CUDA_ERROR_INVALID_VALUE;  // past its range
  auto next = s.mappings.lower_bound(ptr);
  if (next != s.mappings.end() && next->first < ptr + size) return CUDA_ERROR_INVALID_VALUE;
  if (next != s.mappings.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second.bytes > ptr) return CUDA_ERROR_INVALID_VALUE;
  }
  void* view = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, h->second->fd, 0);
  if (view == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
  s.mappings[ptr] = {size, h->second, static_cast<std::byte*>(view), CU_MEM_ACCESS_FLAGS_PROT_NONE};
  return CUDA_SUCCESS;
}

CUresult MemUnmap(CUdeviceptr ptr, size_t size) {
  State& s = S();
  std::lock_guard lock(s.mu);
  if (!s.initialized) return CUDA_ERROR_NOT_INITIALIZED;
  auto it = s.mappings.find(ptr);
  if (it == s.mappings.end() || it->second.bytes != size) return CUDA_ERROR_INVALID_VALUE;
  ::munmap(it->second.view, size);
  s.mappings.erase(it);
  return CUDA_SUCCESS;
}

CUresult MemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc* desc, size_t count) {
  State& s = S();
  std::lock_guard lock(s.mu);
  if (!s.initialized) return CUDA_ERROR_NOT_INITIALIZED;
  if (desc == nullptr || count == 0) return CUDA_ERROR_INVALID_VALUE;
  // Whole mappings, one after another, covering the range exactly.
  std::vector<Mapping*> covered;
  for (uint64_t at = ptr; at < ptr + size;) {
    auto it = s.mappings.find(at);
    if (it == s.mappings.end()) return CUDA_ERROR_INVALID_VALUE;
    covered.push_back(&it->second);
    at += it->second.bytes;
    if (at > ptr + size) return CUDA_ERROR_INVALID_VALUE;
  }
  if (covered.empty()) return CUDA_ERROR_INVALID_VALUE;
  for (size_t i = 0; i < count; ++i) {
    const CUmemAccessDesc& d = desc[i];
    if (d.location.type != CU_MEM_LOCATION_TYPE_DEVICE) return CUDA_ERROR_INVALID_VALUE;
    if (!ValidDevice(d.location.id)) return CUDA_ERROR_INVALID_DEVICE;
    if (d.flags != CU_MEM_ACCESS_FLAGS_PROT_NONE && d.flags != CU_MEM_ACCESS_FLAGS_PROT_READ &&
        d.flags != CU_MEM_ACCESS_FLAGS_PROT_READWRITE) {
      return CUDA_ERROR_INVALID_VALUE;
    }
    if (d.flags == CU_MEM_ACCESS_FLAGS_PROT_READ && s.read_only == ReadOnly::kRefuse) {
      return CUDA_ERROR_NOT_SUPPORTED;
    }
    // No peer access here: only the device the memory is on.
    for (Mapping* m : covered) {
      if (s.visible[static_cast<size_t>(d.location.id)] != m->allocation->physical) {
        return CUDA_ERROR_INVALID_DEVICE;
      }
    }
  }
  CUmemAccess_flags access = desc[count - 1].flags;
  if (access == CU_MEM_ACCESS_FLAGS_PROT_READ && s.read_only == ReadOnly::kRecordReadWrite) {
    access = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  }
  for (Mapping* m : covered) m->access = access;
  return CUDA_SUCCESS;
}

CUresult MemGetAccess(unsigned long long* flags, const CUmemLocation* location, CUdeviceptr ptr) {
  State& s = S();
  std::lock_guard lock(s.mu);
  if (!s.initialized) return CUDA_ERROR_NOT_INITIALIZED;
  if (flags == nullptr || location == nullptr || location->type != CU_MEM_LOCATION_TYPE_DEVICE) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  if (!ValidDevice(location->id)) return CUDA_ERROR_INVALID_DEVICE;
  // The mapping `ptr` falls in: the last one starting at or before it.
  auto it = s.mappings.upper_bound(ptr);
  if (it == s.mappings.begin()) return CUDA_ERROR_INVALID_VALUE;
  --it;
  if (ptr >= it->first + it->second.bytes) return CUDA_ERROR_INVALID_VALUE;
  const bool same_device =
      s.visible[static_cast<size_t>(location->id)] == it->second.allocation->physical;
  *flags = same_device ? it->second.access : CU_MEM_ACCESS_FLAGS_PROT_NONE;
  return CUDA_SUCCESS;
}

CUresult MemExportToShareableHandle(void* out, CUmemGenericAllocationHandle handle,
                                    CUmemAllocationHandleType type, unsigned long long flags) {
  State& s = S();
  std::lock_guard lock(s.mu);
  if (!s.initialized) return CUDA_ERROR_NOT_INITIALIZED;
  auto h = s.handles.find(handle);
  if (h == s.handles.end() || out == nullptr || flags != 0 ||
      type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  if (!h->second->exportable) return CUDA_ERROR_NOT_PERMITTED;
  const int fd = ::fcntl(h->second->fd, F_DUPFD_CLOEXEC, 0);
  if (fd < 0) return CUDA_ERROR_OUT_OF_MEMORY;
  *static_cast<int*>(out) = fd;
  return CUDA_SUCCESS;
}

CUresult MemImportFromShareableHandle(CUmemGenericAllocationHandle* handle, void* os_handle,
                                      CUmemAllocationHandleType type) {
  State& s = S();
  std::lock_guard lock(s.mu);
  if (!s.initialized) return CUDA_ERROR_NOT_INITIALIZED;
  if (handle == nullptr || type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  const int fd = static_cast<int>(reinterpret_cast<intptr_t>(os_handle));
  // Only what an emulated driver exported: its memfd, by name.
  char link[256] = {};
  const std::string proc = "/proc/self/fd/" + std::to_string(fd);
  const ssize_t n = ::readlink(proc.c_str(), link, sizeof link - 1);
  const std::string prefix = std::string("/memfd:") + kMemfdPrefix;
  if (n <= 0 || std::string_view(link, static_cast<size_t>(n)).substr(0, prefix.size()) != prefix) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  const int physical = std::atoi(link + prefix.size());
  bool visible = false;
  for (int p : s.visible) visible |= p == physical;
  if (!visible) return CUDA_ERROR_INVALID_DEVICE;
  struct stat st {};
  if (::fstat(fd, &st) != 0) return CUDA_ERROR_INVALID_VALUE;
  auto a = std::make_shared<Allocation>();
  a->fd = ::fcntl(fd, F_DUPFD_CLOEXEC, 0);
  if (a->fd < 0) return CUDA_ERROR_OUT_OF_MEMORY;
  a->bytes = static_cast<uint64_t>(st.st_size);
  a->physical = physical;
  a->exportable = true;
  *handle = s.next_handle++;
  s.handles[*handle] = std::move(a);
  return CUDA_SUCCESS;
}

// ---- copies ----

CUresult MemcpyHtoD(CUdeviceptr dst, const void* src, size_t n) {
  std::lock_guard lock(S().mu);
  if (CUresult r = NeedContext(); r != CUDA_SUCCESS) return r;
  std::byte* to = nullptr;
  if (CUresult r = Resolve(dst, n, /*write=*/true, &to); r != CUDA_SUCCESS) return r;
  std::memcpy(to, src, n);
  return CUDA_SUCCESS;
}

CUresult MemcpyDtoH(void* dst, CUdeviceptr src, size_t n) {
  std::lock_guard lock(S().mu);
  if (CUresult r = NeedContext(); r != CUDA_SUCCESS) return r;
  std::byte* from = nullptr;
  if (CUresult r = Resolve(src, n, /*write=*/false, &from); r != CUDA_SUCCESS) return r;
  std::memcpy(dst, from, n);
  return CUDA_SUCCESS;
}

CUresult CheckStream(CUstream stream) {
  int dev = 0;
  if (CUresult r = NeedContext(&dev); r != CUDA_SUCCESS) return r;
  if (stream != nullptr && stream->device != dev) return CUDA_ERROR_INVALID_HANDLE;
  return CUDA_SUCCESS;
}

CUresult MemcpyDtoDAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream stream) {
  std::lock_guard lock(S().mu);
  if (CUresult r = CheckStream(stream); r != CUDA_SUCCESS) return r;
  std::byte *from = nullptr, *to = nullptr;
  if (CUresult r = Resolve(src, n, false, &from); r != CUDA_SUCCESS) return r;
  if (CUresult r = Resolve(dst, n, true, &to); r != CUDA_SUCCESS) return r;
  std::memmove(to, from, n);
  return CUDA_SUCCESS;
}

CUresult MemcpyHtoDAsync(CUdeviceptr dst, const void* src, size_t n, CUstream stream) {
  std::lock_guard lock(S().mu);
  if (CUresult r = CheckStream(stream); r != CUDA_SUCCESS) return r;
  std::byte* to = nullptr;
  if (CUresult r = Resolve(dst, n, true, &to); r != CUDA_SUCCESS) return r;
  std::memcpy(to, src, n);
  return CUDA_SUCCESS;
}

CUresult MemsetD8(CUdeviceptr dst, unsigned char value, size_t n) {
  std::lock_guard lock(S().mu);
  if (CUresult r = NeedContext(); r != CUDA_SUCCESS) return r;
  std::byte* to = nullptr;
  if (CUresult r = Resolve(dst, n, true, &to); r != CUDA_SUCCESS) return r;
  std::memset(to, value, n);
  return CUDA_SUCCESS;
}

// ---- kernels: one, the write probe's weightd_flip_byte ----

CUresult ModuleLoadData(CUmodule* module, const void* image) {
  std::lock_guard lock(S().mu);
  int dev = 0;
  if (CUresult r = NeedContext(&dev); r != CUDA_SUCCESS) return r;
  if (module == nullptr || image == nullptr) return CUDA_ERROR_INVALID_VALUE;
  // The emulator runs no code: it knows one kernel by name.
  if (std::strstr(static_cast<const char*>(image), ".entry weightd_flip_byte") == nullptr) {
    return CUDA_ERROR_INVALID_IMAGE;
  }
  *module = new CUmod_st{dev};
  return CUDA_SUCCESS;
}

CUresult ModuleUnload(CUmodule module) { return DestroyHandle(module); }

CUfunc_st flip_byte{0};

CUresult ModuleGetFunction(CUfunction* function, CUmodule module, const char* name) {
  std::lock_guard lock(S().mu);
  if (CUresult r = NeedContext(); r != CUDA_SUCCESS) return r;
  if (function == nullptr || module == nullptr || name == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (std::strcmp(name, "weightd_flip_byte") != 0) return CUDA_ERROR_NOT_FOUND;
  *function = &flip_byte;
  return CUDA_SUCCESS;
}

// weightd_flip_byte on one thread: the byte at its one argument, flipped.
// As on a GPU, a fault is not the launch's error but every later call's.
CUresult LaunchKernel(CUfunction function, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                      unsigned by, unsigned bz, unsigned shared, CUstream stream, void** params,
                      void** extra) {
  std::lock_guard lock(S().mu);
  if (CUresult r = NeedContext(); r != CUDA_SUCCESS) return r;
  if (stream != nullptr) {
    if (CUresult r = CheckStream(stream); r != CUDA_SUCCESS) return r;
  }
  if (function != &flip_byte || params == nullptr || params[0] == nullptr || extra != nullptr ||
      gx * gy * gz * bx * by * bz == 0 || shared != 0) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  CUdeviceptr at = 0;
  std::memcpy(&at, params[0], sizeof at);
  std::byte* to = nullptr;
  if (Resolve(at, 1, /*write=*/true, &to, /*by_kernel=*/true) != CUDA_SUCCESS) {
    S().sticky = CUDA_ERROR_ILLEGAL_ADDRESS;  // whatever the reason: the store faulted
    return CUDA_SUCCESS;
  }
  *to ^= std::byte{0xff};
  return CUDA_SUCCESS;
}

// ---- pinned host memory ----

CUresult MemAllocHost(void** p, size_t bytes) {
  std::lock_guard lock(S().mu);
  if (CUresult r = NeedContext(); r != CUDA_SUCCESS) return r;
  if (p == nullptr || bytes == 0) return CUDA_ERROR_INVALID_VALUE;
  void* at = nullptr;
  if (::posix_memalign(&at, 4096, bytes) != 0) return CUDA_ERROR_OUT_OF_MEMORY;
  S().pinned[reinterpret_cast<uintptr_t>(at)] = bytes;
  *p = at;
  return CUDA_SUCCESS;
}

CUresult MemFreeHost(void* p) {
  std::lock_guard lock(S().mu);
  if (CUresult r = NeedContext(); r != CUDA_SUCCESS && r != S().sticky) return r;
  if (S().pinned.erase(reinterpret_cast<uintptr_t>(p)) != 1) return CUDA_ERROR_INVALID_VALUE;
  std::free(p);
  return CUDA_SUCCESS;
}

CUresult MemHostRegister(void* p, size_t bytes, unsigned int flags) {
  State& s = S();
  std::lock_guard lock(s.mu);
  if (CUresult r = NeedContext(); r != CUDA_SUCCESS) return r;
  if (p == nullptr || bytes == 0) return CUDA_ERROR_INVALID_VALUE;
  if (s.refuse_host_register) return CUDA_ERROR_NOT_SUPPORTED;
  if (std::exchange(s.refuse_first_host_register, false)) return CUDA_ERROR_NOT_SUPPORTED;
  const auto at = reinterpret_cast<uintptr_t>(p);
  auto next = s.registered.lower_bound(at);
  if (next != s.registered.end() && next->first < at + bytes) {
    return CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED;
  }
  if (next != s.registered.begin() && std::prev(next)->first + std::prev(next)->second > at) {
    return CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED;
  }
  if ((flags & CU_MEMHOSTREGISTER_READ_ONLY) == 0 && !HostWritable(at, bytes)) {
    return CUDA_ERROR_INVALID_VALUE;  // pinning read-only pages for writing
  }
  s.registered[at] = bytes;
  return CUDA_SUCCESS;
}

CUresult MemHostUnregister(void* p) {
  std::lock_guard lock(S().mu);
  if (CUresult r = NeedContext(); r != CUDA_SUCCESS && r != S().sticky) return r;
  if (S().registered.erase(reinterpret_cast<uintptr_t>(p)) != 1) {
    return CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED;
  }
  return CUDA_SUCCESS;
}

// ---- streams and events: every copy above is done when its call returns ----

CUresult StreamCreate(CUstream* stream, unsigned int) {
  std::lock_guard lock(S().mu);
  int dev = 0;
  if (CUresult r = NeedContext(&dev); r != CUDA_SUCCESS) return r;
  if (stream == nullptr) return CUDA_ERROR_INVALID_VALUE;
  *stream = new CUstream_st{dev};
  return CUDA_SUCCESS;
}

CUresult StreamDestroy(CUstream stream) { return DestroyHandle(stream); }

CUresult StreamSynchronize(CUstream stream) {
  std::lock_guard lock(S().mu);
  return CheckStream(stream);
}

CUresult EventCreate(CUevent* event, unsigned int) {
  std::lock_guard lock(S().mu);
  int dev = 0;
  if (CUresult r = NeedContext(&dev); r != CUDA_SUCCESS) return r;
  if (event == nullptr) return CUDA_ERROR_INVALID_VALUE;
  *event = new CUevent_st{dev};
  return CUDA_SUCCESS;
}

CUresult EventRecord(CUevent event, CUstream stream) {
  std::lock_guard lock(S().mu);
  if (event == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  return CheckStream(stream);
}

CUresult EventSynchronize(CUevent event) {
  std::lock_guard lock(S().mu);
  if (event == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  return NeedContext();
}

CUresult EventDestroy(CUevent event) { return DestroyHandle(event); }

struct Entry {
  const char* name;
  void* fn;
};

#define ENTRY(name, fn) \
  { name, reinterpret_cast<void*>(&fn) }
const Entry kEntries[] = {
    ENTRY("cuInit", Init),
    ENTRY("cuGetErrorString", GetErrorString),
    ENTRY("cuDriverGetVersion", DriverGetVersion),
    ENTRY("cuDeviceGetCount", DeviceGetCount),
    ENTRY("cuDeviceGet", DeviceGet),
    ENTRY("cuDeviceGetName", DeviceGetName),
    ENTRY("cuDeviceGetUuid", DeviceGetUuid),
    ENTRY("cuDeviceTotalMem", DeviceTotalMem),
    ENTRY("cuDeviceGetAttribute", DeviceGetAttribute),
    ENTRY("cuMemGetAllocationGranularity", MemGetAllocationGranularity),
    ENTRY("cuDevicePrimaryCtxRetain", DevicePrimaryCtxRetain),
    ENTRY("cuDevicePrimaryCtxRelease", DevicePrimaryCtxRelease),
    ENTRY("cuCtxPushCurrent", CtxPushCurrent),
    ENTRY("cuCtxPopCurrent", CtxPopCurrent),
    ENTRY("cuCtxSetCurrent", CtxSetCurrent),
    ENTRY("cuCtxSynchronize", CtxSynchronize),
    ENTRY("cuMemGetInfo", MemGetInfo),
    ENTRY("cuMemCreate", MemCreate),
    ENTRY("cuMemRelease", MemRelease),
    ENTRY("cuMemAddressReserve", MemAddressReserve),
    ENTRY("cuMemAddressFree", MemAddressFree),
    ENTRY("cuMemMap", MemMap),
    ENTRY("cuMemUnmap", MemUnmap),
    ENTRY("cuMemSetAccess", MemSetAccess),
    ENTRY("cuMemGetAccess", MemGetAccess),
    ENTRY("cuMemExportToShareableHandle", MemExportToShareableHandle),
    ENTRY("cuMemImportFromShareableHandle", MemImportFromShareableHandle),
    ENTRY("cuMemcpyHtoD", MemcpyHtoD),
    ENTRY("cuMemcpyDtoH", MemcpyDtoH),
    ENTRY("cuMemcpyDtoDAsync", MemcpyDtoDAsync),
    ENTRY("cuMemcpyHtoDAsync", MemcpyHtoDAsync),
    ENTRY("cuMemsetD8", MemsetD8),
    ENTRY("cuModuleLoadData", ModuleLoadData),
    ENTRY("cuModuleUnload", ModuleUnload),
    ENTRY("cuModuleGetFunction", ModuleGetFunction),
    ENTRY("cuLaunchKernel", LaunchKernel),
    ENTRY("cuMemAllocHost", MemAllocHost),
    ENTRY("cuMemFreeHost", MemFreeHost),
    ENTRY("cuMemHostRegister", MemHostRegister),
    ENTRY("cuMemHostUnregister", MemHostUnregister),
    ENTRY("cuStreamCreate", StreamCreate),
    ENTRY("cuStreamDestroy", StreamDestroy),
    ENTRY("cuStreamSynchronize", StreamSynchronize),
    ENTRY("cuEventCreate", EventCreate),
    ENTRY("cuEventRecord", EventRecord),
    ENTRY("cuEventSynchronize", EventSynchronize),
    ENTRY("cuEventDestroy", EventDestroy),
};
#undef ENTRY

}  // namespace

// The one symbol looked up by name; everything else through it, as the
// real driver's entry points are.
extern "C" __attribute__((visibility("default"))) CUresult cuGetProcAddress(
    const char* symbol, void** pfn, int version, cuuint64_t flags,
    CUdriverProcAddressQueryResult* status) {
  if (symbol == nullptr || pfn == nullptr) return CUDA_ERROR_INVALID_VALUE;
  (void)flags;
  *pfn = nullptr;
  if (version < 12000) {
    if (status) *status = CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT;
    return CUDA_ERROR_NOT_FOUND;
  }
  for (const Entry& e : kEntries) {
    if (std::strcmp(e.name, symbol) == 0) {
      *pfn = e.fn;
      if (status) *status = CU_GET_PROC_ADDRESS_SUCCESS;
      return CUDA_SUCCESS;
    }
  }
  if (status) *status = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
  return CUDA_ERROR_NOT_FOUND;
}
