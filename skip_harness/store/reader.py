"""Reading a namespace's steps: the one verified read path, and the one verify.

A committed step is read through the namespace's backend against its commit record: each payload
read once (O_DIRECT into a pool buffer on POSIX, or mapped), its size and checksum checked in the pass
that reads it, its tensors views of that buffer. A hit (`read_served`), `merged` (`read_step`),
`show`, `export` (`read_inner`) and `verify` all read this way. A step without a commit record (an
older cache) is loaded as it is, its files read whole through the backend too (nothing here opens a
file by its path). Meta files are read through the backend as well.

This module does no logging: it raises or returns, and the harness reports. `StepReader` holds no
mutable state but its (thread-safe) buffer pool, so a prefetch thread may read and verify steps
while the writer writes others.
"""
from __future__ import annotations

import contextlib
import functools
import json
from pathlib import Path, PurePosixPath
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple, TypeVar, Union

from skip_harness import codec
from skip_harness.errors import CorruptStepError
from skip_harness.store.bufferpool import BufferPool, Lease
from skip_harness.store.checksum import checksum_bytes
from skip_harness.store.discards import DiscardStore, StepDiscards
from skip_harness.store.commit import CommitRecord, FileEntry, expected_rels, parse_commit
from skip_harness.store.layout import COMMIT_NAME, PAYLOAD_NAME, Layout
from skip_harness.store.namespace import Namespace
from skip_harness.store.paths import check_position, meta_rel_at, payload_rel_at, real_file, without_path
from skip_harness.store.status import StepReport, classify_step
from skip_harness.store.values import StepValues, ValuesStore
from skip_harness.store.status import StepStatus

# a small record beside a step, bound to the commit record it was written for
_Bound = TypeVar("_Bound", bound=Union[StepValues, StepDiscards])

PAYLOAD_STEM = PAYLOAD_NAME.rsplit('.', 1)[0]      # tq_batch.pt, tq_batch_rank{r}.pt

Served = Tuple[str, Optional[str], List[Any], List[Dict[str, Any]]]


class StepReader:
    """Verified reads of the steps of one namespace, through its backend, and the one verify."""

    def __init__(self, layout: Layout, namespace: Namespace, pool: BufferPool):
        """`pool`: the buffers payloads are read into (the tensors served keep theirs until gone)."""
        self.layout = layout
        self.namespace = namespace
        self.pool = pool

    def _classify(self, step: int) -> StepReport:
        return classify_step(self.layout, step, namespace=self.namespace)

    # ---- the commit record and meta files

    def read_commit(self, step: int) -> Optional[CommitRecord]:
        """The step's commit record, None if it has none; CorruptStepError if it does not validate."""
        data = self.namespace.read_small(f"{int(step)}/{COMMIT_NAME}")
        return None if data is None else parse_commit(data, self.layout, step, self.layout.commit_path(step))

    def read_meta(self, step: int, inner_index: int, rank: int) -> Dict[str, Any]:
        """The meta.json of (step, inner_index, rank) as a dict (not checked against a commit record);
        CorruptStepError naming the file if it is missing, unreadable or not a JSON object."""
        check_position(self.layout, step, inner_index, rank)
        rel = meta_rel_at(self.layout, step, inner_index, rank, self.namespace)
        data = self._read_small(step, rel, "meta file cannot be read")
        return _parse_meta(lambda: self._path(step, rel), data)

    def _path(self, step: int, rel: str) -> Path:
        """Where file `rel` of `step` is, for a message (made only when one is: `ls` reads 40,000 metas)."""
        return self.layout.step_dir(step) / rel

    def _read_small(self, step: int, rel: str, cannot: str = "cannot be read") -> bytes:
        """The bytes of small file `rel` of `step`, through the backend; CorruptStepError naming its path
        when it is missing or cannot be read."""
        try:
            data = self.namespace.read_small(f"{int(step)}/{rel}")
        except OSError as exc:
            raise CorruptStepError(self._path(step, rel), f"{cannot}: {exc.strerror or exc}") from None
        if data is None:
            raise CorruptStepError(self._path(step, rel), "missing")
        return data

    def logical_bytes(self, step: int, stored_bytes: int, metas: Optional[Iterable[Dict[str, Any]]] = None) -> int:
        """The step's bytes at full width: `stored_bytes` (what its files take on disk) with each
        payload's stored size replaced by the full-width size its meta.json records (written with
        compression=zstd); a payload whose meta records none counts as stored. Reads K x W metas, unless
        `metas` are the step's already read (`read_meta`'s, the unreadable left out)."""
        total = stored_bytes
        for meta in self._readable_metas(step) if metas is None else metas:
            logical, stored = meta.get("logical_bytes"), meta.get("bytes")
            if type(logical) is int and type(stored) is int and logical >= 0 and stored >= 0:
                total += logical - stored
        return total

    def _readable_metas(self, step: int) -> Iterator[Dict[str, Any]]:
        for i, r, _p, _m in expected_rels(self.layout):
            try:
                yield self.read_meta(step, i, r)
            except (CorruptStepError, OSError):
                continue

    # ---- what the step produced (store.values)

    def read_values(self, step: int) -> Optional[Dict[str, float]]:
        """The values the trainer reported for `step` when it was recorded ({key: float}); None when
        none were recorded, or they belong to another write of the step (the step was removed and
        written again since), or the step has no valid commit record."""
        recorded = self.read_step_values(step)
        return None if recorded is None else dict(recorded.values)

    def read_step_values(self, step: int) -> Optional[StepValues]:
        """`read_values` with what else was recorded: the training-side config's digest and when."""
        return self._bound_to_commit(step, ValuesStore(self.namespace).read_step(step))

    def read_discarded(self, step: int) -> Optional[StepDiscards]:
        """What a filter discarded from `step` when it was recorded (`store.discards`); None when nothing
        was recorded, or it belongs to another write of the step, or the step has no valid commit record."""
        return self._bound_to_commit(step, DiscardStore(self.namespace).read_step(step))

    def _bound_to_commit(self, step: int, found: Optional[_Bound]) -> Optional[_Bound]:
        """`found` (a small record beside the step) when it was written for the step's current commit record
        (its `commit_created` is the record's creation time); None when there is none, the step has no
        valid commit record, or the step was removed and written again since."""
        if found is None:
            return None
        try:
            record = self.read_commit(step)
        except (CorruptStepError, OSError):
            return None
        return found if record is not None and found.commit_created == record.created else None

    def read_training_config(self, digest: Optional[str]) -> Optional[Dict[str, Any]]:
        """The flattened training-side config recorded under `digest` (None when absent)."""
        return None if not digest else ValuesStore(self.namespace).read_config(digest)

    # ---- payloads

    def read_served(self, step: int, rank: int, report: Optional[StepReport] = None) -> Served:
        """This rank's K mini-batches of `step` and their metas for serving, verified in the pass that
        reads them: (status, reason, batches, metas), reason None when the step can be served. A
        complete step's payload files are each read once (O_DIRECT into a pool buffer), their size and
        checksum checked against the commit record, and their tensors are views of that buffer; the
        files of other ranks are not read (unknown extra files are checked). An unverified (older) step
        is loaded without checksums. UnregisteredTypeError propagates (not a damaged file). `report`:
        the step's classification (`classify_step`) when the caller has just made it, else made here."""
        report = report if report is not None else self._classify(step)
        status = report.status
        if status in (StepStatus.INCOMPLETE, StepStatus.CORRUPT):
            return status, f"{status}: {report.reason}", [], []
        K = self.layout.K
        try:
            if status == StepStatus.UNVERIFIED:
                return (status, None, [self.read_inner(step, i, rank) for i in range(K)],
                        [self.read_meta(step, i, rank) for i in range(K)])
            record = report.record           # parsed once, by the listing that classified the step
            if record is None:
                return StepStatus.CORRUPT, self._record_gone(step), [], []
            rank_of = self._rank_of_rels()
            entries = {e.rel: e for e in record.files}
            for entry in record.files:
                if entry.rel not in rank_of:          # unknown extra files are checked, as by verify
                    reason = self._check_entry(step, entry)
                    if reason is not None:
                        return StepStatus.CORRUPT, reason, [], []
            batches, metas = [], []
            for i in range(K):
                prel, mrel = self.layout.stored_rels(i, rank, entries.__contains__)   # as the record lists them
                if prel not in entries or mrel not in entries:
                    return (StepStatus.CORRUPT, f"{self.layout.commit_path(step)}: lists no entry for "
                            f"{prel if prel not in entries else mrel}", [], [])
                metas.append(_parse_meta(functools.partial(self._path, step, mrel),
                                         self._read_small_verified(step, entries[mrel])))
                batches.append(self._read_payload_checked(step, entries[prel]))
        except CorruptStepError as exc:
            return StepStatus.CORRUPT, str(exc), [], []
        return status, None, batches, metas

    def read_inner(self, step: int, inner_index: int, rank: int) -> Any:
        """Load the payload of (step, inner_index, rank) -- for `merged`, export, `show` and `verify`.
        A committed step's payload comes by the verified read a hit uses (size and checksum against the
        commit record, in the pass that reads it); a step without one (an older cache) is loaded as it
        is. Reads K = 1 steps stored as {step}/tq_batch.pt and as {step}/0/tq_batch.pt.
        CorruptStepError(path, reason) if it cannot be loaded safely."""
        check_position(self.layout, step, inner_index, rank)
        entry = self._committed_entry(step, inner_index, rank)
        if entry is not None:
            mapped = self.namespace.map_verified(step, entry.rel, entry.bytes, entry.checksum)
            if mapped is None:
                return self._read_payload_checked(step, entry)
            path = self.layout.step_dir(step) / entry.rel
            with _corrupt_on_codec_error(path):     # either format, from the verified mapping
                return codec.load_buffer(mapped, entry.bytes, path)   # tensors: views of the mapping
        path, image, size = self._unchecked(step, payload_rel_at(self.layout, step, inner_index, rank, self.namespace))
        with _corrupt_on_codec_error(path):
            return codec.load_buffer(image, size, path)

    def _unchecked(self, step: int, rel: str) -> Tuple[Path, Any, int]:
        """(path, buffer, size) of file `rel` of a step with nothing to check it against (no commit
        record), through the namespace, once `real_file` checked no component of it is a link."""
        path = real_file(self.layout, step, rel, self.namespace)
        buf, size = self.namespace.read_unchecked(step, rel)
        return path, buf, size

    def read_step(self, step: int, rank: int) -> List[Any]:
        """The K mini-batches of this rank in inner order (a committed step's verified, as for a hit)."""
        status, reason, batches, _metas = self.read_served(step, rank)
        if status == StepStatus.COMPLETE and reason is None:
            return batches
        if reason is not None and status == StepStatus.CORRUPT:
            raise CorruptStepError(self.layout.step_dir(step), reason)
        return [self.read_inner(step, i, rank) for i in range(self.layout.K)]

    # ---- verify

    def verify(self, step: int, ranks: Optional[Iterable[int]] = None, *,
               load: bool = True) -> Tuple[str, Optional[str]]:
        """(status, reason): the step's status as classified ('complete', 'unverified', 'incomplete' or
        'corrupt'; 'corrupt' too when a check below fails) and None if the step would be served, else
        the reason (naming the file) it would be refused.

        A complete step: the size and checksum of every file its commit record lists (only the payload
        and meta files of `ranks`, if given; unknown extra files always), read as a hit reads them.
        With `load`, also every payload of `ranks` (all ranks by default) is checked to load safely --
        header, records and bounds, nothing executed, no registered type needed in this process
        (`codec.check_buffer`; on an object store, the verified read and a decode); a payload that
        would need pickled code fails. An unverified (older) step has no checksums: only the load check
        applies. Incomplete and corrupt steps fail with their status and reason."""
        wanted = None if ranks is None else set(ranks)
        report = self._classify(step)
        if report.status in (StepStatus.INCOMPLETE, StepStatus.CORRUPT):
            return report.status, f"{report.status}: {report.reason}"
        if report.status == StepStatus.COMPLETE:
            reason = self._checksums(step, report.record, wanted)
            if reason is not None:
                return StepStatus.CORRUPT, reason
        if load:
            reason = self._loads(step, wanted)
            if reason is not None:
                return StepStatus.CORRUPT, reason
        return report.status, None

    def _checksums(self, step: int, record: Optional[CommitRecord], wanted: Optional[set]) -> Optional[str]:
        """Size and checksum of every file the commit record lists (of `wanted` ranks): None if they
        all match, else a reason naming the file."""
        if record is None:
            return self._record_gone(step)
        rank_of = self._rank_of_rels()
        for entry in record.files:
            r = rank_of.get(entry.rel)
            if wanted is not None and r is not None and r not in wanted:
                continue
            reason = self._check_entry(step, entry)
            if reason is not None:
                return reason
        return None

    def _loads(self, step: int, wanted: Optional[set]) -> Optional[str]:
        """None if every payload (of `wanted` ranks) would load safely, else the reason naming it."""
        layout = self.layout
        for i, r, _prel, _mrel in expected_rels(layout):
            if wanted is not None and r not in wanted:
                continue
            try:
                if not self.namespace.caps.mmap:     # no local file to check in place: the verified read and a decode
                    self.read_inner(step, i, r)
                    continue
                path, image, size = self._unchecked(step, payload_rel_at(layout, step, i, r, self.namespace))
                codec.check_buffer(image, size, str(path))
            except (CorruptStepError, codec.CodecError) as exc:
                return str(exc)
        return None

    # ---- the verified reads underneath

    def _record_gone(self, step: int) -> str:
        return f"{self.layout.commit_path(step)}: commit record disappeared"

    def _rank_of_rels(self) -> Dict[str, int]:
        """The rank each expected payload and meta file belongs to, by its path in the step."""
        return {rel: r for _i, r, prel, mrel in expected_rels(self.layout) for rel in (prel, mrel)}

    def _check_entry(self, step: int, entry: FileEntry) -> Optional[str]:
        """None when the file matches its commit-record entry (read verified, as a hit reads it), else
        the reason naming it."""
        try:
            if PurePosixPath(entry.rel).name.startswith(PAYLOAD_STEM):
                self._read_verified(step, entry).release()
            else:
                self._read_small_verified(step, entry)
        except CorruptStepError as exc:
            return str(exc)
        return None

    def _read_verified(self, step: int, entry: FileEntry) -> Lease:
        """The one verified read of a payload: the file of `entry` in a pool buffer (O_DIRECT on POSIX),
        its size and checksum checked against the commit record in the pass that reads it."""
        return self.namespace.read_verified(step, entry.rel, entry.bytes, entry.checksum, self.pool)[0]

    def _read_small_verified(self, step: int, entry: FileEntry) -> bytes:
        """A meta file (or an extra one) read whole and checked against its commit-record entry."""
        data = self._read_small(step, entry.rel)
        reason = _mismatch(len(data), checksum_bytes(data), entry)
        if reason is not None:
            raise CorruptStepError(self._path(step, entry.rel), reason)
        return data

    def _read_payload_checked(self, step: int, entry: FileEntry) -> Any:
        """A committed payload read verified and decoded; its tensors views of the pool buffer."""
        path = self.layout.step_dir(step) / entry.rel
        lease = self._read_verified(step, entry)
        size = entry.bytes
        try:
            widened: List[Lease] = []

            def alloc(nbytes: int) -> Any:          # narrowed / compressed tensors: rebuilt in a pool buffer
                widened.append(self.pool.acquire(nbytes))
                return widened[-1].array

            try:
                with _corrupt_on_codec_error(path):
                    return codec.load_buffer(lease.array, size, str(path), alloc)
            finally:
                for extra in widened:
                    extra.release()              # the tensors keep their buffer until they are gone
        finally:
            lease.release()

    def _committed_entry(self, step: int, inner_index: int, rank: int) -> Optional[FileEntry]:
        """The commit-record entry of a payload of a committed step (the K = 1 `0/` form resolved from
        the record's own list); None when the step has no commit record."""
        record = self.read_commit(step)
        if record is None:
            return None
        entries = {e.rel: e for e in record.files}
        rel = self.layout.stored_rels(inner_index, rank, entries.__contains__)[0]
        if rel in entries:
            return entries[rel]
        raise CorruptStepError(self.layout.commit_path(step),
                               f"lists no entry for {self.layout.payload_rel(inner_index, rank)}")


@contextlib.contextmanager
def _corrupt_on_codec_error(path: Path) -> Iterator[None]:
    """A payload that cannot be decoded is a CorruptStepError naming it -- except one holding a type this
    process has not registered (UnregisteredTypeError propagates: not a damaged file)."""
    try:
        yield
    except codec.UnregisteredTypeError:
        raise
    except codec.CodecError as exc:
        raise CorruptStepError(path, without_path(str(exc), path)) from None


def _parse_meta(where: Callable[[], Path], data: bytes) -> Dict[str, Any]:
    """A meta file's JSON object; CorruptStepError naming `where()` when it is not one."""
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise CorruptStepError(where(), f"meta file cannot be read: {exc}") from None
    if not isinstance(doc, dict):
        raise CorruptStepError(where(), "meta file is not a JSON object")
    return doc


def _mismatch(size: int, digest: str, entry: FileEntry) -> Optional[str]:
    """Why a file of `size` bytes and checksum `digest` is not the one `entry` lists (None when it is)."""
    if size != entry.bytes:
        return f"{size} bytes, the commit record says {entry.bytes}"
    if digest != entry.checksum:
        return f"checksum {digest} does not match the commit record's {entry.checksum}"
    return None
