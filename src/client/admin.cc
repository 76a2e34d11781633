#include "client/admin.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "protocol/channel.h"
#include "protocol/paths.h"

namespace weightd::client {

Result<nlohmann::json> Request(const std::string& socket_dir, const nlohmann::json& request,
                               const std::function<void(const nlohmann::json&)>& on_progress,
                               double wait_for_daemon_seconds, bool* no_daemon,
                               double reply_timeout_seconds) {
  // Above 0, an hour at most; 0, less or nan: the default.
  const double limit_seconds = reply_timeout_seconds > 0 ? std::min(reply_timeout_seconds, 3600.0)
                                                         : kDefaultReplyTimeoutSeconds;
  const int silence_limit_ms = std::max(1, static_cast<int>(std::ceil(limit_seconds * 1000)));
  if (no_daemon != nullptr) *no_daemon = false;
  const std::string dir = protocol::SocketDirectory(socket_dir);
  protocol::ConnectFailure failure = protocol::ConnectFailure::kRefused;
  auto ch =
      protocol::ConnectToDaemonWaiting(dir, wait_for_daemon_seconds, &failure,
                                       std::min(protocol::kConnectBusyTimeoutMs, silence_limit_ms));
  if (!ch.ok()) {
    const bool absent = failure == protocol::ConnectFailure::kNobodyThere;
    // Nothing there, or something there that is refused: said apart.
    const std::string& why = ch.error().message();
    if (no_daemon != nullptr) *no_daemon = absent;
    return Error(absent ? "no daemon: " + why +
                              " (start one with `weightd serve`, or name its --socket-dir)"
                        : "cannot reach the daemon: " + why);
  }
  if (Status sent = ch->Send(request); !sent.ok()) {
    if (auto said = ch->ErrorSentBeforeClosing()) return Error("the daemon says: " + *said);
    return sent.error();
  }
  while (true) {
    // A preload sends progress, or a heartbeat, every few seconds; anything
    // else answers at once. Silence this long is a stopped or hung daemon.
    auto reply = ch->Receive(silence_limit_ms);
    if (!reply.ok()) {
      const std::string& why = reply.error().message();
      if (why == protocol::Channel::kClosed) {
        // A stopping daemon cancels its preloads and closes every connection.
        const bool preload = request.value("type", "") == "preload";
        return Error(
            "the daemon closed the connection before it answered: it stopped or died (its log "
            "says which; one killed by the kernel for memory writes nothing there, the kernel's "
            "log says so)" +
            std::string(preload ? ", or this command did not read its progress for 10 s "
                                  "(suspended?) and the preload went on without it: `weightd "
                                  "status` shows whether the model is resident"
                                : ""));
      }
      const bool silent = why == protocol::Channel::kTimedOut;
      char limit[32];
      std::snprintf(limit, sizeof limit, "%g", silence_limit_ms / 1000.0);
      // A request that changes what the daemon holds was sent whole: a
      // daemon stopped, not dead, carries it out once it runs again.
      const std::string type = request.value("type", "");
      const bool changes = type != "status" && type != "memory" && type != "hello";
      return Error(
          "the daemon did not answer: " + why +
          (silent ? " (nothing for " + std::string(limit) + " s: is it stopped or hung?)" : "") +
          (changes ? "; the " + type +
                         " was sent and may still be carried out if the daemon goes on: "
                         "`weightd status` shows what it holds"
                   : ""));
    }
    if (reply->type() == "progress") {
      const auto beat = reply->body.find("heartbeat");
      const bool heartbeat = beat != reply->body.end() && beat->is_boolean() && beat->get<bool>();
      if (on_progress && !heartbeat) on_progress(reply->body);
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
