// DescribeProcess: what a failure message says about a child that does not
// answer.
#include <signal.h>

#include <cstdio>
#include <string>

#include "gtest/gtest.h"
#include "tests/testing/process.h"

namespace zeroshard::testing {
namespace {

TEST(DescribeProcessTest, NamesTheBinaryAndEachThreadsStateOfASleepingChild) {
  const std::string dir = MakeTempDir("describe");
  ChildProcess sleeper("/bin/sleep", {"30"}, dir + "/sleep.log");
  // Until it has exec'd, /proc/<pid>/exe is the test binary: wait for sleep's.
  // Both in one description: DescribeProcess reads exe before the threads,
  // so an exec between the two reads shows the old exe beside sleep's thread.
  std::string description;
  ASSERT_TRUE(WaitFor(
      [&] {
        description = DescribeProcess(sleeper.pid());
        return description.find("exe /usr/bin/sleep") != std::string::npos &&
               description.find("sleep: S (sleeping)") != std::string::npos;
      },
      absl::Seconds(20)))
      << description;
  std::printf("%s", description.c_str());  // what a failure message would show
  EXPECT_NE(description.find("exe /usr/bin/sleep"), std::string::npos) << description;
  EXPECT_NE(description.find("loadavg "), std::string::npos) << description;
  EXPECT_NE(description.find("MemAvailable:"), std::string::npos) << description;
  EXPECT_NE(description.find("wchan "), std::string::npos) << description;
  sleeper.Signal(SIGKILL);
  ASSERT_EQ(sleeper.Wait(absl::Seconds(20)), 128 + SIGKILL);
  EXPECT_NE(DescribeProcess(sleeper.pid()).find("the process is gone"), std::string::npos);
}

}  // namespace
}  // namespace zeroshard::testing
