"""Exceptions of the zeroshard package: every failed call raises a ZeroshardError
that carries the gRPC status code and the server's message.

    try:
        client.store_get("key", timeout=5)
    except zeroshard.DeadlineExceeded as e:
        print(e.code, e.message)   # "DEADLINE_EXCEEDED", "key(s) key of job 'j' not set ..."
"""
from __future__ import annotations

from typing import Dict, Type

# absl::StatusCode / grpc::StatusCode numbers (identical).
_CODE_NAMES: Dict[int, str] = {
    0: "OK", 1: "CANCELLED", 2: "UNKNOWN", 3: "INVALID_ARGUMENT", 4: "DEADLINE_EXCEEDED",
    5: "NOT_FOUND", 6: "ALREADY_EXISTS", 7: "PERMISSION_DENIED", 8: "RESOURCE_EXHAUSTED",
    9: "FAILED_PRECONDITION", 10: "ABORTED", 11: "OUT_OF_RANGE", 12: "UNIMPLEMENTED",
    13: "INTERNAL", 14: "UNAVAILABLE", 15: "DATA_LOSS", 16: "UNAUTHENTICATED",
}


class ZeroshardError(RuntimeError):
    """A zeroshard call failed. `code` is the gRPC status name, `code_value` its number."""

    code_value: int = 2

    def __init__(self, message: str, code_value: int | None = None) -> None:
        super().__init__(message)
        if code_value is not None:
            self.code_value = code_value
        self.message = message

    @property
    def code(self) -> str:
        return _CODE_NAMES.get(self.code_value, str(self.code_value))

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"


class Cancelled(ZeroshardError):
    code_value = 1


class InvalidArgument(ZeroshardError):
    code_value = 3


class DeadlineExceeded(ZeroshardError, TimeoutError):
    code_value = 4


class NotFound(ZeroshardError):
    code_value = 5


class AlreadyExists(ZeroshardError):
    code_value = 6


class PermissionDenied(ZeroshardError):
    code_value = 7


class ResourceExhausted(ZeroshardError):
    code_value = 8


class FailedPrecondition(ZeroshardError):
    code_value = 9


class Aborted(ZeroshardError):
    code_value = 10


class Internal(ZeroshardError):
    code_value = 13


class Unavailable(ZeroshardError):
    code_value = 14


class DataLoss(ZeroshardError):
    code_value = 15


class Unauthenticated(ZeroshardError):
    code_value = 16


class GenerationChanged(Aborted):
    """The job moved to a new generation: a member died or left uncleanly, or this
    member was fenced. Abort the data plane, join again and resume from the latest
    checkpoint. `generation` is the job's new generation when the server said it (else
    -1); `reason` is the server's explanation ("worker 'w1' (rank 1) stopped
    heartbeating")."""

    def __init__(self, message: str, code_value: int | None = None, generation: int = -1) -> None:
        super().__init__(message, code_value)
        self.generation = generation

    @property
    def reason(self) -> str:
        return self.message


_BY_CODE: Dict[int, Type[ZeroshardError]] = {
    cls.code_value: cls
    for cls in (Cancelled, InvalidArgument, DeadlineExceeded, NotFound, AlreadyExists,
                PermissionDenied, ResourceExhausted, FailedPrecondition, Aborted, Internal,
                Unavailable, DataLoss, Unauthenticated)
}


def _is_generation_change(code: int, message: str) -> bool:
    # The server fences a stale member with FAILED_PRECONDITION "stale generation N:
    # ... abort and join again"; held store calls of an old generation end ABORTED
    # "job 'j' moved to generation N".
    return (code == 9 and message.startswith("stale generation")) or (
        code == 10 and "moved to generation" in message)


def from_status(code: int, message: str) -> ZeroshardError:
    """The exception for a gRPC status (used by the native module)."""
    if _is_generation_change(code, message):
        return GenerationChanged(message, code)
    return _BY_CODE.get(code, ZeroshardError)(message, code)
