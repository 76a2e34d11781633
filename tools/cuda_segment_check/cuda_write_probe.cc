// An engine that tries to write into the weights the daemon mapped for it on
// a GPU (read-only, if the driver granted that): what happens is what
// scripts/gpu-check reports, and what engines sharing the weights would see.
//
//   cuda_write_probe MODEL DEVICE [SOCKET_DIR [WEIGHTD]]
//
// Acquires MODEL on DEVICE (cuda:N or cuda:GPU-<uuid>) through the client
// API, zero_copy and without a disk fallback, then tries to overwrite the
// first KiB of its largest tensor by a host-to-device copy and by a memset,
// and its first byte by a kernel's store, reading the bytes back after each. Where they changed,
// the weights every engine shares changed: with WEIGHTD (the weightd program), a new engine
// (`WEIGHTD load --checksum`) is asked for its checksum while they are
// changed; then the bytes from before are written back, so that the
// engines still holding the model keep the bytes they had. Prints
// `key: value` lines. Run it as its own process: a refused write may leave
// its CUDA context unusable.
//
// Exit: 0 it ran (whatever the driver did); 1 it could not acquire or map;
// 2 usage; 3 no GPU here.
#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "memory/cuda.h"
#include "weightd/client.h"

extern char** environ;

namespace {

// Runs `args` with its stdout read back here; its stderr goes where ours
// goes. What it printed, or why it could not run.
std::string Output(const std::vector<std::string>& args, int* exit_code) {
  int out[2];
  if (::pipe2(out, O_CLOEXEC) != 0) return "(no pipe)";
  posix_spawn_file_actions_t actions;
  ::posix_spawn_file_actions_init(&actions);
  ::posix_spawn_file_actions_adddup2(&actions, out[1], 1);
  std::vector<char*> argv;
  for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  pid_t pid = -1;
  const int spawned = ::posix_spawnp(&pid, argv[0], &actions, nullptr, argv.data(), environ);
  ::posix_spawn_file_actions_destroy(&actions);
  ::close(out[1]);
  std::string text;
  char buf[4096];
  for (ssize_t n; (n = ::read(out[0], buf, sizeof buf)) > 0;)
    text.append(buf, static_cast<size_t>(n));
  ::close(out[0]);
  if (spawned != 0) return "(cannot start " + args[0] + ")";
  int status = 0;
  ::waitpid(pid, &status, 0);
  *exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return text;
}

// The value of "checksum" in `load --json`'s output, or empty.
std::string ChecksumIn(const std::string& text) {
  const nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  return j.is_object() && j.contains("checksum") && j["checksum"].is_string()
             ? j["checksum"].get<std::string>()
             : "";
}

}  // namespace

int main(int argc, char** argv) {
  using namespace weightd;
  if (argc < 3 || argc > 5) {
    std::fprintf(stderr, "usage: cuda_write_probe MODEL DEVICE [SOCKET_DIR [WEIGHTD]]\n");
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
  if (argc >= 4) options.socket_dir = argv[3];
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
  // While the bytes are changed: what a new engine maps.
  std::string seen;
  auto ask_a_new_engine = [&] {
    if (argc < 5) return;
    const std::vector<std::string> load = {
        argv[4],         "load",       argv[1],  "--device",     argv[2],
        "--no-fallback", "--checksum", "--json", "--socket-dir", argv[3]};
    int code = -1;
    const std::string out = Output(load, &code);
    seen = ChecksumIn(out);
    if (seen.empty()) {
      seen = code < 0 ? "failed " + out : "failed (exit " + std::to_string(code) + ")";
    }
  };
  auto attempt =
      memory::TryWriteOnGpu(w.device().substr(5), largest->device_address, n, ask_a_new_engine);
  if (!attempt.ok()) {
    std::printf("write_probe: %s\n", attempt.error().message().c_str());
    return 1;
  }
  std::printf("write_probe_tensor: %.*s\n", static_cast<int>(largest->name.size()),
              largest->name.data());
  std::printf("write_probe_copy: %s\n", attempt->copy.c_str());
  std::printf("write_probe_memset: %s\n", attempt->memset.c_str());
  std::printf("write_probe_kernel: %s\n", attempt->kernel.c_str());
  std::printf("write_probe_read_back: %s\n", attempt->read_back.c_str());
  // A fault may leave this process unable to read them back: then only
  // another process can tell (gpu-check loads the model again after).
  std::printf("write_probe_bytes_changed: %s\n", attempt->changed             ? "YES"
                                                 : attempt->read_back != "ok" ? "unknown here"
                                                                              : "no");
  if (!seen.empty()) std::printf("write_probe_new_engine_checksum: %s\n", seen.c_str());
  if (!attempt->restored.empty()) {
    std::printf("write_probe_restored: %s\n", attempt->restored.c_str());
  }
  return 0;
}
