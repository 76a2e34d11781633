#include "protocol/channel.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <optional>
#include <thread>

#include "protocol/paths.h"

namespace weightd::protocol {
namespace {

constexpr char kMagic[4] = {'W', 'D', 'P', '1'};
// Room for more descriptors than allowed, so that too many is seen and
// refused rather than silently truncated.
constexpr size_t kControlRoom = CMSG_SPACE(sizeof(int) * 8);

std::string Errno(const std::string& what) { return what + ": " + std::strerror(errno); }

uint32_t GetU32(const char* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

void PutU32(std::string& out, uint32_t v) { out.append(reinterpret_cast<const char*>(&v), 4); }

using Clock = std::chrono::steady_clock;
using Deadline = Clock::time_point;

// Waits until the socket is readable; false once `deadline` has passed
// (never, when it is nullopt). A signal wakes the wait early: it goes on
// for what is left, so that a process with a periodic timer still gives up.
Result<bool> WaitReadable(int fd, std::optional<Deadline> deadline) {
  pollfd p{fd, POLLIN, 0};
  while (true) {
    int timeout = -1;
    if (deadline) {
      const auto left =
          std::chrono::ceil<std::chrono::milliseconds>(*deadline - Clock::now()).count();
      timeout = static_cast<int>(std::clamp<int64_t>(left, 0, INT32_MAX));
    }
    int n = ::poll(&p, 1, timeout);
    if (n > 0) return true;
    if (n == 0) return false;
    if (errno != EINTR) return Error(Errno("poll"));
  }
}

// Reads exactly `n` bytes into `dst`, collecting any descriptors that come
// along (more than kMaxDescriptors ends the frame at once). `first` tells
// whether a clean EOF before any byte is "closed", and whether the wait for
// the first byte has `first_timeout_ms` (-1: none); once a frame has
// started, all of it must arrive before `deadline`.
Status ReadFull(int fd, char* dst, size_t n, std::vector<memory::UniqueFd>& fds, bool first,
                int first_timeout_ms, Deadline& deadline) {
  std::optional<Deadline> first_deadline;
  if (first_timeout_ms >= 0)
    first_deadline = Clock::now() + std::chrono::milliseconds(first_timeout_ms);
  size_t got = 0;
  while (got < n) {
    const bool waiting_first = got == 0 && first;
    WEIGHTD_ASSIGN_OR_RETURN(bool ready,
                             WaitReadable(fd, waiting_first ? first_deadline : deadline));
    if (!ready) {
      return Error(waiting_first ? Channel::kTimedOut : "frame timed out halfway");
    }
    iovec iov{dst + got, n - got};
    alignas(cmsghdr) char control[kControlRoom];
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof control;
    ssize_t r = ::recvmsg(fd, &msg, MSG_CMSG_CLOEXEC);
    if (r < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      // A peer that closed with our last reply unread resets the
      // connection: between frames, that is an ordinary close.
      if (errno == ECONNRESET && got == 0 && first) return Error(Channel::kClosed);
      return Error(Errno("receive"));
    }
    for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
      if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
      const size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (size_t i = 0; i < count; ++i) {
        int received;
        std::memcpy(&received, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
        fds.emplace_back(received);
      }
    }
    if (msg.msg_flags & MSG_CTRUNC) {
      // Cut short by the sender's count, or by this process's limit: the
      // kernel stops installing descriptors at the first it has no slot for.
      const int probe = ::fcntl(fd, F_DUPFD_CLOEXEC, 0);
      if (probe < 0 && (errno == EMFILE || errno == ENFILE)) {
        return Error(Errno("no file descriptor left to receive one in") +
                     "; raise this process's limit (ulimit -n) or close descriptors");
      }
      if (probe >= 0) ::close(probe);
    }
    if ((msg.msg_flags & MSG_CTRUNC) || fds.size() > kMaxDescriptors) {
      return Error("frame carried more descriptors than allowed");
    }
    if (r == 0) {
      return Error(got == 0 && first ? Channel::kClosed
                                     : "connection closed halfway through a frame");
    }
    if (got == 0 && first) {
      deadline = Clock::now() + std::chrono::milliseconds(Channel::kBodyTimeoutMs);
    }
    got += static_cast<size_t>(r);
  }
  return OkStatus();
}

}  // namespace

int NestingDepth(std::string_view text, int limit) {
  int depth = 0, deepest = 0;
  bool in_string = false, escaped = false;
  for (const char ch : text) {
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (ch == '\\') {
        escaped = true;
      } else if (ch == '"') {
        in_string = false;
      }
    } else if (ch == '"') {
      in_string = true;
    } else if (ch == '[' || ch == '{') {
      deepest = std::max(deepest, ++depth);
      if (deepest > limit) break;
    } else if (ch == ']' || ch == '}') {
      --depth;
    }
  }
  return deepest;
}

std::string Message::type() const {
  auto it = body.find("type");
  return it != body.end() && it->is_string() ? it->get<std::string>() : std::string();
}

nlohmann::json ListWithin(std::vector<nlohmann::json> entries, size_t max_bytes,
                          uint64_t* omitted) {
  nlohmann::json list = nlohmann::json::array();
  size_t listed_bytes = 0;
  for (nlohmann::json& entry : entries) {
    // As Send writes it, and a comma.
    const size_t bytes =
        entry.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace).size() + 1;
    if (listed_bytes + bytes > max_bytes) break;
    listed_bytes += bytes;
    list.push_back(std::move(entry));
  }
  *omitted = entries.size() - list.size();
  return list;
}

std::string FrameHeader(uint32_t body_bytes, uint32_t descriptors, uint32_t version) {
  std::string h(kMagic, sizeof kMagic);
  PutU32(h, version);
  PutU32(h, body_bytes);
  PutU32(h, descriptors);
  return h;
}

Status Channel::Send(const nlohmann::json& body, const memory::UniqueFd* fd) {
  if (fd == nullptr) return Send(body, std::span<const memory::UniqueFd* const>{});
  return Send(body, std::span(&fd, 1));
}

Status Channel::Send(const nlohmann::json& body, std::span<const memory::UniqueFd* const> fds) {
  if (fds.size() > kMaxDescriptors) return Error("a frame carries at most two descriptors");
  const std::string text = body.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  if (text.size() > kMaxBodyBytes) {
    return Error("message of " + std::to_string(text.size()) + " bytes is over the frame limit");
  }
  const std::string frame =
      FrameHeader(static_cast<uint32_t>(text.size()), static_cast<uint32_t>(fds.size())) + text;
  size_t sent = 0;
  bool fds_sent = fds.empty();
  while (sent < frame.size()) {
    iovec iov{const_cast<char*>(frame.data() + sent), frame.size() - sent};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxDescriptors)];
    if (!fds_sent) {
      msg.msg_control = control;
      msg.msg_controllen = CMSG_SPACE(sizeof(int) * fds.size());
      cmsghdr* c = CMSG_FIRSTHDR(&msg);
      c->cmsg_level = SOL_SOCKET;
      c->cmsg_type = SCM_RIGHTS;
      c->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
      for (size_t i = 0; i < fds.size(); ++i) {
        const int raw = fds[i]->get();
        std::memcpy(CMSG_DATA(c) + i * sizeof(int), &raw, sizeof raw);
      }
    }
    ssize_t n = ::sendmsg(socket_.get(), &msg, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      // The peer gone (an engine that asked and did not wait for the
      // answer): as Receive says it.
      if (errno == EPIPE || errno == ECONNRESET) return Error(Channel::kClosed);
      return Error(Errno("send"));
    }
    fds_sent = true;
    sent += static_cast<size_t>(n);
  }
  return OkStatus();
}

Result<Message> Channel::Receive(int timeout_ms, uint32_t max_body_bytes) {
  Message m;
  char header[kFrameHeaderBytes];
  Deadline deadline{};
  WEIGHTD_RETURN_IF_ERROR(
      ReadFull(socket_.get(), header, sizeof header, m.fds, true, timeout_ms, deadline));
  if (std::memcmp(header, kMagic, sizeof kMagic) != 0) return Error("not a weightd frame");
  const uint32_t version = GetU32(header + 4), bytes = GetU32(header + 8),
                 descriptors = GetU32(header + 12);
  if (version != kProtocolVersion) {
    return Error("protocol version " + std::to_string(version) + " (this side speaks " +
                 std::to_string(kProtocolVersion) + ")");
  }
  const uint32_t limit = std::min(max_body_bytes, kMaxBodyBytes);
  if (bytes > limit) {
    return Error("frame of " + std::to_string(bytes) + " bytes is over the limit of " +
                 std::to_string(limit));
  }
  if (descriptors > kMaxDescriptors) return Error("frame announces too many descriptors");
  std::string text(bytes, '\0');
  WEIGHTD_RETURN_IF_ERROR(
      ReadFull(socket_.get(), text.data(), text.size(), m.fds, false, 0, deadline));
  if (m.fds.size() != descriptors) {
    return Error("frame announced " + std::to_string(descriptors) + " descriptors and carried " +
                 std::to_string(m.fds.size()));
  }
  // Measured before the parse, which builds every level it meets: a
  // megabyte of `[[[[` would be tens of megabytes of tree before anything
  // could refuse it.
  if (NestingDepth(text, kMaxJsonDepth) > kMaxJsonDepth) {
    return Error("frame body nests deeper than " + std::to_string(kMaxJsonDepth) + " levels");
  }
  m.body = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (m.body.is_discarded() || !m.body.is_object()) return Error("frame body is not a JSON object");
  if (m.type().empty()) return Error("frame body has no \"type\"");
  return m;
}

std::optional<std::string> Channel::ErrorSentBeforeClosing() {
  auto said = Receive(0);
  if (!said.ok() || said->type() != "error") return std::nullopt;
  auto it = said->body.find("message");
  return it != said->body.end() && it->is_string() ? it->get<std::string>() : "error";
}

Result<Channel> Connect(const std::string& socket_path, int busy_timeout_ms, ConnectFailure* why) {
  if (why != nullptr) *why = ConnectFailure::kRefused;
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (socket_path.size() >= sizeof addr.sun_path) {
    return Error("socket path " + socket_path + " is too long for a Unix socket");
  }
  std::memcpy(addr.sun_path, socket_path.c_str(), socket_path.size() + 1);
  // Non-blocking: a Unix socket connects at once or, while the listener's
  // queue is full, fails with EAGAIN, retried here until the timeout.
  memory::UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!fd.valid()) return Error(Errno("socket"));
  const auto give_up =
      std::chrono::steady_clock::now() + std::chrono::milliseconds(std::max(busy_timeout_ms, 0));
  while (::connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    if (errno == EINTR) continue;
    if (errno == EAGAIN && std::chrono::steady_clock::now() < give_up) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
      continue;
    }
    if (errno == EAGAIN) {
      if (why != nullptr) *why = ConnectFailure::kBusy;
      char waited[32];
      std::snprintf(waited, sizeof waited, "%g", busy_timeout_ms / 1000.0);
      return Error("cannot connect to " + socket_path + ": the daemon accepted no connection for " +
                   waited + " s (its queue is full: is it stopped or hung?)");
    }
    const int error = errno;
    if (why != nullptr) {
      // Refused by a socket nobody listens on, or by one gone since (a
      // daemon starting replaces a stale one); not by a file that is no
      // socket (which `serve` would not replace either).
      struct stat st;
      const bool no_socket = ::lstat(socket_path.c_str(), &st) == 0 && !S_ISSOCK(st.st_mode);
      if ((error == ENOENT || error == ECONNREFUSED) && !no_socket) {
        *why = ConnectFailure::kNobodyThere;
      }
    }
    errno = error;
    if (errno == ECONNREFUSED) {
      return Error("cannot connect to " + socket_path +
                   ": no daemon is listening there (one that ended left it, or one is starting)");
    }
    return Error(Errno("cannot connect to " + socket_path));
  }
  // Frames are read with poll and deadlines, and written whole: blocking
  // from here on.
  const int flags = ::fcntl(fd.get(), F_GETFL);
  if (flags < 0 || ::fcntl(fd.get(), F_SETFL, flags & ~O_NONBLOCK) != 0) {
    return Error(Errno("cannot set up the connection to " + socket_path));
  }
  // Whoever listens must be this user (the daemon checks us the same way):
  // weights from anyone else are not to be mapped.
  ucred peer{};
  socklen_t len = sizeof peer;
  if (::getsockopt(fd.get(), SOL_SOCKET, SO_PEERCRED, &peer, &len) != 0) {
    return Error(Errno("cannot read the credentials of " + socket_path));
  }
  if (peer.uid != ::geteuid()) {
    return Error(socket_path + " is served by uid " + std::to_string(peer.uid) +
                 ", not by this user; refusing it");
  }
  return Channel(std::move(fd));
}

}  // namespace weightd::protocol

namespace weightd::protocol {

Result<Channel> ConnectToDaemon(const std::string& socket_dir, int busy_timeout_ms,
                                ConnectFailure* why) {
  if (Status s = CheckSocketDirectory(socket_dir); !s.ok()) {
    // No such directory (a name ending in `.` or `..` is refused, not absent).
    struct stat st;
    const std::string last = socket_dir.substr(socket_dir.find_last_of('/') + 1);
    if (why != nullptr) {
      *why = last != "." && last != ".." && ::lstat(socket_dir.c_str(), &st) != 0 && errno == ENOENT
                 ? ConnectFailure::kNobodyThere
                 : ConnectFailure::kRefused;
    }
    return s.error();
  }
  return Connect(SocketPath(socket_dir), busy_timeout_ms, why);
}

Result<Channel> ConnectToDaemonWaiting(const std::string& socket_dir, double wait_seconds,
                                       ConnectFailure* why, int busy_timeout_ms,
                                       double* waited_seconds) {
  constexpr auto kRetry = std::chrono::milliseconds(50);
  const auto started = std::chrono::steady_clock::now();
  const auto deadline = started + std::chrono::duration<double>(wait_seconds);
  bool waiting = false;  // a try failed, and the wait went on
  auto tell_waited = [&] {
    if (waited_seconds == nullptr) return;
    const std::chrono::duration<double> took = std::chrono::steady_clock::now() - started;
    *waited_seconds = waiting ? took.count() : 0;
  };
  while (true) {
    const std::chrono::duration<double> left = deadline - std::chrono::steady_clock::now();
    const int busy = wait_seconds <= 0
                         ? busy_timeout_ms
                         : static_cast<int>(std::clamp(left.count() * 1000, 0.0,
                                                       static_cast<double>(busy_timeout_ms)));
    ConnectFailure failure = ConnectFailure::kRefused;
    auto ch = ConnectToDaemon(socket_dir, busy, &failure);
    if (why != nullptr) *why = failure;
    // A daemon that is starting ends what stands between; nothing ends a
    // refusal but someone mending it (an unsafe directory, another user's
    // daemon), so it is not waited on.
    if (ch.ok() || wait_seconds <= 0 || failure == ConnectFailure::kRefused) {
      tell_waited();
      return ch;
    }
    waiting = true;
    if (std::chrono::steady_clock::now() >= deadline) {
      tell_waited();
      char waited[64];
      std::snprintf(waited, sizeof waited, " (after waiting %g s for it)", wait_seconds);
      return Error(ch.error().message() + waited);
    }
    std::this_thread::sleep_for(kRetry);
  }
}

}  // namespace weightd::protocol
