"""Reused, page-aligned, already-faulted memory for the bytes of payload files.

A miss copies its mini-batch into a pool buffer (the one copy a durable write needs) and the writer
writes the file from there with O_DIRECT; a hit is read from disk with O_DIRECT into a pool buffer,
whose memory its tensors then view. Memory the kernel has already given the process costs nothing
to write into again, where fresh memory -- a new allocation, or the page cache a buffered write or
a memory-mapped read fills -- costs several times the copy in page faults and page allocation
(measured on a 2-core VM: a buffered 112 MiB write took 270 ms of the trainer's cores, an O_DIRECT
write of the same bytes from a reused buffer 8 ms; see scripts/bench.py).

A `Lease` is one buffer's use. It goes back to its pool when the lease *and every object made from
its memory* are gone: the buffer is exposed through one ctypes array, and a tensor made with
`torch.frombuffer` keeps that array alive; a weakref finalizer on it returns the buffer. A pool keeps
at most `max_free` idle buffers (the largest kept); `close()` drops them. Thread-safe.

`copy_into` is the copy itself: a memmove split over a few threads for large tensors (the trainer's
thread waits for it anyway, and one core alone does not saturate memory bandwidth: 8.5 ms for
112 MiB on two threads, 17.6 ms on one). Its own threads, not torch's OpenMP pool, so a process
forked from one that used torch can still write.

This module allocates and copies memory and touches no file.
"""
from __future__ import annotations

import collections
import ctypes
import mmap
import os
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any, Callable, Deque, List, Optional, Sequence, Tuple

ALIGN = 4096                    # O_DIRECT alignment of buffer addresses, offsets and lengths
_GRANULE = 1 << 20              # buffers are sized in whole MiB, so a slightly larger batch reuses one
_SPLIT_FROM = 8 << 20           # copies from this size are split over threads, in parts of at least
_PART_MIN = 4 << 20             # this size
_MAX_COPY_THREADS = 4


def round_up(n: int, to: int = ALIGN) -> int:
    return -(-n // to) * to


def _allocate(capacity: int) -> mmap.mmap:
    """Anonymous memory of `capacity` bytes, page aligned, in huge pages where the kernel gives them
    (hashing a 112 MiB batch took 6.5 ms in huge pages, 10 ms in 4 KiB pages), faulted in now rather
    than at the first copy."""
    mm = mmap.mmap(-1, capacity, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    huge = getattr(mmap, "MADV_HUGEPAGE", None)
    if huge is not None:
        try:
            mm.madvise(huge)
        except OSError:
            pass                                      # no transparent huge pages here: 4 KiB pages
    view = (ctypes.c_char * capacity).from_buffer(mm)
    ctypes.memset(ctypes.addressof(view), 0, capacity)
    del view
    return mm


class Lease:
    """One pool buffer in use: `array` (a ctypes char array over the whole buffer, for
    `torch.frombuffer` and memoryviews) and `capacity` (bytes, a multiple of ALIGN)."""

    __slots__ = ("array", "capacity", "__weakref__")

    def __init__(self, array: ctypes.Array, capacity: int):
        self.array: Optional[ctypes.Array] = array
        self.capacity = capacity

    def view(self, nbytes: Optional[int] = None) -> memoryview:
        if self.array is None:
            raise ValueError("lease already released")
        mv = memoryview(self.array).cast("B")
        return mv if nbytes is None else mv[:nbytes]

    def release(self) -> None:
        """Give up this lease's hold; the buffer returns once nothing made from it is alive either."""
        self.array = None


class BufferPool:
    """Idle buffers for reuse, at most `max_free` of them."""

    def __init__(self, max_free: int = 2):
        self.max_free = max(0, int(max_free))
        self._free: List[mmap.mmap] = []
        # Buffers given back by finalizers, which run on any thread and even inside a garbage collection
        # in the middle of `acquire`: they only append here (atomic), the lock holder sorts them in.
        self._returned: Deque[mmap.mmap] = collections.deque()
        self._lock = threading.Lock()
        self._closed = False
        self.allocated = 0          # buffers ever allocated (a test and the bench read it)
        self.copier = Copier()

    def acquire(self, nbytes: int) -> Lease:
        """A lease on a buffer of at least `nbytes` (rounded up to ALIGN; at least ALIGN)."""
        need = round_up(max(1, nbytes))
        with self._lock:
            self._take_returned()
            fits = [m for m in self._free if len(m) >= need]
            mm = min(fits, key=len) if fits else None
            if mm is not None:
                self._free.remove(mm)
        if mm is None:
            mm = _allocate(round_up(need, _GRANULE))
            with self._lock:
                self.allocated += 1
        array = (ctypes.c_char * len(mm)).from_buffer(mm)
        weakref.finalize(array, self._give_back, mm)
        return Lease(array, len(mm))

    def _give_back(self, mm: mmap.mmap) -> None:
        if not self._closed:
            self._returned.append(mm)

    def _take_returned(self) -> None:
        """Under the lock: returned buffers become idle ones, the smallest dropped beyond max_free (their
        memory is unmapped when the last reference goes)."""
        while self._returned:
            self._free.append(self._returned.popleft())
        if len(self._free) > self.max_free:
            self._free.sort(key=len)
            del self._free[:len(self._free) - self.max_free]

    @property
    def idle(self) -> int:
        with self._lock:
            self._take_returned()
            return len(self._free)

    def close(self) -> None:
        """Drop the idle buffers; buffers still leased are freed when their last user goes."""
        with self._lock:
            self._closed = True
            self._free.clear()
            self._returned.clear()
        self.copier.close()


def _drain(take: Callable[[], Tuple[int, int, int]]) -> None:
    """memmove the parts `take` gives (deque.popleft or pop: atomic, shared by two threads) until none."""
    while True:
        try:
            dst, src, nbytes = take()
        except IndexError:
            return
        ctypes.memmove(dst, src, nbytes)


def _wait_all(futures: Sequence[Any]) -> None:
    """Wait for `futures` -- even when this thread is interrupted (Ctrl-C) while waiting: a helper may
    hold only a buffer's address, so every part must have landed before the caller may release it."""
    interrupted: Optional[BaseException] = None
    while True:
        try:
            wait(futures)
            break
        except BaseException as exc:
            interrupted = exc
    if interrupted is not None:
        raise interrupted


class Copier:
    """memmove on the caller's thread plus up to three helper threads (lazily started, restarted in a
    forked child, stopped by `close`)."""

    def __init__(self, threads: Optional[int] = None):
        if threads is None:
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
            threads = min(cores, _MAX_COPY_THREADS)
        self.threads = max(1, threads)
        self._pool: Optional[ThreadPoolExecutor] = None
        self._pid = os.getpid()
        self._lock = threading.Lock()

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        """Copy `nbytes` from address `src` to address `dst` (regions that do not overlap)."""
        parts = min(self.threads, nbytes // _PART_MIN) if nbytes >= _SPLIT_FROM else 1
        if parts <= 1:
            ctypes.memmove(dst, src, nbytes)
            return
        pool = self._helpers()
        size = -(-nbytes // parts)
        futures: List[Any] = []
        try:              # submitted inside: an interrupt between a submit and the wait still waits for it
            for i in range(1, parts):
                futures.append(pool.submit(ctypes.memmove, dst + i * size, src + i * size, min(size, nbytes - i * size)))
            ctypes.memmove(dst, src, size)
        finally:
            _wait_all(futures)

    def copy_hashed(self, copies: Sequence[Tuple[int, int, int]], pieces: Sequence[Any], hasher: Any) -> str:
        """Run `copies` ((dst, src, nbytes), regions that do not overlap) and hash `pieces` (buffers, in
        order, that hold their bytes already) with `hasher` (an incremental hash: update, hexdigest) at
        once; returns the hex digest. A helper thread hashes while this thread copies, then takes copy
        work (parts of at least 4 MiB) from the far end of what is left; on one core, or for a small
        copy, one after the other. Hashing the source while it is copied instead of the copy after it:
        the two share the memory bus, not the time (issue 42: a GRPO miss's trainer-thread time)."""
        total = sum(n for _d, _s, n in copies)
        if self.threads <= 1 or total < _SPLIT_FROM:
            for dst, src, nbytes in copies:
                ctypes.memmove(dst, src, nbytes)
            for piece in pieces:
                hasher.update(piece)
            return hasher.hexdigest()
        parts: Deque[Tuple[int, int, int]] = collections.deque()
        for dst, src, nbytes in copies:
            for at in range(0, nbytes, _PART_MIN):
                parts.append((dst + at, src + at, min(_PART_MIN, nbytes - at)))

        def helper() -> str:
            for piece in pieces:
                hasher.update(piece)
            digest = hasher.hexdigest()
            _drain(parts.pop)
            return digest

        futures: List[Any] = []
        try:
            futures.append(self._helpers().submit(helper))
            _drain(parts.popleft)
        finally:
            _wait_all(futures)        # as in `copy`: every part landed before the caller may go on
        return futures[0].result()

    def _helpers(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None or self._pid != os.getpid():
                self._pool = ThreadPoolExecutor(self.threads - 1, thread_name_prefix="skip_harness-copy")
                self._pid = os.getpid()
            return self._pool

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None and self._pid == os.getpid():
            pool.shutdown(wait=True)
