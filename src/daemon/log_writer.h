// The daemon's log, written by a thread of its own. Whoever reads it (a
// terminal, a pager, a journal's pipe) may stop reading; the pipe then
// fills and the next write blocks. Written by the thread that logs, that
// write held every request that logs (an acquire, the end of a connection,
// whose leases go back after its line) and the stop behind it. Here a line
// is queued and the thread that logged it goes on; only the writer waits.
// Past kMaxQueuedBytes waiting, lines are dropped and counted, and one line
// says how many once there is room again.
//
// Thread safety: Write and dropped may be called from any thread, Close
// from one.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

namespace weightd::daemon {

class LogWriter {
 public:
  static constexpr size_t kMaxQueuedBytes = 1 << 20;

  // Writes to `fd` (not owned: it stays open while a write may come, until
  // Close returns true or the process ends) each message as `format` makes
  // it a line (without its newline), in the thread that logs it: a
  // timestamp is the time it was logged, not written. Where no thread can
  // be started (a process limit), each line is written as it is logged.
  LogWriter(int fd, std::function<std::string(std::string_view message)> format);
  LogWriter(const LogWriter&) = delete;
  LogWriter& operator=(const LogWriter&) = delete;
  ~LogWriter() { Close(1.0); }

  void Write(std::string_view message);
  // Waits up to `seconds` for every line queued to be written, then ends
  // the writer; one stuck in a write is left to the end of the process.
  // Whether every line was written. Lines written after it are dropped.
  bool Close(double seconds);
  // Lines dropped so far.
  uint64_t dropped() const;

 private:
  struct State;
  std::shared_ptr<State> state_;
  bool closed_ = false;
};

}  // namespace weightd::daemon
