"""fuzz_target: one libFuzzer target and its seed corpus.

With --config=fuzz (.bazelrc) `name` is a libFuzzer binary (ASan + UBSan,
clang); run it by hand, or through tests/fuzz/run_fuzzers.sh. In the default
build the same source links tests/fuzz/replay_main.cc instead and `name` is a
test that runs every input of corpus/<name>/ once: the seeds and every
regression input a finding left behind stay checked in every CI run.
"""

def fuzz_target(name, srcs, deps = [], size = "small"):
    native.cc_test(
        name = name,
        srcs = srcs,
        size = size,
        args = ["-runs=0", "tests/fuzz/corpus/" + name],
        data = native.glob(["corpus/" + name + "/**"]),
        linkopts = select({
            "//tools/bazel:fuzzing": ["-fsanitize=fuzzer"],
            "//conditions:default": [],
        }),
        deps = deps + select({
            "//tools/bazel:fuzzing": [],
            "//conditions:default": [":replay_main"],
        }),
        tags = ["fuzz_target"],
    )
