// Where the daemon listens: the one place both sides agree on.
//
//   --socket-dir, else $WEIGHTD_SOCKET_DIR, else $XDG_RUNTIME_DIR/weightd,
//   else /tmp/weightd-$UID
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "weightd/result.h"

namespace weightd::protocol {

inline constexpr const char* kSocketName = "weightd.sock";
inline constexpr const char* kLockName = "daemon.lock";

// The socket directory; `flag` (from --socket-dir) wins when not empty.
std::string SocketDirectory(const std::string& flag = "");

std::string SocketPath(const std::string& dir);

// The directory must be this user's alone: a real directory (not a
// symlink), owned by the effective uid, mode 0700 or stricter. The daemon
// checks it before listening; engines before trusting what listens there
// (/tmp/weightd-$UID could be made by anyone first).
Status CheckSocketDirectory(const std::string& dir);

// A file path on the wire. JSON carries UTF-8 text and a Linux path is
// bytes: a path that is not UTF-8 travels as {"hex": "<its bytes>"} so it
// arrives as it left, instead of with its odd bytes replaced.
nlohmann::json PathToJson(const std::string& path);
Result<std::string> PathFromJson(const nlohmann::json& j);

}  // namespace weightd::protocol
