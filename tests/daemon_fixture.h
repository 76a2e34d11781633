// A daemon on a socket directory of its own and the weightd commands an
// engine or an operator runs against it, as separate processes: the
// fixture of the tests that go through real processes and sockets.
#pragma once

#include <gtest/gtest.h>

#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "format/synthetic.h"
#include "test_util.h"

namespace weightd {

class DaemonTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ::setenv("WEIGHTD_CACHE_DIR", dir_.Join("cache").c_str(), 1);
    sock_ = dir_.Join("sock");
  }

  std::string MakeModel(const std::string& name, bool finetune = false, uint64_t bytes = 4 << 20) {
    const std::string path = dir_.Join(name);
    auto plan = format::WriteSyntheticCheckpoint(
        path, {.preset = "llama", .finetune = finetune, .size_bytes = bytes});
    EXPECT_TRUE(plan.ok()) << plan.error().message();
    return path;
  }

  std::unique_ptr<testing::Process> StartDaemon(std::vector<std::string> extra = {}) {
    std::vector<std::string> args = {"serve", "--socket-dir", sock_};
    args.insert(args.end(), extra.begin(), extra.end());
    auto p = std::make_unique<testing::Process>(args);
    EXPECT_TRUE(p->WaitForOutput("ready")) << p->err();
    return p;
  }

  testing::CommandResult Run(std::vector<std::string> args) {
    args.push_back("--socket-dir");
    args.push_back(sock_);
    return testing::RunWeightd(args);
  }

  nlohmann::json Load(const std::string& path, std::vector<std::string> extra = {}) {
    std::vector<std::string> args = {"load", path, "--json", "--checksum"};
    args.insert(args.end(), extra.begin(), extra.end());
    testing::CommandResult r = Run(args);
    EXPECT_EQ(r.exit_code, 0) << r.err;
    return r.exit_code == 0 ? nlohmann::json::parse(r.out) : nlohmann::json::object();
  }

  // What an engine gets with no daemon at all.
  std::string DiskChecksum(const std::string& path) {
    testing::CommandResult r = testing::RunWeightd(
        {"load", path, "--json", "--checksum", "--socket-dir", dir_.Join("no-daemon-here")});
    EXPECT_EQ(r.exit_code, 0) << r.err;
    auto j = nlohmann::json::parse(r.out);
    EXPECT_EQ(j["source"], "disk");
    return j["checksum"];
  }

  nlohmann::json Status() {
    testing::CommandResult r = Run({"status", "--json"});
    EXPECT_EQ(r.exit_code, 0) << r.err;
    return r.exit_code == 0 ? nlohmann::json::parse(r.out) : nlohmann::json::object();
  }

  void Preload(const std::string& path, std::vector<std::string> extra = {}) {
    std::vector<std::string> args = {"preload", path};
    args.insert(args.end(), extra.begin(), extra.end());
    testing::CommandResult r = Run(args);
    ASSERT_EQ(r.exit_code, 0) << r.err;
  }

  int TotalLeases() {
    int n = 0;
    const nlohmann::json status = Status();
    for (const auto& m : status["models"]) n += m["leases"].get<int>();
    return n;
  }

  testing::TempDir dir_;
  std::string sock_;
};

}  // namespace weightd
