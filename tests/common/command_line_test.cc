#include "common/command_line.h"

#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "gtest/gtest.h"

ABSL_FLAG(int, cl_steps, 10, "test flag");
ABSL_FLAG(bool, cl_verbose, false, "test flag");
ABSL_FLAG(std::string, cl_name, "", "test flag");

namespace zeroshard {
namespace {

std::string Check(std::vector<std::string> args) {
  args.insert(args.begin(), "prog");
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  return CheckCommandLine(static_cast<int>(argv.size()), argv.data());
}

TEST(CommandLineTest, AcceptsDefinedFlagsInEveryForm) {
  EXPECT_EQ(Check({"--cl_steps=5", "--cl_verbose", "--nocl_verbose", "-cl_name", "x"}), "");
  EXPECT_EQ(Check({"--cl_verbose=true", "--helpfull", "positional", "--", "--not_a_flag"}), "");
  EXPECT_EQ(absl::GetFlag(FLAGS_cl_name), "x");
}

TEST(CommandLineTest, NamesAnUnknownFlag) {
  std::string error = Check({"--cl_steps=5", "--cl_stpes=6"});
  EXPECT_NE(error.find("unknown flag '--cl_stpes=6'"), std::string::npos) << error;
  EXPECT_NE(Check({"--nocl_steps"}).find("unknown flag"), std::string::npos);
}

TEST(CommandLineTest, NamesABadValue) {
  std::string error = Check({"--cl_steps=ten"});
  EXPECT_NE(error.find("bad value 'ten' for --cl_steps"), std::string::npos) << error;
  EXPECT_NE(Check({"--cl_name"}).find("missing its value"), std::string::npos);
}

TEST(CommandLineTest, ExitsWithTheChosenCode) {
  std::vector<std::string> args = {"prog", "--cl_nope"};
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  EXPECT_EXIT(ParseCommandLineOrExit(2, argv.data(), 2), ::testing::ExitedWithCode(2),
              "prog: unknown flag '--cl_nope'");
}

}  // namespace
}  // namespace zeroshard
