// Where the daemon listens: the one place both sides agree on.
//
//   --socket-dir, else $WEIGHTD_SOCKET_DIR, else $XDG_RUNTIME_DIR/weightd,
//   else /tmp/weightd-$UID
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "memory/segment.h"
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

// The same check, made on the directory opened (never through a symlink):
// whoever can write to its parent cannot swap another directory in
// between the check and the use, as long as the caller goes on through
// the descriptor returned (openat, PathThrough).
Result<memory::UniqueFd> OpenSocketDirectory(const std::string& dir);

// A path naming `name` in the directory open as `dir_fd`, for calls that
// take only a path (bind): through /proc/self/fd, which leads to the
// directory opened whatever its path names by then; `fallback` where
// /proc is not mounted. An error where /proc/self/fd/N is there but leads
// elsewhere.
Result<std::string> PathThrough(int dir_fd, const std::string& name, const std::string& fallback);

// A file path on the wire. JSON carries UTF-8 text and a Linux path is
// bytes: a path that is not UTF-8 travels as {"hex": "<its bytes>"} so it
// arrives as it left, instead of with its odd bytes replaced.
nlohmann::json PathToJson(const std::string& path);
Result<std::string> PathFromJson(const nlohmann::json& j);

}  // namespace weightd::protocol
