// The benchmarks' --json_out: writes the result where asked, or says why not.
#ifndef ZEROSHARD_TESTS_TESTING_BENCH_JSON_H_
#define ZEROSHARD_TESTS_TESTING_BENCH_JSON_H_

#include <cstdio>
#include <fstream>
#include <string>

#include "nlohmann/json.hpp"

namespace zeroshard {

// Writes `json` (indented) to `path` unless it is empty. Returns the
// benchmark's exit code: 0, or 1 with a message when the file cannot be written.
template <typename Json>  // nlohmann::json or nlohmann::ordered_json
int WriteBenchJson(const Json& json, const std::string& path) {
  if (path.empty()) return 0;
  std::ofstream out(path);
  out << json.dump(2) << "\n";
  out.close();
  if (!out) {
    std::fprintf(stderr, "cannot write --json_out=%s\n", path.c_str());
    return 1;
  }
  return 0;
}

}  // namespace zeroshard

#endif  // ZEROSHARD_TESTS_TESTING_BENCH_JSON_H_
