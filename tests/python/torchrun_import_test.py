"""#44 finding 10: with the zeroshard wheel installed, torch loads the wheel's
torchrun.handlers entry point while it imports torch.distributed.elastic.rendezvous,
which importing torch.distributed.checkpoint does. Loading the handler must not
import zeroshard.torch (which imports torch.distributed.checkpoint, then half
imported): before the fix, `import torch.distributed.checkpoint` logged a
circular-import traceback and the "zeroshard" rendezvous backend was not registered.
Each import order runs in a fresh interpreter with the wheel as its only zeroshard."""
import glob
import os
import subprocess
import tempfile
import unittest

import harness
from harness import PYTHON


def wheel() -> str:
    found = glob.glob(os.path.join(harness.ROOT, "python", "zeroshard-*.whl")) or glob.glob(
        os.path.join(harness.ROOT, "bazel-bin", "python", "zeroshard-*.whl"))
    if not found:
        raise FileNotFoundError("zeroshard-*.whl: bazel build //python:wheel")
    return found[0]


CHECK = """
import {first}
import zeroshard.torch
from torch.distributed.elastic.rendezvous import rendezvous_handler_registry as registry
print("registered" if "zeroshard" in registry._registry else "missing")
"""


class TorchrunImportTest(unittest.TestCase):
    def test_the_handler_is_registered_whatever_is_imported_first(self):
        with tempfile.TemporaryDirectory() as tmp:
            target = os.path.join(tmp, "site")
            r = subprocess.run([PYTHON, "-m", "pip", "install", "--no-index", "--no-deps",
                                "--quiet", "--target", target, wheel()],
                               capture_output=True, text=True, timeout=120)
            self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
            env = dict(os.environ, PYTHONPATH=target)
            for first in ("torch.distributed.checkpoint", "torch.distributed.elastic.rendezvous",
                          "zeroshard.torch", "zeroshard"):
                with self.subTest(first=first):
                    run = subprocess.run([PYTHON, "-c", CHECK.format(first=first)], env=env,
                                         capture_output=True, text=True, timeout=300, cwd=tmp)
                    self.assertEqual(run.returncode, 0, run.stderr)
                    self.assertEqual(run.stdout.strip(), "registered", run.stderr)
                    self.assertNotIn("Traceback", run.stderr)
                    self.assertNotIn("circular import", run.stderr)


if __name__ == "__main__":
    unittest.main()
