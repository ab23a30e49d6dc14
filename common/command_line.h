// Command-line parsing that fails with a chosen exit code.
//
// absl::ParseCommandLine exits 1 on an unknown flag or a value it cannot
// parse. Binaries whose exit code tells a launcher what to do (shard_worker:
// 2 = a bad flag, never worth restarting) check every "--name[=value]"
// argument first and exit with `bad_flag_exit_code`, naming the flag.
#ifndef ZEROSHARD_COMMON_COMMAND_LINE_H_
#define ZEROSHARD_COMMON_COMMAND_LINE_H_

#include <string>
#include <vector>

namespace zeroshard {

// Returns "" when every flag argument in argv[1..] names a defined flag and,
// where it has "=value", the value parses; otherwise a message naming the
// first bad argument. Arguments after "--" are positional and not checked.
// Absl's own flags (--help*, --flagfile, --fromenv, ...) pass unchecked.
std::string CheckCommandLine(int argc, char** argv);

// CheckCommandLine, then absl::ParseCommandLine. On a bad flag prints
// "<program>: <message>" and exits with bad_flag_exit_code.
std::vector<char*> ParseCommandLineOrExit(int argc, char** argv, int bad_flag_exit_code);

}  // namespace zeroshard

#endif  // ZEROSHARD_COMMON_COMMAND_LINE_H_
