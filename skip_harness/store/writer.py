"""Writing a namespace's steps: each payload and its meta file through the namespace's backend, then
the commit record last.

`StepWriter.stage_inner` copies a payload into a pool buffer on the caller's thread (the one copy a
write needs); `StagedInner.complete` stores it (O_DIRECT on POSIX) and its meta.json, from any thread;
`StepWriter.commit` writes the step's commit record once every rank's files are there with their
sizes, then appends the step to the namespace index. Rewriting or removing a step unlinks the commit
record first. How bytes reach the storage is the backend's (`store.posix`, `store.objstore`).

This module does no logging: it raises or returns, and the harness reports.
"""
from __future__ import annotations

import dataclasses
import json
import threading
import time
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Tuple

from skip_harness import codec
from skip_harness.codec import tensorfile
from skip_harness.errors import CorruptStepError, HarnessUsageError
from skip_harness.store import index
from skip_harness.store.bufferpool import BufferPool, Lease
from skip_harness.store.checksum import checksum_bytes, hasher
from skip_harness.store.commit import WRITER_NAME, CommitRecord, FileEntry, is_safe_rel, required_rels
from skip_harness.store.fingerprint import Fingerprint
from skip_harness.store.layout import Layout
from skip_harness.store.namespace import Namespace
from skip_harness.store.paths import check_position, check_step
from skip_harness.store.discards import Discarded, DiscardStore
from skip_harness.store.values import ValuesStore

_STORED_STEPS_KEPT = 256


class StagedInner:
    """A payload copied into a pool buffer (and hashed, when stored as it is) by `StepWriter.stage_inner`;
    `complete()` -- for a compressed form, first narrows and compresses the staged copy into a second
    buffer and hashes that -- stores it through the namespace's backend (O_DIRECT on POSIX) and then its
    meta.json, returning the two FileEntry. Once, from any thread."""

    def __init__(self, namespace: Namespace, step: int, lease: Lease, nbytes: int, checksum: Optional[str],
                 payload_rel: str, meta_rel: str, meta: Dict[str, Any],
                 transform: Optional[Tuple[tensorfile.FileImage, tensorfile.StoredForm, BufferPool]] = None,
                 stored: Optional[Callable[[int, Sequence[FileEntry]], None]] = None):
        self._namespace = namespace
        self._on_stored = stored
        self._step = step
        self._lease: Optional[Lease] = lease
        self.checksum = checksum
        self.payload_rel, self.meta_rel = payload_rel, meta_rel
        self._meta = meta
        self.bytes = nbytes
        self._transform = transform

    def _stored(self, lease: Lease) -> Lease:
        """The staged full-width copy narrowed and compressed into a new buffer (the writer thread's
        work: the trainer's thread only copied it); sets bytes and checksum to the stored file's."""
        image, form, pool = self._transform
        self._transform = None
        stored = tensorfile.stored_image(image, tensorfile.staged_tensors(image, lease.array), form)
        out = pool.acquire(stored.nbytes)
        try:
            tensorfile.fill_stored(stored, out.array)
            self.bytes = stored.nbytes
            self.checksum = checksum_bytes(out.view(stored.nbytes))
            self._meta["logical_bytes"] = stored.logical_nbytes     # the full-width file's: known only now
        except BaseException:
            out.release()
            raise
        lease.release()
        return out

    def complete(self) -> Tuple[FileEntry, FileEntry]:
        lease = self._take()
        try:
            if self._transform is not None:
                lease = self._stored(lease)
            meta_doc = dict(self._meta, bytes=self.bytes, checksum=self.checksum, created=time.time())
            meta_bytes = (json.dumps(meta_doc, indent=1) + "\n").encode()
            # the payload, then its meta.json, durable together: one directory fsync for both (the
            # step has no commit record until both are, so neither is read before)
            self._namespace.write_step_files(self._step, [(self.payload_rel, lease, self.bytes),
                                                          (self.meta_rel, meta_bytes, len(meta_bytes))])
        finally:
            lease.release()
        entries = (FileEntry(self.payload_rel, self.bytes, self.checksum),
                   FileEntry(self.meta_rel, len(meta_bytes), checksum_bytes(meta_bytes)))
        if self._on_stored is not None:
            self._on_stored(self._step, entries)
        return entries

    def _take(self) -> Lease:
        lease, self._lease = self._lease, None
        if lease is None:
            raise HarnessUsageError(f"{self.payload_rel}: this staged write was already completed")
        return lease


class StepWriter:
    """Atomic, durable writes of the steps of one namespace (through its backend), the commit record
    last. Holds no mutable state but its (thread-safe) buffer pool, what its commits add to the
    namespace index (`index.IndexWriter`, thread-safe) and the entries of the files it stored for steps
    not yet committed (thread-safe): stage on the trainer's thread, complete and commit on the writer
    thread."""

    def __init__(self, layout: Layout, namespace: Namespace, pool: BufferPool, form: tensorfile.StoredForm):
        """`pool`: the buffers payloads are staged in; `form`: how payloads are written
        (`codec.stored_form(compression, level)`)."""
        self.layout = layout
        self.namespace = namespace
        self.pool = pool
        self.form = form
        self.index = index.IndexWriter(layout, namespace)
        self._stored: Dict[int, Dict[str, FileEntry]] = {}     # step -> rel -> entry, stored and size-checked here
        self._stored_guard = threading.Lock()

    def _note_stored(self, step: int, entries: Sequence[FileEntry]) -> None:
        """What `StagedInner.complete` stored for `step` and checked the size of: the step's commit need
        not list those files again. A few hundred steps at most (a step abandoned is never committed)."""
        with self._stored_guard:
            self._stored.setdefault(step, {}).update((e.rel, e) for e in entries)
            while len(self._stored) > _STORED_STEPS_KEPT:
                del self._stored[next(iter(self._stored))]

    def write_inner(self, step: int, inner_index: int, rank: int, payload: Any,
                    meta: Mapping[str, Any]) -> Tuple[FileEntry, FileEntry]:
        """Write the payload of (step, inner_index, rank), then its meta.json, each atomically and
        durably. Removes the step's commit record first if there is one (the step is being rewritten).
        A step entry that is a symlink or a file is removed first (never followed); so is an inner
        directory entry that is one. Returns (payload entry, meta entry)."""
        return self.stage_inner(step, inner_index, rank, payload, meta).complete()

    def stage_inner(self, step: int, inner_index: int, rank: int, payload: Any,
                    meta: Mapping[str, Any]) -> StagedInner:
        """The first half of `write_inner`, for the caller's thread: copies the payload's file image
        into a pool buffer -- the one copy of the payload a write needs, after which the caller may
        change the payload in place -- and prepares the step (removing its commit record). The
        returned StagedInner's `complete()` (write, fsync, rename, meta.json; for a writer thread)
        must follow. Raises what encoding (CodecError) or preparing the step raises, leaving nothing
        behind."""
        check_position(self.layout, step, inner_index, rank)
        layout = self.layout
        payload_rel = layout.payload_rel(inner_index, rank)
        # a compressed form's header is the writer thread's to lay out (StagedInner._stored): this thread
        # makes only the staging copy's layout and snapshots of plain values
        image = codec.plan(payload, staged=self.form.transforms)
        lease = self.pool.acquire(image.nbytes)
        transform = (tensorfile.shapes_only(image), self.form, self.pool) if self.form.transforms else None
        try:
            # Hashed here, while the trainer's cores wait for sample anyway: on the writer thread the
            # same hash slowed a training step on every core by twice its own time (measured); and as
            # the bytes are copied, from their source, on a second core. A compressed form is hashed on
            # the writer thread, after compressing (the stored bytes).
            if transform:
                tensorfile.pack_into(image, lease.array, self.pool.copier.copy)
                checksum = None
            else:
                copies, pieces = tensorfile.pack_parts(image, lease.array)
                checksum = self.pool.copier.copy_hashed(copies, pieces, hasher())
            self.namespace.uncommit(step)      # the step is being rewritten: never "complete" meanwhile
        except BaseException:
            lease.release()
            raise
        meta_doc = dict(meta)
        meta_doc.update(writer=WRITER_NAME, step=step, inner_index=inner_index, rank=rank, K=layout.K,
                        W=layout.W, payload=payload_rel, format=codec.FORMAT_VERSION,
                        compression="zstd" if self.form.zstd_level is not None else "none",
                        logical_bytes=None if transform else image.nbytes)
        return StagedInner(self.namespace, step, lease, image.nbytes, checksum, payload_rel,
                           layout.meta_rel(inner_index, rank), meta_doc, transform, self._note_stored)

    def commit(self, step: int, entries: Sequence[FileEntry], fingerprint: Optional[Fingerprint],
               *, gen_s: Optional[float] = None) -> CommitRecord:
        """Write the step's commit record (atomically, durably) once every rank's files are written.
        `entries` are the FileEntry pairs `write_inner` returned, from every rank; `gen_s` (optional)
        the step's generation seconds, kept for tables. Refuses (raises) when an entry is missing or a
        listed file is not there with its size -- checked against a listing of the step for the entries
        this writer did not store and check itself (another rank's; with W = 1 none: no listing, no LIST
        request on an object store). Then appends the step to the namespace index (a hint: failing to append
        changes nothing but the next startup's speed)."""
        check_step(step)
        layout = self.layout
        by_rel: Dict[str, FileEntry] = {}
        for e in entries:
            if not is_safe_rel(e.rel):
                raise HarnessUsageError(f"commit of step {step}: unsafe file path {e.rel!r}")
            if e.rel in by_rel and by_rel[e.rel] != e:
                raise HarnessUsageError(f"commit of step {step}: two different entries for {e.rel}")
            by_rel[e.rel] = e
        missing = [rel for rel in required_rels(layout) if rel not in by_rel]
        if missing:
            raise HarnessUsageError(
                f"commit of step {step}: no entry for {', '.join(missing[:4])}"
                + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
            )
        with self._stored_guard:
            stored = self._stored.pop(step, {})
        unchecked = [e for e in by_rel.values() if stored.get(e.rel) != e]
        listing = self.namespace.list_step(step) if unchecked else None
        if unchecked and listing is None:
            raise CorruptStepError(layout.step_dir(step), "step directory does not exist")
        for e in unchecked:
            found = listing.files.get(e.rel)
            if found is None:
                raise CorruptStepError(layout.step_dir(step) / e.rel, "missing")
            if found.size != e.bytes:
                raise CorruptStepError(layout.step_dir(step) / e.rel,
                                       f"has {found.size} bytes, the entry to commit says {e.bytes}")
        record = CommitRecord(step, layout.K, layout.W, fingerprint,
                              tuple(sorted(by_rel.values(), key=lambda e: e.rel)), time.time(),
                              None if gen_s is None else float(gen_s))
        data = (json.dumps(record.to_json(), indent=1, allow_nan=False) + "\n").encode()
        record = dataclasses.replace(record, nbytes=sum(e.bytes for e in by_rel.values()) + len(data))
        self.namespace.uncommit(step)          # a commit of a step committed already replaces its record
        stamp = self.namespace.commit(step, data)
        self.index.committed(step, record, data, stamp)
        return record

    def write_values(self, step: int, values: Mapping[str, float], commit_created: Optional[float],
                     config: Optional[str] = None, create_only: bool = False,
                     machine: Optional[Mapping[str, str]] = None) -> bool:
        """Record what the trainer reported for a committed step (`store.values`), bound to its commit
        record (`commit_created`: the record's creation time); outside the record, so the step stays
        complete whether or not this lands. `create_only`: only where the step has no values (False
        when it has)."""
        return ValuesStore(self.namespace).write_step(step, values, commit_created=commit_created, config=config,
                                                    create_only=create_only, machine=machine)

    def write_discards(self, step: int, discarded: Sequence[Discarded], commit_created: Optional[float],
                       create_only: bool = True) -> bool:
        """Record what a filter discarded from a committed step and why (`store.discards`), bound to its
        commit record, outside it; `create_only`: only where the step has none (False when it has)."""
        return DiscardStore(self.namespace).write_step(step, discarded, commit_created=commit_created,
                                                     create_only=create_only)

    def write_run_values(self, run_id: str, step: int, values: Mapping[str, float], config: Optional[str] = None,
                         machine: Optional[Mapping[str, str]] = None) -> None:
        """Record what a replay (run `run_id`) reported for `step`, under its run id: never over the
        recording's values (`store.values`)."""
        ValuesStore(self.namespace).write_run_step(run_id, step, values, config=config, machine=machine)

    def write_run_drift(self, run_id: str, step: int, K: int, W: int, firsts: Mapping[str, Optional[int]]) -> None:
        """Record an `action=compare` run's per-trajectory drift at `step` under its run id (`store.values`)."""
        ValuesStore(self.namespace).write_run_drift(run_id, step, K, W, firsts)

    def write_run(self, run_id: str, doc: Mapping[str, Any]) -> None:
        """Record a replay's own document (`.values/runs/{run_id}/run.json`)."""
        ValuesStore(self.namespace).write_run(run_id, doc)

    def write_training_config(self, digest: str, flat: Mapping[str, Any]) -> None:
        """Record the run's flattened training-side config under its digest."""
        ValuesStore(self.namespace).write_config(digest, flat)

    def clear_step(self, step: int) -> int:
        """Remove a step so it can be rewritten: commit record first, then everything else; a step
        entry that is a symlink is unlinked, never entered. Returns the bytes freed (0 if absent)."""
        with self._stored_guard:
            self._stored.pop(step, None)
        return self.namespace.remove_step(step)
