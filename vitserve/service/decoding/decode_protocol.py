"""The records between the server and a decode worker (decode_pool.py), and their frames on the worker's socket.

A job goes out as a `Call` record (pickled) followed by its payload's bytes as they are (pickling 900 KB of image
would copy it once more on the event loop); the worker answers one `JobResult` (pickled). Frames: a job is
`!II` (the call's size, the payload's) then both; an answer is `!I` then the result."""

from __future__ import annotations

import pickle
import socket
import struct
from dataclasses import dataclass
from typing import Any, Callable

from ..ground.errors import ErrorRecord

JOB_HEADER = struct.Struct("!II")  # the call's size, the payload's size
ANSWER_HEADER = struct.Struct("!I")  # the result's size


@dataclass(frozen=True)
class Call:
    """Server -> worker: run fn(payload, *args). A payload that describes where the worker finds the bytes itself
    (media.MediaHandle: a body file's pages) rides in the record (`inline`); bytes follow the record as they are."""

    fn: Callable
    args: tuple
    payload: Any = None
    inline: bool = False

    def run(self, data: bytes) -> JobResult:
        """The call's result on `data` (the bytes that followed it), or the error it raised."""
        try:
            return JobResult(self.fn(self.payload if self.inline else data, *self.args))
        except Exception as e:
            return JobResult(error=ErrorRecord.of(e))


@dataclass(frozen=True)
class JobResult:
    """Worker -> server: what a job returned (`value`), or the error it raised (`error`)."""

    value: Any = None
    error: ErrorRecord | None = None

    def frame(self) -> bytes:
        """The answer's frame; a value that does not pickle is answered as that error."""
        try:
            data = pickle.dumps(self, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:
            data = pickle.dumps(JobResult(error=ErrorRecord.of(e)), protocol=pickle.HIGHEST_PROTOCOL)
        return ANSWER_HEADER.pack(len(data)) + data


def read_exactly(sock: socket.socket, n: int) -> bytes:
    """`n` bytes from a blocking socket (EOFError where it hangs up first)."""
    chunks = []
    while n:
        chunk = sock.recv(n, socket.MSG_WAITALL)
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks) if len(chunks) != 1 else chunks[0]


def read_job(sock: socket.socket) -> tuple[Call, bytes]:
    """A worker's next job: its Call and the payload's bytes (EOFError or OSError: the server hung up)."""
    call_size, payload_size = JOB_HEADER.unpack(read_exactly(sock, JOB_HEADER.size))
    call = pickle.loads(read_exactly(sock, call_size))
    return call, read_exactly(sock, payload_size)


def job_frames(call: bytes, payload) -> list:
    """A job's frames as the server writes them: the header, the pickled Call, the payload's bytes."""
    return [JOB_HEADER.pack(len(call), len(payload)), call, payload]
