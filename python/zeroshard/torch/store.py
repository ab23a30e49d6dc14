"""zeroshard.torch.Store: a torch.distributed.Store over the job generation's
key-value store on the shard server."""
from __future__ import annotations

from datetime import timedelta
from typing import List, Optional, Union

import torch.distributed as dist

from zeroshard.client import Client


def _seconds(timeout: Optional[timedelta], default: timedelta) -> float:
    t = default if timeout is None else timeout
    return max(t.total_seconds(), 0.001)


class Store(dist.Store):
    """torch.distributed.Store with TCPStore's semantics, kept by the shard server.

    Keys live in the job's current generation: a new generation starts empty, and a
    member of an old generation is refused (fenced) with GenerationChanged. Every call
    carries the client's bearer token and goes over its TLS channel.

    - get(key) waits up to the store's timeout for the key (DeadlineExceeded, which is
      also a TimeoutError, after); wait(keys[, timeout]) likewise for every key.
    - add(key, n) keeps a decimal integer (get returns b"3"), as TCPStore does.
    - compare_set(key, expected, desired): sets when the key holds `expected` (or is
      missing and `expected` is empty); returns what the key holds afterwards.
    - check(keys), delete_key(key), num_keys() never wait.

    Args:
        client: a zeroshard.Client that joined the job.
        timeout: the default timeout of get and wait (torch's Store.timeout).
    """

    def __init__(self, client: Client, timeout: timedelta = timedelta(seconds=300)) -> None:
        super().__init__()
        self._client = client
        client.info  # raises unless the client joined
        self.set_timeout(timeout)

    @property
    def client(self) -> Client:
        return self._client

    def set(self, key: str, value: Union[bytes, str]) -> None:
        self._client.store_set(key, value)

    def get(self, key: str) -> bytes:
        return self._client.store_get(key, _seconds(None, self.timeout))

    def add(self, key: str, value: int) -> int:
        return self._client.store_add(key, value)

    def compare_set(self, key: str, expected_value: Union[bytes, str],
                    desired_value: Union[bytes, str]) -> bytes:
        return self._client.store_compare_set(key, expected_value, desired_value)

    def wait(self, keys: List[str], timeout: Optional[timedelta] = None) -> None:
        self._client.store_wait(list(keys), _seconds(timeout, self.timeout))

    def check(self, keys: List[str]) -> bool:
        return self._client.store_check(list(keys))

    def delete_key(self, key: str) -> bool:
        return self._client.store_delete(key)

    def num_keys(self) -> int:
        return self._client.store_num_keys()
