"""Recovery inside the process with torch 2 (zt.elastic), with a real shard_server and
real processes: four FSDP2 ranks (elastic_program.py) save through DCP every 2 steps;
the last rank stops after step 4's save and is killed with SIGKILL.

- With a replacement (a new process with the dead worker's id), the three survivors
  re-join in their own processes and the job finishes at W = 4.
- Without one (min_world_size 3), the survivors form a generation of 3 after the
  rejoin grace and finish at W = 3.

Either way every survivor exits 0 having printed generation 2's first step (step 5: the
latest complete checkpoint was step 4), so no survivor process was restarted; the final
state is bitwise the one of a plain run (fsdp_program.py) that resumes from the same
step-4 checkpoint at the same world size (the same arithmetic in the same order: each
step's batch depends only on the step, the rank and the world size). The time from the
kill to generation 2's first step is printed."""
import json
import os
import signal
import time
import unittest

from datetime import timedelta

import harness  # noqa: F401 (puts the built package on sys.path)
from harness import PYTHON, ClusterTest

import torch

from fsdp_test import BATCH, LAYERS, LR, WIDTH, FsdpRuns

HERE = os.path.dirname(os.path.abspath(__file__))
PROGRAM = os.path.join(HERE, "elastic_program.py")
STEPS, SAVE_EVERY, KILLED_AFTER = 8, 2, 4
HEARTBEAT_TIMEOUT_S = 4
# A rank whose Gloo collective waits on a survivor rather than on the dead peer learns of
# the death only when the collective times out (torch 2.15's Gloo cannot be aborted).
COLLECTIVE_TIMEOUT_S = 15
# Longer than the heartbeat timeout + the collective timeout: the last survivor re-joins
# only after its collective timed out.
REJOIN_GRACE_S = 25


class ElasticTest(FsdpRuns):
    server_flags = [f"--heartbeat_timeout_ms={HEARTBEAT_TIMEOUT_S * 1000}"]

    def start(self, job, out, worker, *flags):
        return self.procs.start(
            [PYTHON, PROGRAM, "--server", self.server.address, "--job", job, "--world", "4",
             "--worker_id", worker, "--root", self.server.checkpoint_root, "--dump_dir", out,
             "--width", str(WIDTH), "--layers", str(LAYERS), "--batch", str(BATCH),
             "--lr", str(LR), "--steps", str(STEPS), "--save_every", str(SAVE_EVERY),
             "--collective_timeout", str(COLLECTIVE_TIMEOUT_S), *flags], f"{job}-{worker}")

    def logs(self):
        return "\n".join(f"--- {i} ---\n{self.procs.output(i)[-3000:]}"
                         for i in range(len(self.procs.procs))) + \
            "\n--- server ---\n" + self.server.server_log()

    def json_lines(self, i):
        lines = []
        for line in self.procs.output(i).splitlines():
            if line.startswith("{"):
                lines.append(json.loads(line))
        return lines

    def kill_one_of_four(self, job, *flags, replace):
        """Runs the elastic job, kills w3 after step 4's save; (the final full state,
        the survivors' generation-2 first-step records, the kill time)."""
        out = os.path.join(self.dir, job)
        os.makedirs(out)
        procs = [self.start(job, out, f"w{r}", "--pause_after_save", str(KILLED_AFTER), *flags)
                 for r in range(4)]
        ready = os.path.join(out, "victim-ready")
        deadline = time.time() + 300
        while not os.path.exists(ready):
            if time.time() > deadline or any(p.poll() is not None for p in procs):
                self.fail("w3 never reached step 5\n" + self.logs())
            time.sleep(0.05)
        os.killpg(procs[3].pid, signal.SIGKILL)
        killed_at = time.time()
        if replace:
            procs.append(self.start(job, out, "w3", *flags))
        waited = [procs[i] for i in (0, 1, 2) + ((4,) if replace else ())]
        codes = [p.wait(300) for p in waited]
        self.assertEqual(codes, [0] * len(waited), self.logs())
        self.assertEqual(procs[3].wait(10), -signal.SIGKILL)
        first = len(self.procs.procs) - len(procs)
        records = []
        for i in (0, 1, 2):  # the survivors, in the processes that started the job
            lines = self.json_lines(first + i)
            gen2 = [x for x in lines if x.get("generation") == 2]
            self.assertEqual(len(gen2), 1, self.procs.output(first + i)[-3000:])
            self.assertEqual(gen2[0]["first_step"], KILLED_AFTER + 1)
            (recovery,) = lines[-1]["recoveries"]
            self.assertEqual(recovery["from_step"], KILLED_AFTER)
            self.assertIn("worker 'w3' (rank 3) stopped heartbeating", recovery["error"])
            records.append(gen2[0])
        return torch.load(os.path.join(out, "full-final.pt")), records, killed_at

    def resumed_reference(self, job, world):
        """A plain run at `world` that resumes from the elastic job's step-4 checkpoint."""
        step_dir = os.path.join(self.server.checkpoint_root, job, f"step-{KILLED_AFTER}")
        out = self.train(f"{job}-reference", world, "--dcp", "--resume", step_dir,
                         "--first_step", str(KILLED_AFTER + 1), "--steps", str(STEPS),
                         "--dump_at", str(STEPS))
        return self.full(out, STEPS)

    def report(self, what, records, killed_at):
        seconds = [r["time"] - killed_at for r in records]
        print(f"{what}: kill -9 to generation 2's first step {min(seconds):.1f}-"
              f"{max(seconds):.1f} s (heartbeat timeout {HEARTBEAT_TIMEOUT_S} s, collective "
              f"timeout {COLLECTIVE_TIMEOUT_S} s, rejoin grace "
              f"{REJOIN_GRACE_S if 'shrink' in what else 0} s)")

    def test_kill_9_of_4_fsdp2_ranks_with_a_replacement_finishes_at_4_in_place(self):
        final, records, killed_at = self.kill_one_of_four("replace", replace=True)
        self.assertEqual([r["world_size"] for r in records], [4, 4, 4])
        self.assert_same_state(final, self.resumed_reference("replace", 4))
        self.report("replace", records, killed_at)

    def test_kill_9_of_4_fsdp2_ranks_without_one_shrinks_to_3_in_place(self):
        final, records, killed_at = self.kill_one_of_four(
            "shrink", "--min_world", "3", "--rejoin_grace", str(REJOIN_GRACE_S), replace=False)
        self.assertEqual([r["world_size"] for r in records], [3, 3, 3])
        self.assert_same_state(final, self.resumed_reference("shrink", 3))
        self.report("shrink", records, killed_at)


class ElasticArgumentsTest(ClusterTest):
    def test_a_watchdog_that_would_fire_before_the_collective_timeout_is_refused(self):
        import zeroshard.torch as zt
        zt.init_process_group(server=self.server.address, job="w", world_size=1,
                              worker_id="w0", timeout=timedelta(seconds=60))
        try:
            state = zt.ElasticState(lambda s: (None, None), root=self.dir, save_every=1)
            with self.assertRaises(ValueError) as e:
                next(zt.elastic(range(3), state=state))
            self.assertIn("before a collective blocked on a survivor times out (60 s, the "
                          "process group's timeout)", str(e.exception))
        finally:
            zt.shutdown()


if __name__ == "__main__":
    unittest.main(verbosity=2)
