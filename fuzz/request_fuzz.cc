// libFuzzer target: what an engine or an operator's command asks a running
// daemon. The daemon runs in this process, started once, and is reached as
// any client reaches it: over its real socket, one connection per input.
// The input is request bodies (JSON, or whatever the fuzzer makes of it),
// separated by the byte 0x1e; each goes out in a frame of its own, in
// order, and every reply is read until the daemon closes the connection.
//
// Whatever is asked, the daemon answers in well-formed frames or closes
// that connection, and keeps serving: a status request on a new connection
// is answered after every input. Then everything is evicted, so that an
// input finds the daemon as the one before it left it but for its lease
// numbers. Inputs over 4 KiB are skipped: requests are smaller, and all of
// an input's frames go out in one write.
//
// Requests that name files are kept inside a scratch directory: a `path`
// anywhere in a request becomes a small checkpoint, a directory with no
// checkpoint, a file that does not exist or a file that is no checkpoint,
// chosen by the length of what the input gave (its JSON text's, if not a
// string) modulo 4; a shard plan that names a file becomes a plan file
// there (even length) or one that does not exist (odd).
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <thread>

#include "daemon/server.h"
#include "format/synthetic.h"
#include "protocol/channel.h"
#include "transform/plan.h"

namespace {

using namespace weightd;
using nlohmann::json;

constexpr char kSeparator = '\x1e';

struct Sandbox {
  std::string dir;
  std::string socket_dir;
  std::vector<std::string> paths;       // what a request's `path` becomes
  std::vector<std::string> plan_files;  // what a plan file becomes
  std::unique_ptr<daemon::Server> server;
  std::thread runner;
};

Sandbox& Daemon() {
  static Sandbox* sandbox = [] {
    auto* s = new Sandbox;
    // Named for the process, which the test removes whatever becomes of
    // it (a crash skips the cleanup at exit).
    std::string name = "/tmp/weightd-request-fuzz-" + std::to_string(::getpid()) + "-XXXXXX";
    if (::mkdtemp(name.data()) == nullptr) __builtin_trap();
    s->dir = name;
    s->socket_dir = s->dir + "/sock";
    const std::string model = s->dir + "/model", empty = s->dir + "/empty";
    if (!format::WriteSyntheticCheckpoint(model, {.preset = "tiny"}).ok()) __builtin_trap();
    std::filesystem::create_directory(empty);
    const std::string junk = s->dir + "/junk";
    std::ofstream(junk) << "not a checkpoint\n";
    s->paths = {model, empty, s->dir + "/missing", junk};
    const std::string plan = s->dir + "/plan.toml";
    std::ofstream(plan) << "[[rule]]\nmatch = 'proj\\.weight$'\nsplit = \"column\"\n";
    s->plan_files = {plan, s->dir + "/missing.toml"};
    daemon::ServerOptions options;
    options.socket_dir = s->socket_dir;
    options.host_budget = 64 << 20;
    options.check_host_room = false;
    options.use_stat_cache = false;
    options.log = [](const std::string&) {};
    s->server = std::make_unique<daemon::Server>(options);
    if (!s->server->Start().ok()) __builtin_trap();
    // Serves until the process exits, which stops it first (as SIGTERM
    // would) and removes the scratch directory.
    s->runner = std::thread([server = s->server.get()] { server->Run(); });
    std::atexit([] {
      Sandbox& d = Daemon();
      d.server->RequestStop();
      d.runner.join();
      std::error_code ignored;
      std::filesystem::remove_all(d.dir, ignored);
    });
    return s;
  }();
  return *sandbox;
}

size_t Length(const json& v) {
  return v.is_string() ? v.get_ref<const std::string&>().size() : v.dump().size();
}

// Keeps what a request names inside the sandbox, chosen by what it named.
void Confine(json& value, const Sandbox& s) {
  if (value.is_object()) {
    for (auto& [key, v] : value.items()) {
      if (key == "path") {
        v = s.paths[Length(v) % s.paths.size()];
      } else if (key == "shard_plan" && v.is_string() &&
                 transform::IsPlanFile(v.get_ref<const std::string&>())) {
        v = s.plan_files[Length(v) % s.plan_files.size()];
      } else {
        Confine(v, s);
      }
    }
  } else if (value.is_array()) {
    for (json& v : value) Confine(v, s);
  }
}

// A frame carrying `body` as it is, JSON or not.
std::string Frame(std::string_view body) {
  return protocol::FrameHeader(static_cast<uint32_t>(body.size()), 0) + std::string(body);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size > 4096) return 0;
  Sandbox& s = Daemon();
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  std::string frames;
  for (size_t at = 0; at <= input.size();) {
    size_t end = input.find(kSeparator, at);
    if (end == std::string_view::npos) end = input.size();
    const std::string_view body = input.substr(at, end - at);
    json request = protocol::NestingDepth(body, protocol::kMaxJsonDepth) > protocol::kMaxJsonDepth
                       ? json(json::value_t::discarded)
                       : json::parse(body, nullptr, /*allow_exceptions=*/false);
    if (request.is_discarded()) {
      frames += Frame(body);
    } else {
      Confine(request, s);
      frames += Frame(request.dump());
    }
    at = end + 1;
  }
  auto ch = protocol::ConnectToDaemon(s.socket_dir);
  if (!ch.ok()) __builtin_trap();
  // Inputs are small (-max_len): they fit the socket buffer in one write.
  // It may fail: a daemon that refused an early frame closes the
  // connection, unread frames and all.
  (void)::send(ch->fd(), frames.data(), frames.size(), MSG_NOSIGNAL);
  ::shutdown(ch->fd(), SHUT_WR);  // the end of the requests: the daemon closes after its replies
  while (true) {
    auto reply = ch->Receive(30'000);
    if (reply.ok()) {
      if (!reply->body.is_object() || reply->type().empty()) __builtin_trap();
      continue;
    }
    if (reply.error().message() == protocol::Channel::kTimedOut) __builtin_trap();  // hung
    break;  // closed; a reply cut short would be the daemon's fault, but reads the same
  }
  auto again = protocol::ConnectToDaemon(s.socket_dir);
  if (!again.ok() || !again->Send(json{{"type", "status"}}).ok()) __builtin_trap();
  auto status = again->Receive(30'000);
  if (!status.ok() || status->type() != "status") __builtin_trap();
  if (!again->Send(json{{"type", "evict"}, {"what", "all"}}).ok()) __builtin_trap();
  auto evicted = again->Receive(30'000);
  if (!evicted.ok() || evicted->type() != "evicted") __builtin_trap();
  return 0;
}
