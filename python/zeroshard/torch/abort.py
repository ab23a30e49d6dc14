"""Aborting a Gloo process group in place, by shutting down the TCP connections it made.

torch 2.15 offers ProcessGroup.abort(), ProcessGroup.shutdown() and
distributed_c10d._abort_process_group(): with Gloo all three return at once, but a
collective blocked in a send or recv on a live peer still waits for the group's timeout
(measured 2026-11-26: three ranks, one that never enters the all-reduce; the other two
raise "Timed out waiting 25000ms" 25 s after calling each of them). Gloo's pairs are
plain TCP connections, so shutdown(SHUT_RDWR) on their sockets makes every pending and
later send/recv of this process fail at once ("Connection closed by peer"), and the
peers' reads on the other ends see end-of-file and fail too. shutdown, never close: the
pairs still own the descriptors and close them when the group is destroyed.

Which sockets: the process's established TCP connections that did not exist when the
session began (before its init_process_group), except those to the shard server (the
gRPC channel may reconnect at any time). That covers the default group, groups made
later (new_group, HSDP's mesh dimensions) and Gloo's lazy connections. A connection
the program itself opened to another service after init_process_group is shut down too.
Linux only (/proc); elsewhere nothing is shut down.
"""
from __future__ import annotations

import ipaddress
import os
import socket
import threading
from typing import FrozenSet, Iterable, Iterator, Set, Tuple

Endpoint = Tuple[ipaddress._BaseAddress, int]  # (address, port)

_TCP_ESTABLISHED = "01"  # the state column of /proc/net/tcp


def socket_inodes() -> Set[int]:
    """The inodes of this process's open sockets."""
    inodes = set()
    for fd in _open_descriptors():
        inode = _socket_inode(fd)
        if inode is not None:
            inodes.add(inode)
    return inodes


def _open_descriptors() -> Iterator[int]:
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return iter(())
    return (int(n) for n in names if n.isdigit())


def _socket_inode(fd: int) -> "int | None":
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None  # closed since the listing
    if not target.startswith("socket:["):
        return None
    return int(target[len("socket:["):-1])


def _hex_address(text: str) -> ipaddress._BaseAddress:
    """/proc/net/tcp{,6}'s address: 32-bit words in host (little-endian) byte order."""
    raw = bytes.fromhex(text)
    swapped = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    address = ipaddress.ip_address(swapped)
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def established_remotes() -> "dict[int, Endpoint]":
    """inode -> remote endpoint of every established TCP connection in this process's
    network namespace."""
    remotes = {}
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or fields[3] != _TCP_ESTABLISHED:
                continue
            host, port = fields[2].split(":")
            remotes[int(fields[9])] = (_hex_address(host), int(port, 16))
    return remotes


def server_endpoints(server: str) -> FrozenSet[Endpoint]:
    """What "HOST:PORT" resolves to (every address)."""
    host, _, port = server.rpartition(":")
    host = host.strip("[]")
    try:
        infos = socket.getaddrinfo(host, int(port), proto=socket.IPPROTO_TCP)
    except (OSError, ValueError):
        return frozenset()
    endpoints = set()
    for info in infos:
        address = ipaddress.ip_address(info[4][0].split("%")[0])
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped
        endpoints.add((address, int(port)))
    return frozenset(endpoints)


class DataPlaneConnections:
    """The TCP connections this process makes from now on, except to `keep` (the shard
    server's endpoints); shutdown() ends them in place.

    Thread-safe: shutdown() runs on the watcher thread while another is blocked in a
    collective on those connections, or on the training thread."""

    def __init__(self, keep: Iterable[Endpoint]) -> None:
        self._before = frozenset(socket_inodes())
        self._keep = frozenset(keep)
        self._lock = threading.Lock()
        # Set by shutdown(retire=True): the next generation's connections are made after
        # it, and a late call (the old watcher) must not end them.
        self._retired = False

    def shutdown(self, retire: bool = False) -> int:
        """Shuts down (SHUT_RDWR) every such connection that is still open; how many.
        With `retire`, later calls do nothing."""
        with self._lock:
            if self._retired:
                return 0
            self._retired = retire
            return self._shutdown_new_connections()

    def _shutdown_new_connections(self) -> int:
        remotes = established_remotes()
        count = 0
        for fd in _open_descriptors():
            inode = _socket_inode(fd)
            if inode is None or inode in self._before or inode not in remotes:
                continue
            if remotes[inode] in self._keep:
                continue
            if _shutdown_descriptor(fd, inode):
                count += 1
        return count


def _shutdown_descriptor(fd: int, inode: int) -> bool:
    """shutdown(SHUT_RDWR) on `fd` through a duplicate, if it still is socket `inode`
    (the number may have been closed and reused since it was listed)."""
    try:
        copy = os.dup(fd)
    except OSError:
        return False
    try:
        if os.fstat(copy).st_ino != inode:
            return False
        with socket.socket(fileno=copy) as s:
            copy = -1  # the socket object closes the duplicate, never the original
            s.shutdown(socket.SHUT_RDWR)
        return True
    except OSError:
        return False  # already shut down or reset by the peer: nothing to wake
    finally:
        if copy >= 0:
            os.close(copy)
