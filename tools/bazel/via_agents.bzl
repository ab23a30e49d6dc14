"""A direct-stream test and the same test through node agents (issue #31)."""

def cc_test_and_via_agents(name, data = [], tags = [], **kwargs):
    """Defines cc_test `name` and `<name less _test>_via_agents_test`.

    The second runs the same test with ZEROSHARD_TEST_VIA_AGENTS=1: every
    worker of its clusters beats and joins through a shard_agent on its host
    (tests/testing/cluster.h), with the direct-stream test's expectations
    unchanged. Tagged manual: run by hand (docs/scale.md quotes the runs).
    """
    native.cc_test(name = name, data = data, tags = tags, **kwargs)
    native.cc_test(
        name = name[:-len("_test")] + "_via_agents_test",
        data = data + ["//agent:shard_agent"],
        env = {"ZEROSHARD_TEST_VIA_AGENTS": "1"},
        tags = tags + ["manual"],
        **kwargs
    )
