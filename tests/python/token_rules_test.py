"""The Python bridge follows shard_worker's token rules (#29 items 4 and 8): a token
file every user may read, or a short token, is refused unless insecure=True; a token
to a server that is not on loopback without TLS is refused unless insecure=True. No
server is needed: the rules apply before the first call."""
import os
import tempfile
import unittest

import harness  # noqa: F401 (puts the built package on the path)
import zeroshard
from zeroshard import errors

TOKEN = "a-long-enough-token-0123456789"
REMOTE = "10.255.255.1:7070"  # not loopback; never contacted


class TokenRulesTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp()

    def token_file(self, name, contents, mode):
        path = os.path.join(self.dir, name)
        with open(path, "w") as f:
            f.write(contents + "\n")
        os.chmod(path, mode)
        return path

    def test_a_token_without_tls_to_a_remote_server_needs_insecure(self):
        with self.assertRaises(errors.InvalidArgument) as refused:
            zeroshard.Client(REMOTE, token=TOKEN)
        self.assertIn("TLS", str(refused.exception))
        zeroshard.Client(REMOTE, token=TOKEN, insecure=True)
        zeroshard.Client("127.0.0.1:7070", token=TOKEN)  # loopback: never on the network
        zeroshard.Client(REMOTE)  # no token, nothing to leak

    def test_a_world_readable_or_short_token_file_needs_insecure(self):
        readable = self.token_file("readable", TOKEN, 0o644)
        with self.assertRaises(errors.InvalidArgument) as refused:
            zeroshard.Client("127.0.0.1:7070", token_file=readable)
        self.assertIn("readable by every user", str(refused.exception))
        short = self.token_file("short", "s3cret", 0o600)
        with self.assertRaises(errors.InvalidArgument) as refused:
            zeroshard.Client("127.0.0.1:7070", token_file=short)
        self.assertIn("6-character token", str(refused.exception))
        zeroshard.Client("127.0.0.1:7070", token_file=readable, insecure=True)
        zeroshard.Client("127.0.0.1:7070", token_file=short, insecure=True)
        good = self.token_file("good", TOKEN, 0o600)
        zeroshard.Client("127.0.0.1:7070", token_file=good)


if __name__ == "__main__":
    unittest.main()
