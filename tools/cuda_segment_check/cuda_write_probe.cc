// An engine that tries to write into the weights the daemon mapped for it on
// a GPU (read-only, if the driver granted that): what happens is what
// scripts/gpu-check reports, and what engines sharing the weights would see.
//
//   cuda_write_probe MODEL DEVICE [SOCKET_DIR]
//
// Acquires MODEL on DEVICE (cuda:N or cuda:GPU-<uuid>) through the client
// API, zero_copy and without a disk fallback, then tries to overwrite the
// first KiB of its largest tensor by a host-to-device copy and by a memset,
// and reads the bytes back. Prints `key: value` lines. Run it as its own
// process: a refused write may leave its CUDA context unusable.
//
// Exit: 0 it ran (whatever the driver did); 1 it could not acquire or map;
// 2 usage; 3 no GPU here.
#include <cstdio>
#include <string>

#include "memory/cuda.h"
#include "weightd/client.h"

int main(int argc, char** argv) {
  using namespace weightd;
  if (argc < 3 || argc > 4) {
    std::fprintf(stderr, "usage: cuda_write_probe MODEL DEVICE [SOCKET_DIR]\n");
    return 2;
  }
  if (auto gpus = memory::ListCudaDevices(); !gpus.ok()) {
    std::printf("write_probe: no GPU here (%s)\n", gpus.error().message().c_str());
    return 3;
  }
  LoadSpec spec{.path = argv[1]};
  spec.device = argv[2];
  AcquireOptions options;
  options.fallback = false;
  if (argc == 4) options.socket_dir = argv[3];
  auto weights = Acquire(spec, options);
  if (!weights.ok()) {
    std::printf("write_probe: cannot acquire: %s\n", weights.error().message().c_str());
    return 1;
  }
  const Weights& w = **weights;
  std::printf("write_probe_mapping: %s\n", w.reason().c_str());
  // Only the daemon's segment, mapped here, is what other engines share; a
  // copy of our own (the host-tier reload) proves nothing.
  if (w.reason().find("(mapped") == std::string::npos) {
    std::printf("write_probe: not the daemon's segment on the GPU; nothing tried\n");
    return 1;
  }
  const Tensor* largest = nullptr;
  for (const Tensor& t : w.tensors()) {
    if (largest == nullptr || t.bytes > largest->bytes) largest = &t;
  }
  if (largest == nullptr || largest->device_address == 0) {
    std::printf("write_probe: the weights are not on a GPU (%s)\n", w.device().c_str());
    return 1;
  }
  const uint64_t n = std::min<uint64_t>(largest->bytes, 1024);
  auto attempt = memory::TryWriteOnGpu(w.device().substr(5), largest->device_address, n);
  if (!attempt.ok()) {
    std::printf("write_probe: %s\n", attempt.error().message().c_str());
    return 1;
  }
  std::printf("write_probe_tensor: %.*s\n", static_cast<int>(largest->name.size()),
              largest->name.data());
  std::printf("write_probe_copy: %s\n", attempt->copy.c_str());
  std::printf("write_probe_memset: %s\n", attempt->memset.c_str());
  std::printf("write_probe_read_back: %s\n", attempt->read_back.c_str());
  // A fault may leave this process unable to read them back: then only
  // another process can tell (gpu-check loads the model again after).
  std::printf("write_probe_bytes_changed: %s\n", attempt->read_back != "ok" ? "unknown here"
                                                 : attempt->changed         ? "YES"
                                                                            : "no");
  return 0;
}
