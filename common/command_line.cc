#include "common/command_line.h"

#include <cstdio>
#include <cstdlib>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace zeroshard {
namespace {

bool IsAbslBuiltin(absl::string_view name) {
  return absl::StartsWith(name, "help") || name == "version" || name == "only_check_args" ||
         name == "flagfile" || name == "fromenv" || name == "tryfromenv" || name == "undefok";
}

}  // namespace

std::string CheckCommandLine(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    absl::string_view arg = argv[i];
    if (arg == "--") break;
    if (arg.size() < 2 || arg[0] != '-') continue;  // positional
    absl::string_view body = arg.substr(arg[1] == '-' ? 2 : 1);
    absl::string_view name = body;
    absl::string_view value;
    bool has_value = false;
    if (size_t eq = body.find('='); eq != absl::string_view::npos) {
      name = body.substr(0, eq);
      value = body.substr(eq + 1);
      has_value = true;
    }
    if (IsAbslBuiltin(name)) continue;
    absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
    if (flag == nullptr && !has_value && absl::StartsWith(name, "no")) {
      absl::CommandLineFlag* negated = absl::FindCommandLineFlag(name.substr(2));
      if (negated != nullptr && negated->IsOfType<bool>()) continue;
    }
    if (flag == nullptr) {
      return absl::StrCat("unknown flag '", arg, "' (--helpfull lists the flags)");
    }
    if (!has_value) {
      if (flag->IsOfType<bool>()) continue;
      // "--name value": the value is the next argument.
      if (i + 1 >= argc) return absl::StrCat("flag '", arg, "' is missing its value");
      value = argv[++i];
    }
    std::string error;
    // Parsing here sets the flag; absl::ParseCommandLine then sets the same
    // value again.
    if (!flag->ParseFrom(value, &error)) {
      return absl::StrCat("bad value '", value, "' for --", name, ": ", error);
    }
  }
  return "";
}

std::vector<char*> ParseCommandLineOrExit(int argc, char** argv, int bad_flag_exit_code) {
  std::string error = CheckCommandLine(argc, argv);
  if (!error.empty()) {
    absl::string_view program = argc > 0 ? argv[0] : "program";
    if (size_t slash = program.rfind('/'); slash != absl::string_view::npos) {
      program = program.substr(slash + 1);
    }
    std::fprintf(stderr, "%.*s: %s\n", static_cast<int>(program.size()), program.data(),
                 error.c_str());
    std::exit(bad_flag_exit_code);
  }
  return absl::ParseCommandLine(argc, argv);
}

}  // namespace zeroshard
