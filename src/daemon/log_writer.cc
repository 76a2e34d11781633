#include "daemon/log_writer.h"

#include <poll.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <system_error>
#include <thread>

namespace weightd::daemon {

struct LogWriter::State {
  State(int to, std::function<std::string(std::string_view)> formatting)
      : fd(to), format(std::move(formatting)) {}

  const int fd;
  const std::function<std::string(std::string_view)> format;
  mutable std::mutex mu;
  std::condition_variable work;  // lines queued, or closing
  std::condition_variable idle;  // the queue written out
  std::deque<std::string> lines;
  size_t queued_bytes = 0;
  uint64_t dropped = 0;
  uint64_t unsaid = 0;  // dropped since the last line that said so
  bool writing = false;
  bool closing = false;
  std::thread writer;

  // Puts `line` in the queue if it fits; REQUIRES: mu held.
  bool QueueLocked(std::string line) {
    if (queued_bytes + line.size() + 1 > kMaxQueuedBytes) return false;
    queued_bytes += line.size() + 1;
    lines.push_back(std::move(line));
    return true;
  }

  void Run() {
    std::unique_lock lock(mu);
    for (;;) {
      work.wait(lock, [&] { return !lines.empty() || closing; });
      if (lines.empty()) break;  // closing, everything written
      std::deque<std::string> batch;
      batch.swap(lines);
      queued_bytes = 0;
      writing = true;
      lock.unlock();
      std::string out;
      for (const std::string& line : batch) (out += line) += '\n';
      WriteAll(out);
      lock.lock();
      writing = false;
      idle.notify_all();
    }
    idle.notify_all();
  }

  // As much of `text` as the reader takes; nothing more where it is gone.
  void WriteAll(std::string_view text) const {
    while (!text.empty()) {
      const ssize_t n = ::write(fd, text.data(), text.size());
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && errno == EAGAIN) {  // a non-blocking descriptor, full: wait here
        pollfd room{fd, POLLOUT, 0};
        if (::poll(&room, 1, -1) < 0 && errno != EINTR) return;
        continue;
      }
      if (n <= 0) return;
      text.remove_prefix(static_cast<size_t>(n));
    }
  }
};

LogWriter::LogWriter(int fd, std::function<std::string(std::string_view)> format)
    : state_(std::make_shared<State>(fd, std::move(format))) {
  // The thread holds the state too: one stuck in a write outlives this.
  try {
    state_->writer = std::thread([s = state_] { s->Run(); });
  } catch (const std::system_error&) {
    // No thread to be had (a process limit): lines are written as they
    // come, as before there was a writer.
  }
}

void LogWriter::Write(std::string_view message) {
  std::string line = state_->format(message);
  State& s = *state_;
  std::lock_guard lock(s.mu);
  if (!s.writer.joinable() && !s.closing) {
    s.WriteAll(line += '\n');
    return;
  }
  if (s.closing) {
    ++s.dropped;
    return;
  }
  if (s.unsaid > 0) {
    std::string note = s.format(std::to_string(s.unsaid) +
                                " log line(s) dropped: the log's reader did not read for a while");
    if (s.queued_bytes + note.size() + line.size() + 2 > kMaxQueuedBytes) {
      ++s.dropped;
      ++s.unsaid;
      return;
    }
    s.QueueLocked(std::move(note));
    s.unsaid = 0;
  }
  if (!s.QueueLocked(std::move(line))) {
    ++s.dropped;
    ++s.unsaid;
    return;
  }
  s.work.notify_one();
}

bool LogWriter::Close(double seconds) {
  if (closed_) return true;
  closed_ = true;
  State& s = *state_;
  std::unique_lock lock(s.mu);
  if (!s.writer.joinable()) {  // no writer: written already
    s.closing = true;
    return true;
  }
  s.closing = true;
  s.work.notify_one();
  const bool written = s.idle.wait_for(lock, std::chrono::duration<double>(seconds),
                                       [&] { return s.lines.empty() && !s.writing; });
  lock.unlock();
  if (written) {
    s.writer.join();
  } else {
    s.writer.detach();
  }
  return written;
}

uint64_t LogWriter::dropped() const {
  std::lock_guard lock(state_->mu);
  return state_->dropped;
}

}  // namespace weightd::daemon
