"""FSDP2 (torch 2, fully_shard, DTensor) checkpoints through zt.save and `shardctl
consolidate`, with a real shard_server and real processes: a 1-D mesh at W = 2 and
HSDP's 2x2 mesh at W = 4 train 5 steps and save; the consolidated file is bitwise the
full state dict torch gathers (get_model_state_dict / get_optimizer_state_dict with
full_state_dict=True); loaded at W = 1 (from the step's shard files) and W = 3 (from
the consolidated file) the state is bitwise what was saved, and step 6 is the
uninterrupted run's within fsdp_error_model's bound."""
import os
import struct
import subprocess
import unittest

import harness  # noqa: F401 (puts the built package on sys.path)
from harness import PYTHON, ClusterTest, binary

import torch
from safetensors.torch import load_file

import fsdp_error_model as em
from fsdp_program import local_batch

HERE = os.path.dirname(os.path.abspath(__file__))
PROGRAM = os.path.join(HERE, "fsdp_program.py")
WIDTH, LAYERS, BATCH, LR, SAVE_AT = 40, 3, 12, 0.01, 5


class FsdpRuns(ClusterTest):
    """Runs of fsdp_program.py and the checks on them (no tests of its own: dcp_test
    uses it too)."""
    # Not about failure detection: a slow start on a loaded 2-core machine (3-4 processes
    # importing torch) must not end a generation.
    server_flags = ["--heartbeat_timeout_ms=20000"]

    def train(self, job, world, *flags, mesh=""):
        out = os.path.join(self.dir, job)
        os.makedirs(out)
        first = len(self.procs.procs)
        for r in range(world):
            self.procs.start([PYTHON, PROGRAM, "--server", self.server.address, "--job", job,
                              "--world", str(world), "--worker_id", f"w{r}", "--mesh", mesh,
                              "--width", str(WIDTH), "--layers", str(LAYERS),
                              "--batch", str(BATCH), "--lr", str(LR), "--dump_dir", out,
                              *flags], f"{job}-{r}")
        codes = [p.wait(240) for p in self.procs.procs[first:]]
        self.assertEqual(codes, [0] * world, "\n".join(
            self.procs.output(i)[-3000:] for i in range(first, len(self.procs.procs))) +
            "\n--- server ---\n" + self.server.server_log())
        return out

    def full(self, out, step):
        return torch.load(os.path.join(out, f"full-{step}.pt"))

    def assert_same_state(self, got, want):
        self.assertEqual(sorted(got["model"]), sorted(want["model"]))
        for k, v in want["model"].items():
            self.assertTrue(torch.equal(got["model"][k], v), k)
        for k, st in want["optim"]["state"].items():
            for m in ("exp_avg", "exp_avg_sq", "step"):
                self.assertTrue(torch.equal(got["optim"]["state"][k][m], st[m]), (k, m))

    def assert_next_step_within_bound(self, got6, ref5, ref6, world):
        """Step 6 of a resumed run against the uninterrupted one (fsdp_error_model)."""
        x, y = local_batch(SAVE_AT + 1, 0, 1, BATCH, WIDTH)
        sd5 = {k: v.double() for k, v in ref5["model"].items()}
        params = [(sd5[f"{k}.weight"], sd5[f"{k}.bias"]) for k in range(LAYERS)]
        s = em.abs_gradient(params, x.double(), y.double())
        m = em.chain_length(LAYERS, WIDTH, BATCH, max(world, 4))
        worst = 0.0
        for k in range(LAYERS):
            for j, kind in enumerate(("weight", "bias")):
                name = f"{k}.{kind}"
                st5, st6 = ref5["optim"]["state"][name], ref6["optim"]["state"][name]
                m5, v5 = st5["exp_avg"].double(), st5["exp_avg_sq"].double()
                g = (st6["exp_avg"].double() - 0.9 * m5) / 0.1
                bound = em.adam_step_bound(sd5[name], m5, v5, g, s[k][j], m, SAVE_AT + 1, LR)
                diff = (got6["model"][name].double() - ref6["model"][name].double()).abs()
                self.assertTrue(bool((diff <= bound).all()),
                                f"{name}: {float(diff.max())} > bound at its element")
                worst = max(worst, float((diff / bound).max()))
        print(f"step 6 at W={world}: largest |difference| / bound = {worst:.3g}")

    def consolidate(self, job, *flags, name=""):
        out = os.path.join(self.dir, name or f"{job}.safetensors")
        r = subprocess.run([binary("client/shardctl"), f"--server={self.server.address}",
                            "consolidate", f"--job={job}", f"--step={SAVE_AT}", f"--out={out}",
                            *flags], capture_output=True, text=True, timeout=60)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        return out

    def assert_consolidated_is_the_full_state(self, consolidated, ref5):
        for k, v in ref5["model"].items():
            self.assertTrue(torch.equal(consolidated[k], v), k)
        for k, st in ref5["optim"]["state"].items():
            self.assertTrue(torch.equal(consolidated["optim.exp_avg." + k], st["exp_avg"]), k)
            self.assertTrue(torch.equal(consolidated["optim.exp_avg_sq." + k], st["exp_avg_sq"]))

    def assert_local_shards_only(self, job, ref5):
        step_dir = os.path.join(self.server.checkpoint_root, job, f"step-{SAVE_AT}")
        data = []  # tensor bytes of each file: its size less the safetensors header
        for f in os.listdir(step_dir):
            if f.startswith("rank-"):
                with open(os.path.join(step_dir, f), "rb") as fh:
                    header = 8 + struct.unpack("<Q", fh.read(8))[0]
                data.append(os.path.getsize(os.path.join(step_dir, f)) - header)
        # Local shards only: each file holds half of the weights and moments (the shard
        # group has 2 ranks: 20 of 40 rows each), never the gathered 3 * model bytes.
        model_bytes = 4 * sum(v.numel() for v in ref5["model"].values())
        self.assertLessEqual(max(data), 3 * model_bytes // 2)
        return step_dir

    def resume_and_check(self, job, new_world, source, ref5, ref6, *flags):
        got = self.train(f"{job}-at-{new_world}", new_world, "--resume", source,
                         "--first_step", str(SAVE_AT + 1), "--steps", str(SAVE_AT + 1),
                         "--dump_at", str(SAVE_AT), "--dump_at", str(SAVE_AT + 1), *flags)
        self.assert_same_state(self.full(got, SAVE_AT), ref5)
        self.assert_next_step_within_bound(self.full(got, SAVE_AT + 1), ref5, ref6, new_world)

    def reference(self, job, world, mesh, *flags):
        ref = self.train(job, world, "--steps", str(SAVE_AT + 1), "--save_at", str(SAVE_AT),
                         "--dump_at", str(SAVE_AT), "--dump_at", str(SAVE_AT + 1), *flags,
                         mesh=mesh)
        return self.full(ref, SAVE_AT), self.full(ref, SAVE_AT + 1)


class Fsdp2CheckpointTest(FsdpRuns):
    def check_mesh(self, job, world, mesh):
        ref5, ref6 = self.reference(job, world, mesh)
        step_dir = self.assert_local_shards_only(job, ref5)
        self.assert_consolidated_is_the_full_state(load_file(self.consolidate(job)), ref5)
        for new_world, source in ((1, step_dir), (3, os.path.join(self.dir, f"{job}.safetensors"))):
            self.resume_and_check(job, new_world, source, ref5, ref6)

    def test_fsdp2_on_a_1d_mesh_of_2_saves_local_shards_and_resumes_at_1_and_3(self):
        self.check_mesh("fsdp", 2, "")

    def test_hsdp_on_a_2x2_mesh_saves_one_replica_and_resumes_at_1_and_3(self):
        self.check_mesh("hsdp", 4, "2x2")
        step_dir = os.path.join(self.server.checkpoint_root, "hsdp", f"step-{SAVE_AT}")
        # The second replica (ranks 2, 3) writes empty files: nothing is written twice.
        for r in (2, 3):
            self.assertEqual(load_file(os.path.join(step_dir, f"rank-{r}-of-4.safetensors")), {})


if __name__ == "__main__":
    unittest.main(verbosity=2)
