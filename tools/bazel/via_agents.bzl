"""A direct-stream test and the same test through node agents (issue #31)."""

def cc_test_and_via_agents(name, srcs, deps, data = [], tags = [], ci_cases = None, **kwargs):
    """Defines cc_test `name` and `<name less _test>_via_agents_test`.

    The second runs the same test with ZEROSHARD_TEST_VIA_AGENTS=1: every
    worker of its clusters beats, joins and waits for its bootstrap keys
    through a shard_agent on its host (tests/testing/cluster.h), with the
    direct-stream test's expectations unchanged. Both link one compiled
    library of `srcs`.

    The twin is tagged manual (run by hand; docs/scale.md quotes the runs)
    unless `ci_cases` (a GoogleTest filter) names the cases CI runs through
    agents; `--test_arg=--gtest_filter='*'` runs them all by hand (Bazel's
    --test_filter does not override it).
    """
    native.cc_library(
        name = name + "_cases",
        testonly = True,
        srcs = srcs,
        deps = deps,
        alwayslink = True,
    )
    native.cc_test(name = name, data = data, tags = tags, deps = [":" + name + "_cases"], **kwargs)
    native.cc_test(
        name = name[:-len("_test")] + "_via_agents_test",
        data = data + ["//agent:shard_agent"],
        env = {"ZEROSHARD_TEST_VIA_AGENTS": "1"},
        args = ["--gtest_filter=" + ci_cases] if ci_cases else [],
        tags = tags + ([] if ci_cases else ["manual"]),
        deps = [":" + name + "_cases"],
        **kwargs
    )
