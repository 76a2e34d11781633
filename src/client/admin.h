// Requests to the daemon other than acquiring weights: preload, status,
// evict, memory. For operators' tools and the `weightd` command; an engine
// only needs weightd/client.h.
//
// Thread safety: each call uses its own connection.
#pragma once

#include <functional>
#include <nlohmann/json.hpp>
#include <string>

#include "weightd/result.h"

namespace weightd::client {

// Sends `request` (an object with "type") to the daemon behind
// `socket_dir` (empty: the default directory) and returns its final reply.
// Replies of type "progress" go to `on_progress` first. A reply of type
// "error" becomes an Error with the daemon's message. `no_daemon` (when
// given) is set to whether the error is that no daemon listens there (no
// socket, or one a daemon that ended left behind), rather than one that
// refused, failed or did not answer. A daemon silent for
// `reply_timeout_seconds` (stopped, hung; a preload in progress sends progress or a
// heartbeat every 5 s) is given up on, and so is a connect its full queue
// holds up that long (10 s at most).
inline constexpr double kDefaultReplyTimeoutSeconds = 30;  // six heartbeats missed
Result<nlohmann::json> Request(const std::string& socket_dir, const nlohmann::json& request,
                               const std::function<void(const nlohmann::json&)>& on_progress = {},
                               double wait_for_daemon_seconds = 0, bool* no_daemon = nullptr,
                               double reply_timeout_seconds = kDefaultReplyTimeoutSeconds);

}  // namespace weightd::client
