#include "daemon/log_writer.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <mutex>
#include <string>
#include <thread>

#include "test_util.h"

namespace weightd::daemon {
namespace {

struct Pipe {
  int read = -1, write = -1;
  Pipe() {
    int fds[2];
    if (::pipe2(fds, O_CLOEXEC) == 0) {
      read = fds[0];
      write = fds[1];
    }
  }
  ~Pipe() {
    CloseWrite();
    if (read >= 0) ::close(read);
  }
  void CloseWrite() {
    if (write >= 0) ::close(write);
    write = -1;
  }
};

// Nobody reads the pipe: logging goes on without waiting, lines past what
// the queue holds are dropped and counted, and once the reader reads
// again, one line says how many went before the next.
TEST(LogWriter, AReaderThatStopsReadingHoldsUpNoOneAndDropsAreSaid) {
  Pipe pipe;
  ASSERT_GE(pipe.write, 0);
  LogWriter log(pipe.write, [](std::string_view m) { return "log: " + std::string(m); });
  const std::string filler(100, 'x');
  const int lines = 3 * static_cast<int>(LogWriter::kMaxQueuedBytes / filler.size());
  for (int i = 0; i < lines; ++i) log.Write(std::to_string(i) + " " + filler);  // no wait here
  const uint64_t dropped = log.dropped();
  EXPECT_GT(dropped, 0u);
  EXPECT_LT(dropped, static_cast<uint64_t>(lines));

  std::mutex mu;
  std::string got;
  std::thread reader([&] {
    char buf[1 << 16];
    for (ssize_t n; (n = ::read(pipe.read, buf, sizeof buf)) > 0;) {
      std::lock_guard lock(mu);
      got.append(buf, static_cast<size_t>(n));
    }
  });
  // Everything queued before the drops comes out first.
  EXPECT_TRUE(testing::Eventually([&] {
    std::lock_guard lock(mu);
    return got.size() >= LogWriter::kMaxQueuedBytes - 2 * filler.size();
  }));
  log.Write("after the gap");
  EXPECT_TRUE(log.Close(30));
  pipe.CloseWrite();
  reader.join();
  EXPECT_EQ(got.rfind("log: 0 " + filler + "\n", 0), 0u);
  const std::string note =
      "log: " + std::to_string(dropped) + " log line(s) dropped: the log's reader did not read";
  const size_t at = got.find(note);
  ASSERT_NE(at, std::string::npos) << got.substr(got.size() - std::min<size_t>(got.size(), 300));
  EXPECT_NE(got.find("log: after the gap\n", at), std::string::npos);
  EXPECT_EQ(log.dropped(), dropped);
}

// A writer stuck for good (a reader that never comes back) does not hold up
// the end either: Close gives up after its time and says so.
TEST(LogWriter, CloseGivesUpOnAWriteThatNeverEnds) {
  Pipe pipe;
  ASSERT_GE(pipe.write, 0);
  ASSERT_GE(::fcntl(pipe.write, F_SETPIPE_SZ, 4096), 0);
  auto log =
      std::make_unique<LogWriter>(pipe.write, [](std::string_view m) { return std::string(m); });
  for (int i = 0; i < 100; ++i) log->Write(std::string(200, 'y'));
  EXPECT_FALSE(log->Close(0.2));
  log.reset();  // the writer, still in its write, keeps what it needs
  // Read all of it, so that the writer ends before the pipe is closed.
  size_t read = 0;
  char buf[4096];
  for (ssize_t n; read < 100 * 201 && (n = ::read(pipe.read, buf, sizeof buf)) > 0;) {
    read += static_cast<size_t>(n);
  }
  EXPECT_EQ(read, 100u * 201);
}

}  // namespace
}  // namespace weightd::daemon
