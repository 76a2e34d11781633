// The wire between engines and the daemon: a Unix stream socket carrying
// frames, each a fixed 16-byte header and a JSON body, with at most two file
// descriptors attached (SCM_RIGHTS): a segment's handle, and for a GPU's
// segment the host memory holding its manifest.
//
//   header: "WDP1" | u32 protocol version | u32 body bytes | u32 descriptors
//   body:   one JSON object with a string "type"
//
// Bodies are bounded (kMaxBodyBytes): the big things, tensor tables, travel
// inside the segment, not on the socket. Nothing on the wire is executable.
// A frame that breaks any rule is an error for the connection it came on;
// the reader closes every descriptor that came with it.
//
// Thread safety: one thread sends and one receives on a Channel at a time.
#pragma once

#include <chrono>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "memory/segment.h"
#include "weightd/result.h"

namespace weightd::protocol {

inline constexpr uint32_t kProtocolVersion = 1;
inline constexpr uint32_t kMaxBodyBytes = 1u << 20;
// What the daemon takes from a peer: a request is a key, a path and
// options, kilobytes; a frame that says it is more is refused before its
// body is read (or room made for it).
inline constexpr uint32_t kMaxRequestBytes = 64u << 10;
inline constexpr uint32_t kMaxDescriptors = 2;
// Arrays and objects inside one another in a frame's body, at most: ours
// go five deep; a peer's thousands would make every reader that walks them
// recursively (printing, say) a stack overflow.
inline constexpr int kMaxJsonDepth = 32;
inline constexpr size_t kFrameHeaderBytes = 16;
// The longest an acquire may ask the daemon to wait for a load of its
// model in flight (`wait_seconds`); more is taken as this.
inline constexpr double kMaxAcquireWaitSeconds = 3600;

struct Message {
  nlohmann::json body;  // an object with a string "type"
  std::vector<memory::UniqueFd> fds;

  std::string type() const;
};

class Channel {
 public:
  explicit Channel(memory::UniqueFd socket) : socket_(std::move(socket)) {}

  // Sends one frame; `fd` (optional) travels with it. A peer that has
  // closed its end gives an error whose message is kClosed.
  Status Send(const nlohmann::json& body, const memory::UniqueFd* fd = nullptr);
  // The same with up to kMaxDescriptors descriptors, in this order.
  Status Send(const nlohmann::json& body, std::span<const memory::UniqueFd* const> fds);

  // Waits up to `timeout_ms` (-1: forever) for the next frame to start, and
  // then at most kBodyTimeoutMs for the whole of it; a body over
  // `max_body_bytes` is an error. A peer that closed cleanly between frames
  // gives an error whose message is kClosed.
  Result<Message> Receive(int timeout_ms = -1, uint32_t max_body_bytes = kMaxBodyBytes);

  int fd() const { return socket_.get(); }

  // After a Send that failed (the peer closed): the error the peer sent
  // before it closed, if it sent one (a daemon out of descriptors refuses
  // a connection so, before any request is read).
  std::optional<std::string> ErrorSentBeforeClosing();

  static constexpr const char* kClosed = "connection closed";
  // ...and one whose timeout passed before a frame began: kTimedOut.
  static constexpr const char* kTimedOut = "timed out waiting for a frame";
  static constexpr int kBodyTimeoutMs = 10'000;

 private:
  memory::UniqueFd socket_;
};

// How long a connect waits while the daemon's queue of connections not yet
// accepted is full (a burst of engines, or a daemon that stopped or hung:
// a blocking connect would wait for it forever).
inline constexpr int kConnectBusyTimeoutMs = 10'000;

// Why a connect failed, for a caller that may wait for a daemon to start.
enum class ConnectFailure {
  kRefused,      // something is there that will not do and waiting will not mend:
                 // an unsafe socket directory, another user's daemon, a bad path
  kNobodyThere,  // no socket directory or socket, or one a daemon that ended left
  kBusy,         // a daemon whose queue of connections stayed full
};

// Connects to the daemon's socket and checks that its peer runs as this
// user. `why` (when given) is set to why it failed.
Result<Channel> Connect(const std::string& socket_path, int busy_timeout_ms = kConnectBusyTimeoutMs,
                        ConnectFailure* why = nullptr);

// Connects to the daemon behind `socket_dir` after checking the directory
// (protocol::CheckSocketDirectory) and the peer; `why` as above, a socket
// directory that does not exist being kNobodyThere.
Result<Channel> ConnectToDaemon(const std::string& socket_dir,
                                int busy_timeout_ms = kConnectBusyTimeoutMs,
                                ConnectFailure* why = nullptr);

// The same, tried again for up to `wait_seconds` while nobody is there or
// the daemon is busy (one that is starting); a refusal ends it at once.
// Each try's busy timeout is what is left of the wait, `busy_timeout_ms` at
// most (that when not waiting); an error says how long it waited.
// `waited_seconds`, where given, gets the time it took where a try failed
// and it waited on; 0 where the first try ended it.
Result<Channel> ConnectToDaemonWaiting(const std::string& socket_dir, double wait_seconds,
                                       ConnectFailure* why = nullptr,
                                       int busy_timeout_ms = kConnectBusyTimeoutMs,
                                       double* waited_seconds = nullptr);

// A list for a reply whose length the daemon does not choose (every
// resident model, every model an `evict all` dropped): the entries, in
// order, while their JSON fits in `max_bytes`; how many more in `omitted`.
// A reply over the frame limit would not be sent at all.
nlohmann::json ListWithin(std::vector<nlohmann::json> entries, size_t max_bytes, uint64_t* omitted);

// How deep the arrays and objects of JSON `text` nest (strings skipped),
// counted no further than one level past `limit`: measured before a parse,
// which builds every level it meets.
int NestingDepth(std::string_view text, int limit);

// Builds the header of a frame (for frames made ahead, and tests that send
// broken ones).
std::string FrameHeader(uint32_t body_bytes, uint32_t descriptors,
                        uint32_t version = kProtocolVersion);

}  // namespace weightd::protocol
