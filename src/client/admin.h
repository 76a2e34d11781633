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
// "error" becomes an Error with the daemon's message.
Result<nlohmann::json> Request(const std::string& socket_dir, const nlohmann::json& request,
                               const std::function<void(const nlohmann::json&)>& on_progress = {},
                               double wait_for_daemon_seconds = 0);

}  // namespace weightd::client
