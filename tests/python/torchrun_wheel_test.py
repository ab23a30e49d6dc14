"""torch 2's own torchrun with the zeroshard wheel installed: `torchrun
--rdzv-backend=zeroshard` finds the handler through the wheel's torchrun.handlers entry
point, and two agents with two workers each form one job of four ranks through a real
shard_server. The wheel is installed with pip (no index, no network) into a directory
that is the workers' only path to zeroshard."""
import glob
import json
import os
import subprocess
import unittest

import harness
from harness import PYTHON, ClusterTest

HERE = os.path.dirname(os.path.abspath(__file__))


def wheel() -> str:
    found = glob.glob(os.path.join(harness.ROOT, "python", "zeroshard-*.whl")) or glob.glob(
        os.path.join(harness.ROOT, "bazel-bin", "python", "zeroshard-*.whl"))
    if not found:
        raise FileNotFoundError("zeroshard-*.whl: bazel build //python:wheel")
    return found[0]


class TorchrunWheelTest(ClusterTest):
    def test_torchrun_rdzv_backend_zeroshard_forms_one_job_of_four_from_two_agents(self):
        target = os.path.join(self.dir, "site")
        r = subprocess.run([PYTHON, "-m", "pip", "install", "--no-index", "--no-deps",
                            "--quiet", "--target", target, wheel()],
                           capture_output=True, text=True, timeout=120)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertTrue(glob.glob(os.path.join(target, "zeroshard-*.dist-info",
                                               "entry_points.txt")))
        out = os.path.join(self.dir, "out")
        os.makedirs(out)
        for node in ("node-b", "node-a"):  # started out of order: ranks follow the ids
            self.procs.start([PYTHON, "-m", "torch.distributed.run", "--nnodes=2",
                              "--nproc-per-node=2", "--rdzv-backend=zeroshard",
                              f"--rdzv-endpoint={self.server.address}", "--rdzv-id=tr",
                              f"--rdzv-conf=node_id={node}", "--max-restarts=0",
                              "--monitor-interval=0.2",
                              os.path.join(HERE, "torchrun_worker.py"), out], node,
                             env={"PYTHONPATH": target})
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
            self.assertEqual(s["group_rank"], s["rank"] // 2)  # node-a sorts first
            self.assertTrue(s["zeroshard_file"].startswith(target), s["zeroshard_file"])


if __name__ == "__main__":
    unittest.main(verbosity=2)
