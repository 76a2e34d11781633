// What the CUDA driver does with a VMM allocation shared as a file
// descriptor, the way weightd's CUDA backend will share model segments:
//
//   1. the exporter allocates (cuMemCreate, POSIX file descriptor handles),
//      fills it and exports it as a descriptor;
//   2. another process imports it, maps it, and asks for read-only access
//      (CU_MEM_ACCESS_FLAGS_PROT_READ). Does the driver accept that? Do the
//      importer's writes then fail, or go through silently? Nothing we found
//      documents it: this measures it;
//   3. the bytes survive the exporter letting go of everything (its
//      mapping, its handle, its descriptor) while an importer maps them;
//   4. host-to-device bandwidth from pageable and from pinned memory;
//   5. the host-tier reload: a sealed memfd mapped read-only, as an engine
//      maps a host segment, registered with the driver
//      (CU_MEMHOSTREGISTER_READ_ONLY) and copied to the GPU. Is a sealed
//      mapping accepted, what does pinning it cost, and is the copy as
//      fast as one from memory the driver allocated pinned?
//
// Standalone on purpose: it needs only cuda.h and a compiler, so it builds on
// a GPU machine without weightd's other dependencies (scripts/gpu-check).
//
//   vmm_probe [--mib N]      prints `key: value` lines; exit 3 without a GPU
#include <cuda.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

namespace {

struct Api {
  CUresult (*cuInit)(unsigned);
  CUresult (*cuGetErrorString)(CUresult, const char**);
  CUresult (*cuDeviceGet)(CUdevice*, int);
  CUresult (*cuDeviceGetAttribute)(int*, CUdevice_attribute, CUdevice);
  CUresult (*cuDeviceGetName)(char*, int, CUdevice);
  CUresult (*cuDevicePrimaryCtxRetain)(CUcontext*, CUdevice);
  CUresult (*cuCtxSetCurrent)(CUcontext);
  CUresult (*cuCtxSynchronize)();
  CUresult (*cuMemGetAllocationGranularity)(size_t*, const CUmemAllocationProp*,
                                            CUmemAllocationGranularity_flags);
  CUresult (*cuMemCreate)(CUmemGenericAllocationHandle*, size_t, const CUmemAllocationProp*,
                          unsigned long long);
  CUresult (*cuMemExportToShareableHandle)(void*, CUmemGenericAllocationHandle,
                                           CUmemAllocationHandleType, unsigned long long);
  CUresult (*cuMemImportFromShareableHandle)(CUmemGenericAllocationHandle*, void*,
                                             CUmemAllocationHandleType);
  CUresult (*cuMemAddressReserve)(CUdeviceptr*, size_t, size_t, CUdeviceptr, unsigned long long);
  CUresult (*cuMemMap)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle,
                       unsigned long long);
  CUresult (*cuMemSetAccess)(CUdeviceptr, size_t, const CUmemAccessDesc*, size_t);
  CUresult (*cuMemGetAccess)(unsigned long long*, const CUmemLocation*, CUdeviceptr);
  CUresult (*cuMemUnmap)(CUdeviceptr, size_t);
  CUresult (*cuMemAddressFree)(CUdeviceptr, size_t);
  CUresult (*cuMemRelease)(CUmemGenericAllocationHandle);
  CUresult (*cuMemcpyHtoD)(CUdeviceptr, const void*, size_t);
  CUresult (*cuMemcpyDtoH)(void*, CUdeviceptr, size_t);
  CUresult (*cuMemsetD8)(CUdeviceptr, unsigned char, size_t);
  CUresult (*cuMemAllocHost)(void**, size_t);
  CUresult (*cuMemFreeHost)(void*);
  CUresult (*cuMemHostRegister)(void*, size_t, unsigned);
  CUresult (*cuMemHostUnregister)(void*);
} api;

std::string Describe(CUresult r) {
  const char* s = nullptr;
  if (api.cuGetErrorString != nullptr && api.cuGetErrorString(r, &s) == CUDA_SUCCESS && s) return s;
  return "CUDA error " + std::to_string(static_cast<int>(r));
}

// Exit 3: no GPU here (not a failure of the check itself): no driver library,
// or a driver that sees no device. A driver that is there and fails is a
// failure (Fail, exit 1), so a broken GPU machine never reads as "no GPU".
[[noreturn]] void NoGpu(const std::string& why) {
  std::printf("gpu: none (%s)\n", why.c_str());
  std::exit(3);
}

[[noreturn]] void Fail(const char* what, CUresult r) {
  std::printf("error: %s: %s\n", what, Describe(r).c_str());
  std::exit(1);
}

void Check(const char* what, CUresult r) {
  if (r != CUDA_SUCCESS) Fail(what, r);
}

template <typename F>
void Load(void* get_proc, const char* name, F& fn) {
  using GetProc =
      CUresult (*)(const char*, void**, int, cuuint64_t, CUdriverProcAddressQueryResult*);
  void* p = nullptr;
  CUdriverProcAddressQueryResult found{};
  if (reinterpret_cast<GetProc>(get_proc)(name, &p, 12000, CU_GET_PROC_ADDRESS_DEFAULT, &found) !=
          CUDA_SUCCESS ||
      p == nullptr) {
    std::printf("error: the driver has no %s\n", name);
    std::exit(1);
  }
  fn = reinterpret_cast<F>(p);
}

CUcontext context = nullptr;  // the primary context, once started

CUdevice Start() {
  void* lib = ::dlopen("libcuda.so.1", RTLD_NOW);
  if (lib == nullptr) NoGpu(::dlerror());
  void* get = ::dlsym(lib, "cuGetProcAddress_v2");
  if (get == nullptr) {
    std::printf("error: the driver is older than CUDA 12 (no cuGetProcAddress_v2)\n");
    std::exit(1);
  }
#define LOAD(f) Load(get, #f, api.f)
  LOAD(cuInit);
  LOAD(cuGetErrorString);
  LOAD(cuDeviceGet);
  LOAD(cuDeviceGetAttribute);
  LOAD(cuDeviceGetName);
  LOAD(cuDevicePrimaryCtxRetain);
  LOAD(cuCtxSetCurrent);
  LOAD(cuCtxSynchronize);
  LOAD(cuMemGetAllocationGranularity);
  LOAD(cuMemCreate);
  LOAD(cuMemExportToShareableHandle);
  LOAD(cuMemImportFromShareableHandle);
  LOAD(cuMemAddressReserve);
  LOAD(cuMemMap);
  LOAD(cuMemSetAccess);
  LOAD(cuMemGetAccess);
  LOAD(cuMemUnmap);
  LOAD(cuMemAddressFree);
  LOAD(cuMemRelease);
  LOAD(cuMemcpyHtoD);
  LOAD(cuMemcpyDtoH);
  LOAD(cuMemsetD8);
  LOAD(cuMemAllocHost);
  LOAD(cuMemFreeHost);
  LOAD(cuMemHostRegister);
  LOAD(cuMemHostUnregister);
#undef LOAD
  if (CUresult r = api.cuInit(0); r != CUDA_SUCCESS) {
    if (r == CUDA_ERROR_NO_DEVICE) NoGpu("cuInit: " + Describe(r));
    Fail("cuInit", r);
  }
  CUdevice dev;
  if (CUresult r = api.cuDeviceGet(&dev, 0); r != CUDA_SUCCESS) {
    if (r == CUDA_ERROR_NO_DEVICE || r == CUDA_ERROR_INVALID_DEVICE) {
      NoGpu("cuDeviceGet: " + Describe(r));
    }
    Fail("cuDeviceGet", r);
  }
  Check("cuDevicePrimaryCtxRetain", api.cuDevicePrimaryCtxRetain(&context, dev));
  Check("cuCtxSetCurrent", api.cuCtxSetCurrent(context));
  return dev;
}

CUdeviceptr Map(CUmemGenericAllocationHandle h, size_t size, CUdevice dev, CUmemAccess_flags flags,
                CUresult* access) {
  CUdeviceptr ptr;
  Check("cuMemAddressReserve", api.cuMemAddressReserve(&ptr, size, 0, 0, 0));
  Check("cuMemMap", api.cuMemMap(ptr, size, 0, h, 0));
  CUmemAccessDesc desc{};
  desc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  desc.location.id = dev;
  desc.flags = flags;
  *access = api.cuMemSetAccess(ptr, size, &desc, 1);
  return ptr;
}

uint8_t Pattern(size_t i) { return static_cast<uint8_t>(i * 131 + 7); }

bool HoldsPattern(CUdeviceptr ptr, size_t size) {
  std::vector<uint8_t> back(size);
  Check("cuMemcpyDtoH", api.cuMemcpyDtoH(back.data(), ptr, size));
  for (size_t i = 0; i < size; ++i) {
    if (back[i] != Pattern(i)) return false;
  }
  return true;
}

// Imports the descriptor and maps it read-only (read-write, said so, when
// the driver refuses read-only).
CUdeviceptr Import(int fd, size_t size, CUdevice dev, bool* read_only) {
  CUmemGenericAllocationHandle h;
  Check("cuMemImportFromShareableHandle",
        api.cuMemImportFromShareableHandle(&h, reinterpret_cast<void*>(static_cast<intptr_t>(fd)),
                                           CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
  CUresult access;
  CUdeviceptr ptr = Map(h, size, dev, CU_MEM_ACCESS_FLAGS_PROT_READ, &access);
  *read_only = access == CUDA_SUCCESS;
  if (!*read_only) {
    std::printf("importer_read_only_access: refused: %s (mapped read-write instead)\n",
                Describe(access).c_str());
    CUmemAccessDesc desc{};
    desc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    desc.location.id = dev;
    desc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    Check("cuMemSetAccess (read-write fallback)", api.cuMemSetAccess(ptr, size, &desc, 1));
  } else {
    std::printf("importer_read_only_access: accepted\n");
  }
  // What the driver says it recorded: an accepted read-only request that
  // reads back read-write would explain a write that goes through.
  CUmemLocation where{};
  where.type = CU_MEM_LOCATION_TYPE_DEVICE;
  where.id = dev;
  unsigned long long flags = 0;
  if (CUresult r = api.cuMemGetAccess(&flags, &where, ptr); r != CUDA_SUCCESS) {
    std::printf("importer_access_recorded: unknown (cuMemGetAccess: %s)\n", Describe(r).c_str());
  } else {
    std::printf("importer_access_recorded: %s\n",
                flags == CU_MEM_ACCESS_FLAGS_PROT_READ        ? "read-only"
                : flags == CU_MEM_ACCESS_FLAGS_PROT_READWRITE ? "read-write"
                : flags == CU_MEM_ACCESS_FLAGS_PROT_NONE      ? "none"
                                                              : "other");
  }
  return ptr;
}

// Importer 1: reads, then tries to write through its read-only mapping.
int WritingImporter(int fd, size_t size) {
  const CUdevice dev = Start();
  bool read_only = false;
  CUdeviceptr ptr = Import(fd, size, dev, &read_only);
  const bool reads = HoldsPattern(ptr, size);
  std::printf("importer_reads_exporter_bytes: %s\n", reads ? "yes" : "NO");
  std::fflush(stdout);
  // A copy-engine write, then a memset. A fault may poison this context:
  // each is reported, and the exporter checks its bytes after.
  const uint8_t junk[64] = {};
  const CUresult copy = api.cuMemcpyHtoD(ptr, junk, sizeof junk);
  const CUresult copy_sync = api.cuCtxSynchronize();
  std::printf("importer_write_by_copy%s: %s / sync %s\n", read_only ? "" : " (read-write)",
              Describe(copy).c_str(), Describe(copy_sync).c_str());
  std::fflush(stdout);
  if (copy_sync == CUDA_SUCCESS) {  // refused or not, the context still works
    const CUresult set = api.cuMemsetD8(ptr + 4096, 0, 64);
    const CUresult set_sync = api.cuCtxSynchronize();
    std::printf("importer_write_by_memset%s: %s / sync %s\n", read_only ? "" : " (read-write)",
                Describe(set).c_str(), Describe(set_sync).c_str());
  } else {
    std::printf(
        "importer_write_by_memset: not tried (the copy's error left the context unusable)\n");
  }
  std::fflush(stdout);
  return reads ? 0 : 1;
}

// Importer 2: maps, tells the exporter (on `signal_fd`) to let go of
// everything, waits until it has (on `wait_fd`), then reads again.
int SurvivingImporter(int fd, size_t size, int signal_fd, int wait_fd) {
  const CUdevice dev = Start();
  bool read_only = false;
  CUdeviceptr ptr = Import(fd, size, dev, &read_only);
  ::close(fd);
  const char c = 'm';
  char done = 0;
  if (::write(signal_fd, &c, 1) != 1 || ::read(wait_fd, &done, 1) != 1) return 1;
  const bool survived = HoldsPattern(ptr, size);
  std::printf("bytes_after_exporter_let_go: %s\n", survived ? "intact" : "LOST");
  std::fflush(stdout);
  return survived ? 0 : 1;
}

// Starts this program again as an importer with `args`; the descriptors
// named in `keep` are inherited.
pid_t Spawn(const char* self, const std::vector<std::string>& args, const std::vector<int>& keep) {
  for (int fd : keep) ::fcntl(fd, F_SETFD, 0);
  std::fflush(stdout);
  const pid_t child = ::fork();
  if (child == 0) {
    std::vector<char*> argv = {const_cast<char*>(self)};
    for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    ::execv("/proc/self/exe", argv.data());
    ::_exit(127);
  }
  return child;
}

int Wait(pid_t child, const char* what) {
  int status = 0;
  ::waitpid(child, &status, 0);
  const int code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  std::printf("%s_exit: %d\n", what, code);
  return code;
}

// A fresh mapping of `size` bytes registered in eight parts, by eight
// threads at once, then let go: whether pinning pages scales with threads.
void RegisterInParts(std::byte* map, size_t size) {
  constexpr size_t kThreads = 8;
  const size_t part = (size / kThreads + 4095) / 4096 * 4096;
  std::vector<std::thread> threads;
  std::vector<CUresult> results(kThreads, CUDA_SUCCESS);
  const auto t0 = std::chrono::steady_clock::now();
  for (size_t i = 0; i < kThreads && i * part < size; ++i) {
    threads.emplace_back([&, i] {
      api.cuCtxSetCurrent(context);
      results[i] = api.cuMemHostRegister(map + i * part, std::min(part, size - i * part),
                                         CU_MEMHOSTREGISTER_READ_ONLY);
    });
  }
  for (std::thread& t : threads) t.join();
  const double register_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const auto t1 = std::chrono::steady_clock::now();
  for (size_t i = 0; i < threads.size(); ++i) {
    if (results[i] == CUDA_SUCCESS) api.cuMemHostUnregister(map + i * part);
  }
  const double unregister_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();
  std::string refused;
  for (CUresult r : results) {
    if (r != CUDA_SUCCESS && refused.empty()) refused = " (refused: " + Describe(r) + ")";
  }
  std::printf("host_register_8_threads_seconds: %.3f%s\n", register_s, refused.c_str());
  std::printf("host_unregister_8_parts_seconds: %.3f\n", unregister_s);
}

}  // namespace

// 5. A sealed memfd, mapped read-only as an engine maps a host segment,
//    registered and copied into the allocation at `ptr`.
void HostTierReload(CUdeviceptr ptr, size_t size, const std::vector<uint8_t>& pattern,
                    double pinned_gbps) {
  const int fd = ::memfd_create("vmm-probe-host-segment", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  bool filled = fd >= 0 && ::ftruncate(fd, static_cast<off_t>(size)) == 0;
  for (size_t at = 0; filled && at < size;) {
    const ssize_t n = ::pwrite(fd, pattern.data() + at, size - at, static_cast<off_t>(at));
    filled = n > 0;
    at += filled ? static_cast<size_t>(n) : 0;
  }
  if (!filled ||
      ::fcntl(fd, F_ADD_SEALS, F_SEAL_WRITE | F_SEAL_GROW | F_SEAL_SHRINK | F_SEAL_SEAL) != 0) {
    std::printf("host_register_sealed_memfd: not tried (cannot make a sealed memfd: %s)\n",
                std::strerror(errno));
    return;
  }
  // Each registration below gets a mapping of its own, fresh as an
  // engine's is: one whose pages an earlier registration faulted in would
  // flatter the next.
  void* map = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
  if (map == MAP_FAILED) {
    std::printf("host_register_sealed_memfd: not tried (mmap: %s)\n", std::strerror(errno));
    ::close(fd);
    return;
  }
  Check("cuMemsetD8", api.cuMemsetD8(ptr, 0, size));
  Check("cuCtxSynchronize", api.cuCtxSynchronize());
  const auto t0 = std::chrono::steady_clock::now();
  const CUresult registered = api.cuMemHostRegister(map, size, CU_MEMHOSTREGISTER_READ_ONLY);
  const double register_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("host_register_sealed_memfd: %s\n",
              registered == CUDA_SUCCESS ? "accepted (READ_ONLY)"
                                         : ("refused: " + Describe(registered)).c_str());
  const auto t1 = std::chrono::steady_clock::now();
  Check("cuMemcpyHtoD (host segment)", api.cuMemcpyHtoD(ptr, map, size));
  Check("cuCtxSynchronize", api.cuCtxSynchronize());
  const double copy_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();
  const double gb = static_cast<double>(size) / 1e9;
  if (registered == CUDA_SUCCESS) {
    std::printf("host_register_seconds: %.3f\n", register_s);
    const auto t2 = std::chrono::steady_clock::now();
    api.cuMemHostUnregister(map);
    std::printf("host_unregister_seconds: %.3f\n",
                std::chrono::duration<double>(std::chrono::steady_clock::now() - t2).count());
    if (void* fresh = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0); fresh != MAP_FAILED) {
      RegisterInParts(static_cast<std::byte*>(fresh), size);
      ::munmap(fresh, size);
    }
  }
  ::close(fd);
  std::printf("htod_host_segment_gbps: %.2f (%s)\n", gb / copy_s,
              registered == CUDA_SUCCESS ? "registered" : "pageable");
  std::printf("host_segment_vs_pinned: %.2f\n", (gb / copy_s) / pinned_gbps);
  std::printf("host_segment_bytes_on_gpu: %s\n", HoldsPattern(ptr, size) ? "match" : "DIFFER");
  ::munmap(map, size);
}

int main(int argc, char** argv) {
  if (argc == 4 && std::strcmp(argv[1], "--write") == 0) {
    return WritingImporter(std::atoi(argv[2]), std::strtoull(argv[3], nullptr, 10));
  }
  if (argc == 6 && std::strcmp(argv[1], "--survive") == 0) {
    return SurvivingImporter(std::atoi(argv[2]), std::strtoull(argv[3], nullptr, 10),
                             std::atoi(argv[4]), std::atoi(argv[5]));
  }
  size_t mib = 1024;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::strcmp(argv[i], "--mib") == 0) mib = std::strtoull(argv[i + 1], nullptr, 10);
  }
  const CUdevice dev = Start();
  char name[256] = {};
  if (api.cuDeviceGetName(name, sizeof name - 1, dev) == CUDA_SUCCESS) {
    std::printf("device_name: %s\n", name);
  }
  int vmm = 0, fds = 0;
  api.cuDeviceGetAttribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev);
  api.cuDeviceGetAttribute(&fds, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
                           dev);
  std::printf("vmm: %s\nposix_fd_handles: %s\n", vmm ? "yes" : "no", fds ? "yes" : "no");
  if (!vmm || !fds) return 1;

  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = dev;
  size_t granularity = 0;
  Check("cuMemGetAllocationGranularity",
        api.cuMemGetAllocationGranularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
  const size_t size = (mib * (1ull << 20) + granularity - 1) / granularity * granularity;
  std::printf("granularity: %zu\nbytes: %zu\n", granularity, size);
  CUmemGenericAllocationHandle h;
  Check("cuMemCreate", api.cuMemCreate(&h, size, &prop, 0));
  CUresult access;
  CUdeviceptr ptr = Map(h, size, dev, CU_MEM_ACCESS_FLAGS_PROT_READWRITE, &access);
  Check("cuMemSetAccess (exporter)", access);

  // Bandwidth: pageable and pinned host memory into the allocation.
  std::vector<uint8_t> pageable(size);
  for (size_t i = 0; i < size; ++i) pageable[i] = Pattern(i);
  void* pinned = nullptr;
  Check("cuMemAllocHost", api.cuMemAllocHost(&pinned, size));
  std::memcpy(pinned, pageable.data(), size);
  auto timed = [&](const void* src) {
    const auto t0 = std::chrono::steady_clock::now();
    Check("cuMemcpyHtoD", api.cuMemcpyHtoD(ptr, src, size));
    Check("cuCtxSynchronize", api.cuCtxSynchronize());
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  timed(pinned);  // warm-up
  const double pageable_s = timed(pageable.data());
  const double pinned_s = timed(pinned);
  const auto gb = static_cast<double>(size) / 1e9;
  std::printf("htod_pageable_gbps: %.2f\nhtod_pinned_gbps: %.2f\n", gb / pageable_s, gb / pinned_s);
  api.cuMemFreeHost(pinned);

  int fd = -1;
  Check("cuMemExportToShareableHandle",
        api.cuMemExportToShareableHandle(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
  const std::string size_text = std::to_string(size), fd_text = std::to_string(fd);

  // 1. An importer writes through its read-only mapping; the exporter,
  //    still mapping the memory, looks at its bytes after.
  int failed = Wait(Spawn(argv[0], {"--write", fd_text, size_text}, {fd}), "writing_importer");
  const bool unchanged = HoldsPattern(ptr, size);
  std::printf("exporter_bytes_after_importer_writes: %s\n",
              unchanged ? "unchanged" : "CHANGED (the importer's writes went through)");

  // 2. Another importer maps; the exporter lets go of everything; the
  //    importer reads again (the pattern restored first, if 1 changed it).
  if (!unchanged) Check("cuMemcpyHtoD", api.cuMemcpyHtoD(ptr, pageable.data(), size));
  // Close-on-exec: only the ends named below reach the survivor. Were it to
  // inherit the write end of its own pipe, it would wait forever for an
  // exporter that died, holding the output gpu-check reads.
  int to_parent[2], to_child[2];
  if (::pipe2(to_parent, O_CLOEXEC) != 0 || ::pipe2(to_child, O_CLOEXEC) != 0) return 1;
  const pid_t survivor = Spawn(
      argv[0],
      {"--survive", fd_text, size_text, std::to_string(to_parent[1]), std::to_string(to_child[0])},
      {fd, to_parent[1], to_child[0]});
  ::close(to_parent[1]);  // a survivor that dies ends the read below
  ::close(to_child[0]);
  char c = 0;
  const bool mapped = ::read(to_parent[0], &c, 1) == 1;
  Check("cuMemUnmap", api.cuMemUnmap(ptr, size));
  Check("cuMemAddressFree", api.cuMemAddressFree(ptr, size));
  Check("cuMemRelease", api.cuMemRelease(h));
  ::close(fd);
  if (mapped && ::write(to_child[1], "r", 1) != 1) return 1;
  failed |= Wait(survivor, "surviving_importer");

  // 5. Last, in an allocation of its own: registering host memory is what a
  //    restricted runtime is likeliest to refuse, and a failure must not cost the
  //    answers above.
  CUmemGenericAllocationHandle reload;
  Check("cuMemCreate", api.cuMemCreate(&reload, size, &prop, 0));
  ptr = Map(reload, size, dev, CU_MEM_ACCESS_FLAGS_PROT_READWRITE, &access);
  Check("cuMemSetAccess (host-tier reload)", access);
  HostTierReload(ptr, size, pageable, gb / pinned_s);
  Check("cuMemUnmap", api.cuMemUnmap(ptr, size));
  Check("cuMemAddressFree", api.cuMemAddressFree(ptr, size));
  Check("cuMemRelease", api.cuMemRelease(reload));
  return failed != 0 ? 1 : 0;
}
