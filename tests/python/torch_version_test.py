"""#44 finding 10: `import zeroshard.torch` under a PyTorch older than 2 (Debian's
python3-torch is 1.13) says which torch it needs, instead of dying with a
ModuleNotFoundError deep in torch.distributed.checkpoint. Runs Debian's
/usr/bin/python3 in a subprocess; skipped where that Python has no torch 1.x."""
import os
import subprocess
import unittest

import harness

DEBIAN_PYTHON = "/usr/bin/python3"


def debian_torch_version():
    try:
        out = subprocess.run([DEBIAN_PYTHON, "-c", "import torch; print(torch.__version__)"],
                             capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


class TorchVersionTest(unittest.TestCase):
    def test_an_old_torch_is_named_with_the_version_needed(self):
        version = debian_torch_version()
        if version is None or not version.startswith("1."):
            self.skipTest(f"{DEBIAN_PYTHON} has no torch 1.x ({version})")
        env = dict(os.environ, PYTHONPATH=harness.SITE)
        run = subprocess.run([DEBIAN_PYTHON, "-c", "import zeroshard.torch"],
                             capture_output=True, text=True, env=env, timeout=120)
        self.assertNotEqual(run.returncode, 0, run.stderr)
        self.assertIn("zeroshard.torch needs PyTorch 2 or later", run.stderr)
        self.assertIn(f"torch {version}", run.stderr)
        self.assertNotIn("ModuleNotFoundError", run.stderr)


if __name__ == "__main__":
    unittest.main()
