// The daemon and engines on a GPU device, as separate processes, with the
// emulated CUDA driver (tools/emulated_cuda) standing in for a GPU: these
// run weightd's CUDA paths end to end (segments made, exported, imported
// and mapped in other processes; UUIDs across different device numberings;
// the read-write fallback; the host-tier reload both ways; budgets per GPU)
// and check weightd's side of the driver's contract. What a real driver
// does is checked only on a GPU, by scripts/gpu-check.
#include <gtest/gtest.h>
#include <signal.h>
#include <stdlib.h>

#include <map>
#include <optional>
#include <string>

#include "daemon_fixture.h"

namespace weightd {
namespace {

using nlohmann::json;

// The emulated driver's first device, as its UUID comes out.
constexpr char kGpu0[] = "cuda:GPU-e0000000-0000-4000-8000-000000000000";
constexpr char kGpu1[] = "cuda:GPU-e0010000-0000-4000-8000-000000000000";

class EmulatedGpuTest : public DaemonTest {
 protected:
  void SetUp() override {
#ifndef WEIGHTD_EMULATED_CUDA_DIR
    GTEST_SKIP() << "built without the CUDA driver header: no emulated driver";
#else
    DaemonTest::SetUp();
    // Every process this test starts loads the emulated libcuda.so.1.
    ::setenv("LD_LIBRARY_PATH", WEIGHTD_EMULATED_CUDA_DIR, 1);
    ::setenv("WEIGHTD_EMULATED_CUDA_DEVICES", "2", 1);
    ::unsetenv("CUDA_VISIBLE_DEVICES");
#endif
  }

  // Runs `body` with the environment variables `vars` set (or unset, for
  // nullopt) for the processes it starts.
  template <typename F>
  auto WithEnv(const std::map<std::string, std::optional<std::string>>& vars, F body) {
    std::map<std::string, std::optional<std::string>> before;
    for (const auto& [k, v] : vars) {
      const char* old = std::getenv(k.c_str());
      before[k] = old ? std::optional<std::string>(old) : std::nullopt;
      v ? ::setenv(k.c_str(), v->c_str(), 1) : ::unsetenv(k.c_str());
    }
    auto result = body();
    for (const auto& [k, v] : before)
      v ? ::setenv(k.c_str(), v->c_str(), 1) : ::unsetenv(k.c_str());
    return result;
  }

  // The status entry of the device named `name`.
  json DeviceStatus(const std::string& name) {
    const json status = Status();
    for (const json& d : status["devices"]) {
      if (d["name"] == name) return d;
    }
    ADD_FAILURE() << "no device " << name << " in status " << status.dump(1);
    return json::object();
  }
};

TEST_F(EmulatedGpuTest, APreloadOntoAGpuIsMappedAndCopiedWithTheBytesOfADiskLoad) {
  const std::string model = MakeModel("m");
  const std::string disk = DiskChecksum(model);
  auto daemon = StartDaemon();
  Preload(model, {"--device", "cuda:0"});
  EXPECT_GE(DeviceStatus(kGpu0)["used"].get<uint64_t>(), uint64_t{4} << 20);
  EXPECT_EQ(DeviceStatus(kGpu1)["used"], 0);
  EXPECT_EQ(DeviceStatus("host")["used"], 0);

  json mapped = Load(model, {"--device", "cuda:0", "--no-fallback"});
  EXPECT_EQ(mapped["source"], "daemon");
  EXPECT_EQ(mapped["device"], kGpu0);
  EXPECT_NE(mapped["reason"].get<std::string>().find("mapped read-only"), std::string::npos)
      << mapped["reason"];
  EXPECT_EQ(mapped["checksum"], disk);
  EXPECT_EQ(mapped["mode"], "zero_copy");
  // Starting CUDA is timed apart from the load on a GPU; on the host there
  // is none to time.
  EXPECT_TRUE(mapped["cuda_start_seconds"].is_number()) << mapped.dump();
  EXPECT_TRUE(Load(model)["cuda_start_seconds"].is_null());
  // So it is where --device names one GPU per rank: this rank's.
  json ranked = Load(model, {"--tp-size", "2", "--tp-rank", "1", "--shard-plan", "llama",
                             "--device", "cuda:0,cuda:1"});
  EXPECT_EQ(ranked["device"], kGpu1) << ranked.dump();
  EXPECT_TRUE(ranked["cuda_start_seconds"].is_number()) << ranked.dump();

  json copied = Load(model, {"--device", "cuda:0", "--no-fallback", "--mode", "copy"});
  EXPECT_EQ(copied["source"], "daemon");
  EXPECT_EQ(copied["mode"], "copy");
  EXPECT_EQ(copied["checksum"], disk);
  // A disk load onto the GPU gives the same bytes too.
  testing::CommandResult cold =
      testing::RunWeightd({"load", model, "--device", "cuda:1", "--json", "--checksum",
                           "--socket-dir", dir_.Join("no-daemon-here")});
  ASSERT_EQ(cold.exit_code, 0) << cold.err;
  EXPECT_EQ(json::parse(cold.out)["checksum"], disk);
  EXPECT_EQ(json::parse(cold.out)["device"], kGpu1);
}

// The daemon sees the GPUs in the opposite order from the preload and from
// one engine, and only one of them is visible to another: the UUID is what
// they agree on.
TEST_F(EmulatedGpuTest, ProcessesThatNumberTheGpusDifferentlyAgreeOnTheOne) {
  const std::string model = MakeModel("m");
  auto daemon = WithEnv({{"CUDA_VISIBLE_DEVICES", "1,0"}}, [&] { return StartDaemon(); });
  Preload(model, {"--device", "cuda:1"});  // this process's cuda:1: the second GPU
  EXPECT_GT(DeviceStatus(kGpu1)["used"].get<uint64_t>(), 0u);
  EXPECT_EQ(Status()["cuda"]["devices"][0]["name"], kGpu1);  // the daemon's cuda:0

  json only_second = WithEnv({{"CUDA_VISIBLE_DEVICES", "1"}}, [&] {
    return Load(model, {"--device", "cuda:0", "--no-fallback"});
  });
  EXPECT_EQ(only_second["source"], "daemon");
  EXPECT_EQ(only_second["device"], kGpu1);

  testing::CommandResult first =
      Run({"load", model, "--device", "cuda:0", "--no-fallback", "--json"});
  EXPECT_NE(first.exit_code, 0);
  EXPECT_NE(first.err.find(std::string("engine wants ") + kGpu0), std::string::npos) << first.err;
}

// A driver that refuses read-only access, or accepts it but records
// read-write: engines map read-write and are told so.
TEST_F(EmulatedGpuTest, ARefusedReadOnlyMappingIsMadeReadWriteAndSaidSo) {
  const std::string model = MakeModel("m");
  const std::string disk = DiskChecksum(model);
  for (const char* answer : {"refuse", "record-readwrite"}) {
    SCOPED_TRACE(answer);
    auto daemon =
        WithEnv({{"WEIGHTD_EMULATED_CUDA_READ_ONLY", answer}}, [&] { return StartDaemon(); });
    Preload(model, {"--device", "cuda:0"});
    EXPECT_NE(
        Status()["cuda"]["devices"][0]["read_only_mapping"].get<std::string>().find("refused"),
        std::string::npos);
    json engine = WithEnv({{"WEIGHTD_EMULATED_CUDA_READ_ONLY", answer}}, [&] {
      return Load(model, {"--device", "cuda:0", "--no-fallback"});
    });
    EXPECT_EQ(engine["source"], "daemon");
    EXPECT_NE(engine["reason"].get<std::string>().find("READ-WRITE"), std::string::npos)
        << engine["reason"];
    EXPECT_EQ(engine["checksum"], disk);
  }
}

// The write probe gpu-check runs, against each answer the emulated driver
// can give: it reports what the writer saw, and a new engine's checksum
// tells whether the weights other engines share changed.
TEST_F(EmulatedGpuTest, TheWriteProbeReportsWhatTheDriverDidWithTheWrite) {
  const std::string model = MakeModel("m");
  const std::string disk = DiskChecksum(model);
  auto daemon = StartDaemon();
  Preload(model, {"--device", "cuda:0"});
  auto probe = [&](const char* mode) {
    const std::string command = std::string(WEIGHTD_WRITE_PROBE) + " " + model + " cuda:0 " +
                                sock_ + " " + WEIGHTD_BINARY + " 2>&1";
    return WithEnv({{"WEIGHTD_EMULATED_CUDA_READ_ONLY", mode}}, [&] {
      std::string text;
      FILE* p = ::popen(command.c_str(), "r");
      char buf[4096];
      for (size_t n; p != nullptr && (n = std::fread(buf, 1, sizeof buf, p)) > 0;) {
        text.append(buf, n);
      }
      if (p != nullptr) {
        EXPECT_EQ(::pclose(p), 0) << text;
      }
      return text;
    });
  };
  auto shared_now = [&] {
    return Load(model, {"--device", "cuda:0", "--no-fallback"})["checksum"];
  };

  // What a new engine saw while the weights were changed, or "".
  auto seen_meanwhile = [](const std::string& out) {
    const std::string key = "write_probe_new_engine_checksum: ";
    const size_t at = out.find(key);
    if (at == std::string::npos) return std::string();
    return out.substr(at + key.size(), out.find('\n', at) - at - key.size());
  };

  // Enforced as the H200's driver did: the copy and the memset are refused
  // by the call, the kernel's store faults and leaves the writer unable to
  // read back; the weights are as they were.
  std::string out = probe("enforce");
  EXPECT_NE(out.find("write_probe_copy: invalid argument"), std::string::npos) << out;
  EXPECT_NE(out.find("write_probe_memset: invalid argument"), std::string::npos) << out;
  EXPECT_NE(out.find("write_probe_kernel: an illegal memory access"), std::string::npos) << out;
  EXPECT_NE(out.find("write_probe_bytes_changed: unknown here"), std::string::npos) << out;
  EXPECT_EQ(out.find("write_probe_restored"), std::string::npos) << out;
  EXPECT_EQ(shared_now(), disk);

  // Enforced by faults alone: the first write's fault ends the probe.
  out = probe("fault");
  EXPECT_NE(out.find("write_probe_copy: an illegal memory access"), std::string::npos) << out;
  EXPECT_NE(out.find("write_probe_bytes_changed: unknown here"), std::string::npos) << out;
  EXPECT_NE(out.find("write_probe_memset: not tried"), std::string::npos) << out;
  EXPECT_NE(out.find("write_probe_kernel: not tried"), std::string::npos) << out;
  EXPECT_EQ(out.find("write_probe_restored"), std::string::npos) << out;
  EXPECT_EQ(seen_meanwhile(out), "");
  EXPECT_EQ(shared_now(), disk);

  // Refused by the calls alone: the kernel's store goes through, to every
  // engine's weights (a new engine sees it meanwhile), and the probe puts
  // the byte back by the same store, as copies are refused.
  auto expect_seen_and_put_back = [&](const std::string& text) {
    EXPECT_NE(text.find("write_probe_bytes_changed: YES"), std::string::npos) << text;
    EXPECT_EQ(seen_meanwhile(text).rfind("xxh3", 0), 0u) << text;
    EXPECT_NE(seen_meanwhile(text), disk) << text;
    EXPECT_NE(text.find("write_probe_restored: yes"), std::string::npos) << text;
    EXPECT_EQ(shared_now(), disk);
  };
  out = probe("calls-only");
  EXPECT_NE(out.find("write_probe_copy: invalid argument"), std::string::npos) << out;
  EXPECT_NE(out.find("write_probe_kernel: accepted"), std::string::npos) << out;
  expect_seen_and_put_back(out);

  // Not enforced: every write goes through and is undone before the next.
  out = probe("ignore");
  EXPECT_NE(out.find("write_probe_copy: accepted"), std::string::npos) << out;
  EXPECT_NE(out.find("write_probe_memset: accepted"), std::string::npos) << out;
  EXPECT_NE(out.find("write_probe_kernel: accepted"), std::string::npos) << out;
  expect_seen_and_put_back(out);
}

TEST_F(EmulatedGpuTest, AnEngineKeepsItsGpuWeightsWhenTheDaemonIsKilled) {
  const std::string model = MakeModel("m");
  const std::string disk = DiskChecksum(model);
  auto daemon = StartDaemon();
  Preload(model, {"--device", "cuda:0"});
  testing::Process engine({"load", model, "--device", "cuda:0", "--no-fallback", "--checksum",
                           "--hold", "3", "--socket-dir", sock_});
  ASSERT_TRUE(engine.WaitForOutput("checksum")) << engine.err();
  daemon->Signal(SIGKILL);
  EXPECT_EQ(daemon->Wait(), 128 + SIGKILL);
  // --hold checksums again before it exits, and fails if the bytes moved.
  EXPECT_EQ(engine.Wait(), 0) << engine.err();
  EXPECT_NE(engine.out().find(disk.substr(disk.find(':') + 1)), std::string::npos) << engine.out();
  auto second = StartDaemon();  // the same directory, cleanly
}

// An engine asks for the GPU; the daemon holds the model in host memory:
// the engine copies it up, registered as pinned memory where the driver
// allows, through staging buffers where it does not.
TEST_F(EmulatedGpuTest, TheHostTierReloadCopiesRegisteredOrStaged) {
  // About 24 MiB: two parts of the reload's 16 MiB at the least.
  const std::string model = MakeModel("m", /*finetune=*/false, /*bytes=*/24 << 20);
  const std::string disk = DiskChecksum(model);
  auto daemon = StartDaemon();
  Preload(model);
  json registered = Load(model, {"--device", "cuda:0", "--no-fallback", "--mode", "copy"});
  EXPECT_EQ(registered["source"], "daemon");
  EXPECT_EQ(registered["device"], kGpu0);
  EXPECT_NE(registered["reason"].get<std::string>().find("registered as pinned memory"),
            std::string::npos)
      << registered["reason"];
  EXPECT_EQ(registered["checksum"], disk);
  // Asked to map it: a copy all the same, the engine's own (and said so).
  json reloaded = Load(model, {"--device", "cuda:0", "--no-fallback"});
  EXPECT_EQ(reloaded["source"], "daemon");
  EXPECT_EQ(reloaded["mode"], "copy");
  EXPECT_EQ(reloaded["checksum"], disk);
  json staged = WithEnv({{"WEIGHTD_EMULATED_CUDA_HOST_REGISTER", "refuse"}}, [&] {
    return Load(model, {"--device", "cuda:0", "--no-fallback", "--mode", "copy"});
  });
  // With the driver's own answer: on a GPU machine, the first thing to know.
  EXPECT_NE(staged["reason"].get<std::string>().find(
                "through staging buffers; cuMemHostRegister: operation not supported"),
            std::string::npos)
      << staged["reason"];
  EXPECT_EQ(staged["checksum"], disk);
  // The model is registered and copied in parts, by several threads: one
  // part the driver will not register is staged, the others are not.
  json mixed = WithEnv({{"WEIGHTD_EMULATED_CUDA_HOST_REGISTER", "refuse-first"}}, [&] {
    return Load(model, {"--device", "cuda:0", "--no-fallback", "--mode", "copy"});
  });
  EXPECT_NE(
      mixed["reason"].get<std::string>().find(
          "through staging buffers; 1 of 2 parts, cuMemHostRegister: operation not supported"),
      std::string::npos)
      << mixed["reason"];
  EXPECT_EQ(mixed["checksum"], disk);
}

TEST_F(EmulatedGpuTest, AGpuBudgetEvictsOnThatGpuOnly) {
  const std::string a = MakeModel("a"), b = MakeModel("b", /*finetune=*/true);
  // Each takes 22 MiB of the GPU (its weights and manifest in whole 2 MiB
  // granules): room for one.
  auto daemon = StartDaemon({"--budget", "cuda:0=40M"});
  Preload(a);  // in host memory
  Preload(a, {"--device", "cuda:0"});
  Preload(b, {"--device", "cuda:0"});
  json status = Status();
  std::multiset<std::string> where;
  for (const json& m : status["models"]) {
    where.insert(m["path"].get<std::string>() + " " + m["device"].get<std::string>());
  }
  EXPECT_EQ(where, (std::multiset<std::string>{a + " host", b + " " + kGpu0})) << status.dump(1);
  EXPECT_EQ(DeviceStatus(kGpu0)["used"].get<uint64_t>(), uint64_t{22} << 20);

  // Leased, b cannot make room for a: a clear error, nothing evicted.
  testing::Process engine({"load", b, "--device", "cuda:0", "--no-fallback", "--checksum", "--hold",
                           "30", "--socket-dir", sock_});
  ASSERT_TRUE(engine.WaitForOutput("checksum")) << engine.err();
  testing::CommandResult refused = Run({"preload", a, "--device", "cuda:0"});
  EXPECT_NE(refused.exit_code, 0);
  EXPECT_NE(refused.err.find(std::string("out of budget on ") + kGpu0), std::string::npos)
      << refused.err;
  EXPECT_EQ(Status()["models"].size(), 2u);
}

// Two budgets that name one GPU (by its number and by its UUID): the last
// holds, and that is said.
TEST_F(EmulatedGpuTest, TwoBudgetsForOneGpuAreSaid) {
  const std::string by_uuid = std::string(kGpu0).substr(5);  // GPU-...
  auto daemon = StartDaemon({"--budget", "cuda:0=40M", "--budget", "cuda:" + by_uuid + "=60M"});
  EXPECT_EQ(DeviceStatus(kGpu0)["budget"].get<uint64_t>(), uint64_t{60} << 20);
  EXPECT_TRUE(
      testing::Logged(*daemon, "budgets for cuda:0 and cuda:" + by_uuid + " name the same GPU"))
      << daemon->err();
}

// A GPU whose allocations come in 8 MiB steps: a 22 MiB model takes 24 MiB
// of it, and the budget is reserved as the allocation will be made. Two
// would fit a 46 MiB budget in 2 MiB steps; in 8 MiB steps the second
// preload evicts the first.
TEST_F(EmulatedGpuTest, AGpuBudgetIsReservedInTheDevicesGranularity) {
  const std::string a = MakeModel("a"), b = MakeModel("b", /*finetune=*/true);
  auto daemon = WithEnv({{"WEIGHTD_EMULATED_CUDA_GRANULARITY", "8M"}}, [&] {
    return StartDaemon({"--budget", "cuda:0=46M"});
  });
  Preload(a, {"--device", "cuda:0"});
  EXPECT_EQ(DeviceStatus(kGpu0)["used"].get<uint64_t>(), uint64_t{24} << 20);
  EXPECT_EQ(Status()["models"][0]["reserved_bytes"].get<uint64_t>(), uint64_t{24} << 20);
  Preload(b, {"--device", "cuda:0"});
  const json status = Status();
  ASSERT_EQ(status["models"].size(), 1u) << status.dump(1);
  EXPECT_EQ(status["models"][0]["path"], b);
}

// A GPU that cannot export its memory as file descriptors is listed, not
// served, with the reason; the host is served as ever.
TEST_F(EmulatedGpuTest, AGpuWithoutFdHandlesIsNotServedAndStatusSaysWhy) {
  auto daemon =
      WithEnv({{"WEIGHTD_EMULATED_CUDA_FD_HANDLES", "no"}}, [&] { return StartDaemon(); });
  const json status = Status();
  ASSERT_EQ(status["cuda"]["available"], true) << status["cuda"];
  const json& gpu = status["cuda"]["devices"][0];
  EXPECT_EQ(gpu["fd_handles"], false);
  EXPECT_EQ(gpu["not_served"], "it cannot export memory as file descriptors") << gpu;
  EXPECT_TRUE(testing::Logged(*daemon, "not served, it cannot export memory as file descriptors"))
      << daemon->err();
  testing::CommandResult text = Run({"status"});
  EXPECT_NE(text.out.find("not served: it cannot export memory as file descriptors"),
            std::string::npos)
      << text.out;
  const std::string model = MakeModel("m");
  testing::CommandResult r = Run({"preload", model, "--device", "cuda:0"});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("cannot export memory as file descriptors"), std::string::npos) << r.err;
  Preload(model);
  EXPECT_EQ(Load(model, {"--no-fallback"})["source"], "daemon");
}

TEST_F(EmulatedGpuTest, WithADriverButNoGpuTheDaemonServesTheHostAndSaysWhy) {
  auto daemon = WithEnv({{"WEIGHTD_EMULATED_CUDA_DEVICES", "0"}}, [&] { return StartDaemon(); });
  const json status = Status();
  EXPECT_EQ(status["cuda"]["available"], false);
  EXPECT_NE(status["cuda"]["reason"].get<std::string>().find("no CUDA device"), std::string::npos)
      << status["cuda"];
  ASSERT_EQ(status["devices"].size(), 1u);
  EXPECT_EQ(status["devices"][0]["name"], "host");
  const std::string model = MakeModel("m");
  testing::CommandResult r = Run({"preload", model, "--device", kGpu0});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("this daemon serves no GPU"), std::string::npos) << r.err;
  // The host is served as ever.
  Preload(model);
  EXPECT_EQ(Load(model, {"--no-fallback"})["source"], "daemon");
}

}  // namespace
}  // namespace weightd
