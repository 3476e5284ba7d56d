"""The miss's protocol floor (issue 42): what SPEC's commit asks of any implementation, done bare.

The durable-copy floor (`_bench_steps.FloorArm`) writes one file a step and fsyncs it. SPEC's commit asks
more of every implementation, ours or another: for a K = 1, W = 1 step, the step's directory made and
made durable in its parent; the payload under a temporary name, made durable, renamed into place; its
meta.json the same way; the step's directory made durable (both renames before the record); the commit
record the same way; the directory made durable again -- three files and a directory a step, six fsyncs
against the floor's one. `ProtocolFloorArm` does exactly that with plain `os` calls on the floor's writer
thread: no checksum, no index line, no layers. So the miss against it is what the harness's own code
costs, and it against the floor is what the contract costs on this disk (`protocol_floor_vs_floor_ratio`
in scripts/_bench_grpo.py).
"""
from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path
from typing import Any

from _bench_steps import FloorArm

from skip_harness.store.bufferpool import ALIGN

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC


def _small(dir_fd: int, name: str, doc: Any) -> None:
    """A small file durably in place: a temporary name, written, fsynced, renamed."""
    tmp = f".tmp-{name}"
    fd = os.open(tmp, _NEW, 0o644, dir_fd=dir_fd)
    try:
        os.write(fd, (json.dumps(doc, indent=1) + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)


class ProtocolFloorArm(FloorArm):
    """The floor arm with SPEC's commit protocol around its write (the module's docstring). Plain payloads
    only. Labelled `floor_protocol` in the results."""

    mode = "floor_protocol"

    def __init__(self, payload: Any, dump_dir: Path):
        super().__init__(payload, dump_dir)
        self.root_fd = os.open(self.dir, _DIR)

    def _write(self, lease: Any, step: int) -> None:
        nbytes, name = self.nbytes, str(step)
        try:
            os.mkdir(name, dir_fd=self.root_fd)
            os.fsync(self.root_fd)
            step_fd = os.open(name, _DIR, dir_fd=self.root_fd)
            fd = os.open(".tmp-tq_batch.pt", _NEW | getattr(os, "O_DIRECT", 0), 0o644, dir_fd=step_fd)
            try:
                view, end, done = lease.view(), nbytes - nbytes % ALIGN, 0
                while done < end:                 # whole blocks straight from the buffer, the tail cached
                    done += os.pwrite(fd, view[done:end], done)
                fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~getattr(os, "O_DIRECT", 0))
                while done < nbytes:
                    done += os.pwrite(fd, view[done:nbytes], done)
                os.fsync(fd)
            finally:
                os.close(fd)
        finally:
            lease.release()
        os.rename(".tmp-tq_batch.pt", "tq_batch.pt", src_dir_fd=step_fd, dst_dir_fd=step_fd)
        _small(step_fd, "meta.json", {"step": step, "inner_index": 0, "rank": 0, "K": 1, "W": 1, "bytes": nbytes,
                                      "checksum": "0" * 32, "payload": "tq_batch.pt", "format": 1})
        os.fsync(step_fd)
        _small(step_fd, "commit.json", {"format": 1, "step": step, "K": 1, "W": 1, "files": [
            {"rel": "meta.json", "bytes": 0, "xxh3_128": "0" * 32},
            {"rel": "tq_batch.pt", "bytes": nbytes, "xxh3_128": "0" * 32}]})
        os.fsync(step_fd)
        os.close(step_fd)
        self.written += 1

    def close(self, steps: int) -> None:
        os.close(self.root_fd)
        super().close(steps)
