#include "cli/output.h"

#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <thread>

#include "io/file.h"
#include "protocol/paths.h"

namespace weightd::cli {

int ReportError(std::string_view what, std::string_view why, int code) {
  std::cerr << "weightd: error: " << what << ": " << Printable(why) << std::endl;
  return code;
}

std::string Count(uint64_t n, std::string_view noun) {
  return std::to_string(n) + " " + std::string(noun) + (n == 1 ? "" : "s");
}

std::string FormatSeconds(double seconds) {
  char buf[32];
  if (seconds < 0.01) {
    std::snprintf(buf, sizeof buf, "%.2f ms", seconds * 1e3);
  } else if (seconds < 0.1) {
    std::snprintf(buf, sizeof buf, "%.1f ms", seconds * 1e3);
  } else {
    std::snprintf(buf, sizeof buf, "%.2f s", seconds);
  }
  return buf;
}

std::string DumpJson(const nlohmann::json& value, int indent) {
  return value.dump(indent, ' ', false, nlohmann::json::error_handler_t::replace);
}

std::string PrintablePath(const nlohmann::json& path) {
  auto bytes = protocol::PathFromJson(path);
  return Printable(bytes.ok() ? *bytes : path.dump());
}

struct CleanUpOnSignal::State {
  sigset_t signals;
  sigset_t was;  // the calling thread's mask before
  std::function<void()> first;
  std::atomic<bool> done{false};
  std::thread taker;
};

CleanUpOnSignal::CleanUpOnSignal(std::function<void()> first) : state_(std::make_shared<State>()) {
  State& s = *state_;
  s.first = std::move(first);
  sigemptyset(&s.signals);
  for (int sig : {SIGINT, SIGTERM, SIGHUP}) {
    struct sigaction now {};
    // One ignored (SIGINT for a shell's background job) stays ignored.
    if (::sigaction(sig, nullptr, &now) == 0 && now.sa_handler != SIG_IGN) {
      sigaddset(&s.signals, sig);
    }
  }
  if (sigisemptyset(&s.signals)) return;
  ::pthread_sigmask(SIG_BLOCK, &s.signals, &s.was);
  try {
    s.taker = std::thread([state = state_] {
      int sig = 0;
      for (siginfo_t info;;) {
        sig = ::sigwaitinfo(&state->signals, &info);
        if (sig < 0) continue;  // EINTR
        // The destructor's wake-up, sent by this process (pthread_kill: as
        // SI_USER or SI_TKILL, by the C library); any other is a signal to
        // end the process, the destructor running or not.
        const bool ours =
            (info.si_code == SI_USER || info.si_code == SI_TKILL) && info.si_pid == ::getpid();
        if (state->done && ours) return;
        break;
      }
      try {
        if (state->first) state->first();
      } catch (...) {
        // No memory to clean up with: the process ends all the same.
      }
      io::RemoveUnfinishedPaths();
      ::signal(sig, SIG_DFL);
      sigset_t one;
      sigemptyset(&one);
      sigaddset(&one, sig);
      ::pthread_sigmask(SIG_UNBLOCK, &one, nullptr);
      ::raise(sig);
      ::_exit(128 + sig);  // a default action that did not end it (not one of these)
    });
  } catch (...) {
    // No thread: the signals end the process as before, cleaning up nothing.
    ::pthread_sigmask(SIG_SETMASK, &s.was, nullptr);
    sigemptyset(&s.signals);
  }
}

CleanUpOnSignal::~CleanUpOnSignal() {
  State& s = *state_;
  if (!s.taker.joinable()) return;
  s.done = true;
  for (int sig : {SIGTERM, SIGINT, SIGHUP}) {
    if (sigismember(&s.signals, sig)) {
      ::pthread_kill(s.taker.native_handle(), sig);
      break;
    }
  }
  s.taker.join();
  ::pthread_sigmask(SIG_SETMASK, &s.was, nullptr);
}

double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

CLI::Validator NotEmpty(const std::string& instead) {
  return CLI::Validator(
      [instead](std::string& text) -> std::string {
        return text.empty() ? "must not be empty (" + instead + ")" : "";
      },
      "", "not empty");
}

void AddSecondsOption(CLI::App& app, const std::string& name, double& value,
                      const std::string& help, double max, bool above_zero) {
  app.add_option(name, value, help)
      ->check(CLI::Validator(
          [max, above_zero](std::string& text) -> std::string {
            double v = 0;
            try {
              size_t used = 0;
              v = std::stod(text, &used);
              if (used != text.size()) return "`" + text + "` is not a number of seconds";
            } catch (const std::exception&) {
              return "`" + text + "` is not a number of seconds";
            }
            if (!std::isfinite(v) || v < 0 || v > max || (above_zero && v == 0)) {
              char limit[32];
              std::snprintf(limit, sizeof limit, "%g", max);
              return "`" + text + "` is not " +
                     (above_zero ? "above 0 and at most " : "between 0 and ") + limit + " seconds";
            }
            return "";
          },
          "SECONDS"));
}

}  // namespace weightd::cli
