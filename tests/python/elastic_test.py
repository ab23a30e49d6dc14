"""Recovery inside the process with torch 2 (zt.elastic), with a real shard_server and
real processes: four FSDP2 ranks (elastic_program.py) save through DCP every 2 steps
and take an in-memory zt.Snapshot every step; the last rank stops after step 5 (its
snapshot taken; the latest checkpoint is step 4) and is killed with SIGKILL.

- With a replacement (a new process with the dead worker's id), the survivors re-join
  in their own processes; a second member (w1) dies during that recovery (inside
  `build`, the others blocked in the restore's collectives), is replaced too, and the
  job finishes at W = 4 in generation 3, restored from memory at step 5: w0 sends
  rank 3's copy to w3's replacement, w2 rank 1's to w1's.
- Without one (min_world_size 3), the survivors form a generation of 3 after the
  rejoin grace, load the step-4 checkpoint (a snapshot does not reshard) and finish
  at W = 3.

Either way every survivor exits 0 having printed the last generation's first step (the
step after the one restored), so no survivor process was restarted; the final state is
bitwise the one of a plain run (fsdp_program.py) that resumes from the step-4
checkpoint at the same world size (the same arithmetic in the same order: each step's
batch depends only on the step, the rank and the world size; step 5 from memory equals
step 5 recomputed from step 4). The process
group's timeout is torch's 30 minutes: a survivor whose collective waits on another
survivor gets out only through the bridge's abort at the server's verdict. The time from
the kill to the new generation's first step is printed."""
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
STEPS, SAVE_EVERY, SAVED, KILLED_AFTER = 8, 2, 4, 5
HEARTBEAT_TIMEOUT_S = 4
# Longer than the heartbeat timeout + a loaded machine's time from the verdict to a
# survivor's re-join (its blocked collective is aborted at the verdict).
REJOIN_GRACE_S = 10


class ElasticTest(FsdpRuns):
    server_flags = [f"--heartbeat_timeout_ms={HEARTBEAT_TIMEOUT_S * 1000}"]

    def start(self, job, out, worker, *flags):
        return self.procs.start(
            [PYTHON, PROGRAM, "--server", self.server.address, "--job", job, "--world", "4",
             "--worker_id", worker, "--root", self.server.checkpoint_root, "--dump_dir", out,
             "--width", str(WIDTH), "--layers", str(LAYERS), "--batch", str(BATCH),
             "--lr", str(LR), "--steps", str(STEPS), "--save_every", str(SAVE_EVERY),
             "--snapshot_every", "1", *flags], f"{job}-{worker}")

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

    def wait_for_file(self, path, procs, what):
        """Waits for `path` while every process of `procs` runs."""
        deadline = time.time() + 300
        while not os.path.exists(path):
            if time.time() > deadline or any(p.poll() is not None for p in procs):
                self.fail(f"{what}\n" + self.logs())
            time.sleep(0.05)

    def kill_one_of_four(self, job, *flags, replace, restored, tier, recovery_victim=None):
        """Runs the elastic job, kills w3 after step 5 (and, with
        `recovery_victim`, that worker inside the recovery's `build`, replaced at once);
        (the final full state, the survivors' last-generation first-step records, the
        kill times). The last recovery must restore step `restored` from `tier`."""
        out = os.path.join(self.dir, job)
        os.makedirs(out)
        extra = ("--recovery_victim", recovery_victim) if recovery_victim else ()
        procs = [self.start(job, out, f"w{r}", "--pause_after", str(KILLED_AFTER),
                            *extra, *flags) for r in range(4)]
        self.wait_for_file(os.path.join(out, "victim-ready"), procs, "w3 never reached step 6")
        os.killpg(procs[3].pid, signal.SIGKILL)
        killed_at = [time.time()]
        if replace:
            procs.append(self.start(job, out, "w3", *flags))
        victims = [3]
        if recovery_victim:
            v = int(recovery_victim[1:])
            living = [p for i, p in enumerate(procs) if i != 3]
            self.wait_for_file(os.path.join(out, "recovery-victim-ready"), living,
                               f"{recovery_victim} never reached the recovery's build")
            os.killpg(procs[v].pid, signal.SIGKILL)
            killed_at.append(time.time())
            procs.append(self.start(job, out, recovery_victim, *flags))
            victims.append(v)
        survivors = [i for i in range(4) if i not in victims]
        waited = [procs[i] for i in survivors + list(range(4, len(procs)))]
        codes = [p.wait(300) for p in waited]
        self.assertEqual(codes, [0] * len(waited), self.logs())
        for v in victims:
            self.assertEqual(procs[v].wait(10), -signal.SIGKILL)
        generation = 1 + len(victims)
        first = len(self.procs.procs) - len(procs)
        records = []
        for i in survivors:  # in the processes that started the job
            lines = self.json_lines(first + i)
            last = [x for x in lines if x.get("generation") == generation]
            self.assertEqual(len(last), 1, self.procs.output(first + i)[-3000:])
            self.assertEqual(last[0]["first_step"], restored + 1)
            recoveries = lines[-1]["recoveries"]
            self.assertEqual([r["generation"] for r in recoveries],
                             list(range(2, generation + 1)))
            # Only the last re-join restored; each names the member that died before it.
            self.assertEqual([r["from_step"] for r in recoveries],
                             [None] * (len(victims) - 1) + [restored])
            self.assertEqual(recoveries[-1]["tier"], tier)
            for r, v in zip(recoveries, victims):
                self.assertIn(f"worker 'w{v}' (rank {v}) stopped heartbeating", r["error"])
            records.append(dict(last[0], recoveries=recoveries))
        return torch.load(os.path.join(out, "full-final.pt")), records, killed_at

    def resumed_reference(self, job, world):
        """A plain run at `world` that resumes from the elastic job's step-4 checkpoint."""
        step_dir = os.path.join(self.server.checkpoint_root, job, f"step-{SAVED}")
        out = self.train(f"{job}-reference", world, "--dcp", "--resume", step_dir,
                         "--first_step", str(SAVED + 1), "--steps", str(STEPS),
                         "--dump_at", str(STEPS))
        return self.full(out, STEPS)

    def report(self, what, records, killed_at):
        """Prints, per kill, the time to the survivors' failed step (the verdict, and the
        abort of their blocked collectives) and to the last generation's first step."""
        for k, at in enumerate(killed_at):
            stopped = [r["recoveries"][k]["failed_at"] - at for r in records]
            print(f"{what}: kill {k + 1}: survivors' step failed after {min(stopped):.1f}-"
                  f"{max(stopped):.1f} s")
        seconds = [r["time"] - killed_at[-1] for r in records]
        print(f"{what}: last kill to generation {1 + len(killed_at)}'s first step "
              f"{min(seconds):.1f}-{max(seconds):.1f} s (heartbeat timeout "
              f"{HEARTBEAT_TIMEOUT_S} s, rejoin grace {REJOIN_GRACE_S if 'shrink' in what else 0} s)")

    def test_kill_9_of_4_fsdp2_ranks_and_another_in_the_recovery_replaced_from_memory(self):
        final, records, killed_at = self.kill_one_of_four(
            "replace", replace=True, restored=KILLED_AFTER, tier="memory", recovery_victim="w1")
        self.assertEqual([r["world_size"] for r in records], [4, 4])
        self.assert_same_state(final, self.resumed_reference("replace", 4))
        self.report("replace (second death in the recovery)", records, killed_at)

    def test_kill_9_of_4_fsdp2_ranks_without_one_shrinks_to_3_in_place(self):
        final, records, killed_at = self.kill_one_of_four(
            "shrink", "--min_world", "3", "--rejoin_grace", str(REJOIN_GRACE_S), replace=False,
            restored=SAVED, tier="disk")
        self.assertEqual([r["world_size"] for r in records], [3, 3, 3])
        self.assert_same_state(final, self.resumed_reference("shrink", 3))
        self.report("shrink", records, killed_at)


class ElasticArgumentsTest(ClusterTest):
    def test_without_an_abort_a_watchdog_before_the_collective_timeout_is_refused(self):
        # NCCL's groups are not aborted (no GPU here: a Gloo session without its abort
        # stands for one); Gloo's are, so any timeout goes.
        import dataclasses
        import zeroshard.torch as zt
        from zeroshard.torch.elastic import _check_watchdog
        s = zt.init_process_group(server=self.server.address, job="w", world_size=1,
                                  worker_id="w0", timeout=timedelta(seconds=60))
        try:
            _check_watchdog(s)
            with self.assertRaises(ValueError) as e:
                _check_watchdog(dataclasses.replace(s, connections=None))
            self.assertIn("before a collective blocked on a survivor times out (60 s, the "
                          "process group's timeout)", str(e.exception))
        finally:
            zt.shutdown()


if __name__ == "__main__":
    unittest.main(verbosity=2)
