"""A real shard_server on loopback and real processes for the Python tests. Every
process is killed when its test ends; every wait has a deadline."""
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import unittest
from typing import List, Optional

ROOT = os.getcwd()  # the runfiles tree of the test (bazel test) or the repository
SITE = os.path.join(ROOT, "python", "site")
if not os.path.isdir(SITE):  # run by hand from the repository: the built package
    SITE = os.path.join(ROOT, "bazel-bin", "python", "site")
sys.path.insert(0, SITE)
PYTHON = sys.executable


def binary(path: str) -> str:
    for base in (ROOT, os.path.join(ROOT, "bazel-bin")):
        p = os.path.join(base, path)
        if os.path.exists(p):
            return p
    raise FileNotFoundError(path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, directory: str, flags: Optional[List[str]] = None) -> None:
        self.dir = directory
        self.checkpoint_root = os.path.join(directory, "checkpoints")
        port_file = os.path.join(directory, "port")
        self.log = open(os.path.join(directory, "server.log"), "w")
        self.proc = subprocess.Popen(
            [binary("shard_server/shard_server"), "--listen=127.0.0.1:0",
             f"--port_file={port_file}", f"--state_dir={directory}/state",
             f"--checkpoint_root={self.checkpoint_root}"] + (flags or []),
            stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 30
        while not os.path.exists(port_file):
            if self.proc.poll() is not None or time.time() > deadline:
                raise RuntimeError("shard_server did not start: " + self.server_log())
            time.sleep(0.02)
        with open(port_file) as f:
            self.address = "127.0.0.1:" + f.read().strip()

    def server_log(self) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()[-4000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


class Procs:
    """Child processes with their output in files."""

    def __init__(self, directory: str) -> None:
        self.dir = directory
        self.procs: List[subprocess.Popen] = []
        self.logs: List[str] = []

    def start(self, argv: List[str], name: str, env: Optional[dict] = None) -> subprocess.Popen:
        log = os.path.join(self.dir, f"{name}.log")
        e = dict(os.environ, PYTHONPATH=SITE + os.pathsep + os.environ.get("PYTHONPATH", ""),
                 PYTHONUNBUFFERED="1")
        e.update(env or {})
        with open(log, "w") as out:
            p = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=e,
                                 start_new_session=True)
        self.procs.append(p)
        self.logs.append(log)
        return p

    def output(self, i: int) -> str:
        with open(self.logs[i]) as f:
            return f.read()

    def wait_all(self, timeout: float) -> List[int]:
        deadline = time.time() + timeout
        codes = []
        for p in self.procs:
            try:
                codes.append(p.wait(max(0.1, deadline - time.time())))
            except subprocess.TimeoutExpired:
                codes.append(-1)
        return codes

    def kill_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()


class ClusterTest(unittest.TestCase):
    server_flags: List[str] = []

    def setUp(self) -> None:
        base = os.environ.get("TEST_TMPDIR") or tempfile.gettempdir()
        self.dir = tempfile.mkdtemp(prefix=self.id().rsplit(".", 1)[-1] + "-", dir=base)
        self.server = Server(self.dir, self.server_flags)
        self.procs = Procs(self.dir)

    def tearDown(self) -> None:
        self.procs.kill_all()
        self.server.stop()
        if not os.environ.get("KEEP_TMP"):
            shutil.rmtree(self.dir, ignore_errors=True)

    def run_ok(self, timeout: float) -> None:
        codes = self.procs.wait_all(timeout)
        if any(c != 0 for c in codes):
            self.fail(f"exit codes {codes}\n" + "\n".join(
                f"--- {i} ---\n{self.procs.output(i)[-3000:]}" for i in range(len(codes))) +
                "\n--- server ---\n" + self.server.server_log())
