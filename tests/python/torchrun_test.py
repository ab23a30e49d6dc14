"""python -m zeroshard.torchrun: two local agents with two workers each form one job of
four ranks through a real shard_server (torch 1.13's elastic agent)."""
import glob
import json
import os
import unittest

import harness  # noqa: F401
from harness import PYTHON, ClusterTest

HERE = os.path.dirname(os.path.abspath(__file__))


class TorchrunTest(ClusterTest):
    def test_e_two_agents_with_two_workers_each_form_one_job_of_four_ranks(self):
        out = os.path.join(self.dir, "out")
        os.makedirs(out)
        for node in ("node-b", "node-a"):  # started out of order: ranks follow the ids
            self.procs.start([PYTHON, "-m", "zeroshard.torchrun", "--nnodes=2",
                              "--nproc-per-node=2", f"--rdzv-endpoint={self.server.address}",
                              "--rdzv-id=tr", f"--rdzv-conf=node_id={node}",
                              "--max-restarts=0", "--monitor-interval=0.2",
                              os.path.join(HERE, "torchrun_worker.py"), out], node)
        self.run_ok(240)
        seen = []
        for path in sorted(glob.glob(os.path.join(out, "rank-*.json"))):
            with open(path) as f:
                seen.append(json.load(f))
        self.assertEqual(sorted(s["rank"] for s in seen), [0, 1, 2, 3])
        for s in seen:
            self.assertEqual(s["world_size"], 4)
            self.assertEqual(s["sum"], 10.0)  # 1 + 2 + 3 + 4: one process group of four
            self.assertEqual(s["rank"], s["torch_rank"])
            self.assertEqual(s["job"], "tr.workers")
            # node-a sorts first: its agent is group rank 0 and holds ranks 0 and 1.
            self.assertEqual(s["group_rank"], s["rank"] // 2)
        import zeroshard
        c = zeroshard.Client(self.server.address)
        jobs = {j["job_id"]: j for j in c.status()}
        self.assertEqual(jobs["tr"]["world_size"], 2)
        self.assertEqual(sorted(m["worker_id"] for m in jobs["tr"]["members"]),
                         ["node-a", "node-b"])
        self.assertEqual(jobs["tr.workers"]["world_size"], 4)


if __name__ == "__main__":
    unittest.main(verbosity=2)
