// What every subcommand shares: the error line, sizes in and out, timing.
// Nothing here is logic a library user would need.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>

#include "protocol/cache_key.h"
#include "protocol/text.h"

namespace CLI {
class App;
class Validator;
}  // namespace CLI

namespace weightd::cli {

// Exit codes: 0 success, 1 the work failed, 2 the command line was wrong.
inline constexpr int kExitOk = 0;
inline constexpr int kExitFailure = 1;
inline constexpr int kExitUsage = 2;
inline constexpr int kExitNoDaemon = 3;  // status, preload, evict: nothing listens
inline constexpr int kExitWorkLeft = 4;  // serve: stopped, with work stuck in a call left behind

// While this lives, SIGINT, SIGTERM and SIGHUP (those not ignored when it
// was made) end the process only after `first` has run and the paths it was
// making are removed (io::UnfinishedPath); then the signal ends it as it
// would have. A thread of its own takes them, so `first` may do what any
// thread may. Make it before the command starts threads: a thread started
// before would take the signals itself.
class CleanUpOnSignal {
 public:
  explicit CleanUpOnSignal(std::function<void()> first = {});
  CleanUpOnSignal(const CleanUpOnSignal&) = delete;
  CleanUpOnSignal& operator=(const CleanUpOnSignal&) = delete;
  ~CleanUpOnSignal();  // the signals as they were

 private:
  struct State;
  std::shared_ptr<State> state_;
};

// Prints "weightd: error: <what>: <why>" to stderr and returns `code`.
int ReportError(std::string_view what, std::string_view why, int code = kExitFailure);

// Count(1, "shard") -> "1 shard", Count(3, "shard") -> "3 shards".
std::string Count(uint64_t n, std::string_view noun);

using protocol::FormatBytes;

// A duration for people: 0.00056 -> "0.56 ms", 0.0412 -> "41.2 ms", 2.5 -> "2.50 s".
std::string FormatSeconds(double seconds);

// JSON text; names from files need not be UTF-8, so invalid bytes become
// U+FFFD instead of an exception.
std::string DumpJson(const nlohmann::json& value, int indent = -1);

using protocol::Printable;

// A path as a reply carries it (a string, or {"hex": ...} for one that is
// not UTF-8), for a terminal; what is neither, as its JSON.
std::string PrintablePath(const nlohmann::json& path);

double SecondsSince(std::chrono::steady_clock::time_point start);

// A subcommand: CLI11 fills its options, then main calls run.
struct Command {
  CLI::App* app = nullptr;
  std::function<int()> run;
};

Command AddInspectCommand(CLI::App& root);
Command AddMakeCheckpointCommand(CLI::App& root);
Command AddDemoCommand(CLI::App& root);
Command AddFingerprintCommand(CLI::App& root);
Command AddServeCommand(CLI::App& root);
Command AddPreloadCommand(CLI::App& root);
Command AddStatusCommand(CLI::App& root);
Command AddEvictCommand(CLI::App& root);
Command AddLoadCommand(CLI::App& root);

// Refuses an empty value: `--socket-dir ""` (an unset variable in a
// script) must not quietly mean the default. `instead` says what to give.
CLI::Validator NotEmpty(const std::string& instead = "leave the flag out for the default");

// An option of seconds: a finite number in [0, max], or (0, max] with
// `above_zero` (nan and inf are usage errors, as CLI11's Range lets nan
// through).
void AddSecondsOption(CLI::App& app, const std::string& name, double& value,
                      const std::string& help, double max, bool above_zero = false);

// The processing flags `preload` and `load` share (--tp-size, --tp-rank,
// --dtype, --quant, --shard-plan, --device). Without `placement` (inspect,
// which explains every rank from the headers alone), no --tp-rank and no
// --device.
void AddProcessingFlags(CLI::App& app, protocol::Processing& p, bool placement = true);
// After parsing: the checks (a plan named where splitting or quantizing
// needs one, a plan file that reads), and a plan file's absolute path.
Status FinishProcessingFlags(protocol::Processing& p);

}  // namespace weightd::cli
