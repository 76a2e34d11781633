#include "client/admin.h"

#include <chrono>
#include <thread>

#include "protocol/channel.h"
#include "protocol/paths.h"

namespace weightd::client {

Result<nlohmann::json> Request(const std::string& socket_dir, const nlohmann::json& request,
                               const std::function<void(const nlohmann::json&)>& on_progress,
                               double wait_for_daemon_seconds) {
  const std::string dir = protocol::SocketDirectory(socket_dir);
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::duration<double>(wait_for_daemon_seconds);
  auto ch = protocol::ConnectToDaemon(dir);
  while (!ch.ok() && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    ch = protocol::ConnectToDaemon(dir);
  }
  if (!ch.ok()) return Error("no daemon: " + ch.error().message());
  WEIGHTD_RETURN_IF_ERROR(ch->Send(request));
  while (true) {
    // A preload reports progress at least every few seconds; anything else
    // answers at once.
    auto reply = ch->Receive(-1);
    if (!reply.ok()) return Error("the daemon did not answer: " + reply.error().message());
    if (reply->type() == "progress") {
      if (on_progress) on_progress(reply->body);
      continue;
    }
    if (reply->type() == "error") {
      auto it = reply->body.find("message");
      return Error(it != reply->body.end() && it->is_string() ? it->get<std::string>()
                                                              : "the daemon reported an error");
    }
    return reply->body;
  }
}

}  // namespace weightd::client
