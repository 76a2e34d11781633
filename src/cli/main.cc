// The weightd command: one binary, one subcommand per job (see docs/cli.md).
#include <CLI/CLI.hpp>
#include <iostream>
#include <vector>

#include "cli/output.h"

int main(int argc, char** argv) {
  using namespace weightd::cli;
  CLI::App app{
      "weightd keeps LLM model weights resident in memory between inference-engine restarts.\n"
      "Run `weightd COMMAND --help` for one command's options."};
  app.name("weightd");
  app.require_subcommand(1);
  app.set_version_flag("--version", "weightd 0.1.0");

  std::vector<Command> commands = {
      AddInspectCommand(app), AddMakeCheckpointCommand(app), AddFingerprintCommand(app),
      AddServeCommand(app),   AddPreloadCommand(app),        AddLoadCommand(app),
      AddStatusCommand(app),  AddEvictCommand(app),          AddDemoCommand(app),
  };

  // The first word, when it is not an option, must name a command; CLI11
  // says only that one is required, and `weightd nosuch --help` would print
  // the general help and succeed.
  if (argc > 1 && argv[1][0] != '-') {
    const std::string word = argv[1];
    bool known = false;
    for (const Command& c : commands) known = known || c.app->get_name() == word;
    if (!known) {
      return ReportError("usage", "`" + word + "` is not a command (see weightd --help)",
                         kExitUsage);
    }
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    // The command whose options were wrong, when there is one: its own help.
    std::string help = "weightd --help";
    for (const Command& c : commands) {
      if (c.app->parsed()) help = "weightd " + c.app->get_name() + " --help";
    }
    return ReportError("usage", std::string(e.what()) + " (see " + help + ")", kExitUsage);
  }
  for (const Command& command : commands) {
    if (!command.app->parsed()) continue;
    try {
      return command.run();
    } catch (const std::exception& e) {
      // Commands report their errors as values; this is the last line of
      // defence against a library throwing (allocation failure and the like).
      return ReportError(command.app->get_name(), e.what());
    }
  }
  return ReportError("usage", "no command given (see weightd --help)", kExitUsage);
}
