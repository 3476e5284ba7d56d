"""A namespace's steps: atomic, durable writes of their files and commit record, and verified reads.

A step's commit record is written last, after every rank's payload and meta files are durable;
rewriting or removing a step unlinks the commit record first. How one file is written, hashed and
removed lives in `fileops` (payloads: `directio`, from `bufferpool` buffers); where a step's files
are, in `steppaths`; the records of a step and how its status is classified, in `stepstatus`
(`fileops` and `stepstatus` names re-exported here).

Every operation goes through directory file descriptors opened with O_NOFOLLOW, so a step or inner
directory that is a symlink is never entered: writing removes the link first, reading raises
CorruptStepError. Only this module, `fileops`, `directio`, `steppaths`, `stepstatus`, `scan`, `index`
and `lock` touch cache files.

This module does no logging: it raises or returns, and the harness reports. `StepStore` holds no
mutable state but its (thread-safe) buffer pool, so a prefetch thread may read and verify steps
while the writer writes others.
"""
from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path, PurePosixPath
from typing import Any, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple

from skip_harness import codec
from skip_harness.store import index
from skip_harness.codec import tensorfile
from skip_harness.store.bufferpool import BufferPool, Lease
from skip_harness.store.backend import NamespaceBackend
from skip_harness.store.backend import namespace_of
from skip_harness.errors import CorruptStepError, HarnessUsageError
from skip_harness.store.posix.fileops import (  # noqa: F401  (re-exported: the store's public names)
    CHUNK_BYTES, MAP_FROM, READ_FLAGS, WRITE_BUFFER_BYTES, HashingWriter, NotARealDirectory,
    checksum_bytes, checksum_fd, checksum_file, describe_mode, fsync_dir, lstat_at, open_dir_at,
    remove_entry_at, tree_bytes, write_file_at,
)
from skip_harness.store.fingerprint import Fingerprint
from skip_harness.store.layout import COMMIT_NAME, PAYLOAD_NAME, Layout
from skip_harness.store.paths import (
    check_position, check_step, existing_rel, meta_rel_at, payload_rel_at, real_file, without_path,
)
from skip_harness.store.status import (  # noqa: F401  (re-exported: the store's public names)
    COMMIT_FORMAT, STATUSES, WRITER_NAME, CommitRecord, FileEntry, StepReport, classify_step,
    expected_rels, is_safe_rel, parse_commit, required_rels,
)


PAYLOAD_STEM = PAYLOAD_NAME.rsplit('.', 1)[0]      # tq_batch.pt, tq_batch_rank{r}.pt

# --------------------------------------------------------------------------------------------
# the store


class StagedInner:
    """A payload copied into a pool buffer (and hashed, when stored as it is) by `StepStore.stage_inner`;
    `complete()` -- for a compressed form, first narrows and compresses the staged copy into a second
    buffer and hashes that -- stores it through the namespace's backend (O_DIRECT on POSIX) and then its
    meta.json, returning the two FileEntry. Once, from any thread."""

    def __init__(self, backend: NamespaceBackend, step: int, lease: Lease, nbytes: int, checksum: Optional[str],
                 payload_rel: str, meta_rel: str, meta: Dict[str, Any],
                 transform: Optional[Tuple[tensorfile.FileImage, tensorfile.StoredForm, BufferPool]] = None):
        self._backend = backend
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
            self._backend.write_payload(self._step, self.payload_rel, lease, self.bytes)
            lease.release()                  # the buffer may go round again while meta.json is written
            meta_doc = dict(self._meta, bytes=self.bytes, checksum=self.checksum, created=time.time())
            meta_bytes = (json.dumps(meta_doc, indent=1) + "\n").encode()
            self._backend.write_small(f"{self._step}/{self.meta_rel}", meta_bytes)
        finally:
            lease.release()
        return (FileEntry(self.payload_rel, self.bytes, self.checksum),
                FileEntry(self.meta_rel, len(meta_bytes), checksum_bytes(meta_bytes)))

    def _take(self) -> Lease:
        lease, self._lease = self._lease, None
        if lease is None:
            raise HarnessUsageError(f"{self.payload_rel}: this staged write was already completed")
        return lease


class StepStore:
    """Atomic, durable writes and verified reads of the steps of one namespace."""

    def __init__(self, layout: Layout, *, drop_written_pages: bool = True, pool: Optional[BufferPool] = None,
                 form: Optional[tensorfile.StoredForm] = None, backend: Optional[NamespaceBackend] = None):
        """`drop_written_pages`: where a payload is written through the page cache (a file system
        without O_DIRECT), let the kernel drop its pages once it is durable. `pool`: the buffers
        payloads are staged in and read into (the harness sizes one for its K; by default a small one).
        `form`: how payloads are written (`codec.stored_form(compression, level)`; by default raw, at
        full width); files of every form are read."""
        self.layout = layout
        self.drop_written_pages = drop_written_pages
        self.backend: NamespaceBackend = backend if backend is not None else \
            namespace_of(layout, drop_written_pages=drop_written_pages)
        self.pool = pool if pool is not None else BufferPool()
        self.form = form if form is not None else tensorfile.StoredForm(narrow=False)

    # ---- writing

    def write_inner(self, step: int, inner_index: int, rank: int, payload: Any,
                    meta: Mapping[str, Any]) -> Tuple[FileEntry, FileEntry]:
        """Write the payload of (step, inner_index, rank), then its meta.json, each atomically and
        durably. Removes the step's commit record first if there is one (the step is being rewritten).
        A step entry that is a symlink or a file is removed first (never followed); so is an inner
        directory entry that is one. Returns (payload entry, meta entry)."""
        return self.stage_inner(step, inner_index, rank, payload, meta).complete()

    def stage_inner(self, step: int, inner_index: int, rank: int, payload: Any,
                    meta: Mapping[str, Any]) -> "StagedInner":
        """The first half of `write_inner`, for the caller's thread: copies the payload's file image
        into a pool buffer -- the one copy of the payload a write needs, after which the caller may
        change the payload in place -- and prepares the step's directories (removing its commit
        record). The returned StagedInner's `complete()` (write, fsync, rename, meta.json; for a
        writer thread) or `discard()` must follow. Raises what encoding (CodecError) or preparing
        the directories raises, leaving nothing behind."""
        check_position(self.layout, step, inner_index, rank)
        layout = self.layout
        payload_rel = layout.payload_rel(inner_index, rank)
        image = codec.plan(payload)
        lease = self.pool.acquire(image.nbytes)
        transform = (tensorfile.shapes_only(image), self.form, self.pool) if self.form.transforms else None
        try:
            tensorfile.pack_into(image, lease.array, self.pool.copier.copy)
            # Hashed here, while the trainer's cores wait for sample anyway: on the writer thread the
            # same hash slowed a training step on every core by twice its own time (measured). A
            # compressed form is hashed on the writer thread, after compressing (the stored bytes).
            checksum = None if transform else checksum_bytes(lease.view(image.nbytes))
            self.backend.uncommit(step)      # the step is being rewritten: never "complete" meanwhile
        except BaseException:
            lease.release()
            raise
        meta_doc = dict(meta)
        meta_doc.update(writer=WRITER_NAME, step=step, inner_index=inner_index, rank=rank, K=layout.K,
                        W=layout.W, payload=payload_rel, format=codec.FORMAT_VERSION,
                        compression="zstd" if self.form.zstd_level is not None else "none",
                        logical_bytes=image.nbytes)
        return StagedInner(self.backend, step, lease, image.nbytes, checksum, payload_rel,
                           layout.meta_rel(inner_index, rank), meta_doc, transform)

    def commit(self, step: int, entries: Sequence[FileEntry], fingerprint: Optional[Fingerprint],
               *, gen_s: Optional[float] = None) -> CommitRecord:
        """Write the step's commit record (atomically, durably) once every rank's files are written.
        `entries` are the FileEntry pairs `write_inner` returned, from every rank; `gen_s` (optional)
        the step's generation seconds, kept for tables. Refuses (raises) when an entry is missing or a
        listed file is not there with its size. Then appends the step to the namespace index (a hint:
        failing to append changes nothing but the next startup's speed)."""
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
        listing = self.backend.list_step(step)
        if listing is None:
            raise CorruptStepError(layout.step_dir(step), "step directory does not exist")
        for e in by_rel.values():
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
        self.backend.uncommit(step)          # a commit of a step committed already replaces its record
        self.backend.commit(step, data)
        fp_json = None if fingerprint is None else fingerprint.to_json()
        nbytes = sum(e.bytes for e in record.files) + len(data)
        index.append(layout, index.make_entry(layout, step, nbytes, fp_json, record.created, record.gen_s))
        return record

    def clear_step(self, step: int) -> int:
        """Remove a step so it can be rewritten: commit record first, then everything else; a step
        entry that is a symlink is unlinked, never entered. Returns the bytes freed (0 if absent)."""
        return self.backend.remove_step(step)

    # ---- reading

    def read_commit(self, step: int) -> Optional[CommitRecord]:
        """The step's commit record, None if it has none; CorruptStepError if it does not validate."""
        data = self.backend.read_small(f"{int(step)}/{COMMIT_NAME}")
        return None if data is None else parse_commit(data, self.layout, step, self.layout.commit_path(step))

    def status(self, step: int) -> StepReport:
        """The step's StepReport (directory listings and lstat only; see `classify_step`)."""
        return classify_step(self.layout, step, backend=self.backend)

    def verify(self, step: int, ranks: Optional[Iterable[int]] = None) -> Optional[str]:
        """None if the step can be served, else a reason naming the file. For a complete step the size
        and checksum of every listed file are checked (only the payload and meta files of `ranks`, if
        given; unknown extra files always). An unverified (older) step passes when its files exist."""
        return self.verify_status(step, ranks)[1]

    def verify_status(self, step: int, ranks: Optional[Iterable[int]] = None) -> Tuple[str, Optional[str]]:
        """`verify`, also telling the step's status as classified on the way ('complete', 'unverified',
        'incomplete' or 'corrupt'), so a caller that needs both classifies the step once."""
        report = self.status(step)
        if report.status in ("incomplete", "corrupt"):
            return report.status, f"{report.status}: {report.reason}"
        if report.status == "unverified":
            return report.status, None
        reason = self.verify_checksums(step, ranks)
        return ("corrupt" if reason else "complete"), reason

    def verify_step(self, step: int, ranks: Optional[Iterable[int]] = None, *, load: bool = True) -> Optional[str]:
        """None if the step would be served, else the reason (naming the file) it would be refused.

        A complete step: the size and checksum of every file its commit record lists (of `ranks`, if
        given). With `load`, also every payload of `ranks` (all ranks by default) is checked to load
        safely -- header, records and bounds, nothing executed, no registered type needed in this
        process (`codec.check_file`); a payload that would need pickled code fails. An unverified
        (older) step has no checksums: only the load check applies. Incomplete and corrupt steps
        fail with their status and reason."""
        ranks = None if ranks is None else sorted(set(ranks))
        status, reason = self.verify_status(step, ranks)
        if reason is not None or not load:
            return reason
        for _i, r, prel, _mrel in expected_rels(self.layout):
            if ranks is not None and r not in ranks:
                continue
            try:
                if self.layout.is_url:    # no local file to check: the verified read and a decode
                    self.read_inner(step, _i, r)
                    continue
                path = real_file(self.layout, step, existing_rel(self.layout, step, prel, self.layout.legacy_k1_rel(r)[0]))
                codec.check_file(path)
            except CorruptStepError as exc:
                return str(exc)
            except codec.CodecError as exc:
                return str(exc)
        return None

    def verify_checksums(self, step: int, ranks: Optional[Iterable[int]] = None) -> Optional[str]:
        """For a step already classified complete: size and checksum of every file its commit record
        lists (of `ranks`, if given). None if they all match, else a reason naming the file."""
        try:
            record = self.read_commit(step)
        except CorruptStepError as exc:
            return str(exc)
        if record is None:
            return f"{self.layout.commit_path(step)}: commit record disappeared"
        wanted = None if ranks is None else set(ranks)
        rank_of = self._rank_of_rels()
        for entry in record.files:
            r = rank_of.get(entry.rel)
            if wanted is not None and r is not None and r not in wanted:
                continue
            reason = self._check_entry(step, entry)
            if reason is not None:
                return reason
        return None

    def _rank_of_rels(self) -> Dict[str, int]:
        """The rank each expected payload and meta file belongs to, by its path in the step."""
        return {rel: r for _i, r, prel, mrel in expected_rels(self.layout) for rel in (prel, mrel)}

    def _check_entry(self, step: int, entry: FileEntry) -> Optional[str]:
        """None when the file matches its commit-record entry (read verified, as a hit reads it), else
        the reason naming it."""
        try:
            if self._is_payload(entry.rel):
                self._read_verified(step, entry).release()
            else:
                self._read_small_verified(step, entry)
        except CorruptStepError as exc:
            return str(exc)
        return None

    def _is_payload(self, rel: str) -> bool:
        return PurePosixPath(rel).name.startswith(PAYLOAD_STEM)

    def _read_verified(self, step: int, entry: FileEntry) -> Lease:
        """The one verified read of a payload: the file of `entry` in a pool buffer (O_DIRECT on POSIX),
        its size and checksum checked against the commit record in the pass that reads it."""
        return self.backend.read_verified(step, entry.rel, entry.bytes, entry.checksum, self.pool)[0]

    def _read_small_verified(self, step: int, entry: FileEntry) -> bytes:
        """A meta file (or an extra one) read whole and checked against its commit-record entry."""
        path = self.layout.step_dir(step) / entry.rel
        try:
            data = self.backend.read_small(f"{int(step)}/{entry.rel}")
        except OSError as exc:
            raise CorruptStepError(path, f"cannot be read: {exc.strerror or exc}") from None
        if data is None:
            raise CorruptStepError(path, "missing")
        reason = _mismatch(path, len(data), checksum_bytes(data), entry)
        if reason is not None:
            raise CorruptStepError(path, without_path(reason, path))
        return data

    def read_served(self, step: int, rank: int) -> Tuple[str, Optional[str], List[Any], List[Dict[str, Any]]]:
        """This rank's K mini-batches of `step` and their metas for serving, verified in the pass that
        reads them: (status, reason, batches, metas), reason None when the step can be served. A
        complete step's payload files are each read once (O_DIRECT into a pool buffer), their size and
        checksum checked against the commit record, and their tensors are views of that buffer; the
        files of other ranks are not read (unknown extra files are checked). An unverified (older) step
        is loaded without checksums. UnregisteredTypeError propagates (not a damaged file)."""
        report = self.status(step)
        status, reason = report.status, None
        if status in ("incomplete", "corrupt"):
            return status, f"{status}: {report.reason}", [], []
        try:
            if status == "unverified":
                return status, None, [self.read_inner(step, i, rank) for i in range(self.layout.K)], [self.read_meta(step, i, rank)
                                                                  for i in range(self.layout.K)]
            record = report.record           # parsed once, by the listing that classified the step
            if record is None:
                return "corrupt", f"{self.layout.commit_path(step)}: commit record disappeared", [], []
            rank_of = self._rank_of_rels()
            entries = {e.rel: e for e in record.files}
            for entry in record.files:
                if entry.rel not in rank_of:          # unknown extra files are checked, as by verify
                    reason = self._check_entry(step, entry)
                    if reason is not None:
                        return "corrupt", reason, [], []
            batches, metas = [], []
            for i in range(self.layout.K):
                prel, mrel = payload_rel_at(self.layout, step, i, rank), meta_rel_at(self.layout, step, i, rank)
                if prel not in entries or mrel not in entries:
                    return "corrupt", f"{self.layout.commit_path(step)}: lists no entry for {prel if prel not in entries else mrel}", [], []
                metas.append(self._read_meta_checked(step, entries[mrel]))
                batches.append(self._read_payload_checked(step, entries[prel]))
        except CorruptStepError as exc:
            return "corrupt", str(exc), [], []
        return status, None, batches, metas

    def _read_meta_checked(self, step: int, entry: FileEntry) -> Dict[str, Any]:
        return _parse_meta(self.layout.step_dir(step) / entry.rel, self._read_small_verified(step, entry))

    def _read_payload_checked(self, step: int, entry: FileEntry) -> Any:
        path = self.layout.step_dir(step) / entry.rel
        lease = self._read_verified(step, entry)
        size = entry.bytes
        try:
            if not tensorfile.is_current_image(lease.view(size)):
                return self._load(path)          # the previous format: torch.load(weights_only=True)
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

    def read_inner(self, step: int, inner_index: int, rank: int) -> Any:
        """Load the payload of (step, inner_index, rank) -- for `merged`, export, `show` and `verify`.
        A committed step's payload comes by the verified read a hit uses (size and checksum against the
        commit record, in the pass that reads it); a step without one (an older cache) is loaded as it
        is. Reads K = 1 steps stored as {step}/tq_batch.pt and as {step}/0/tq_batch.pt.
        CorruptStepError(path, reason) if it cannot be loaded safely."""
        check_position(self.layout, step, inner_index, rank)
        entry = self._committed_entry(step, inner_index, rank)
        if entry is not None:
            mapped = self.backend.map_verified(step, entry.rel, entry.bytes, entry.checksum)
            if mapped is None:
                return self._read_payload_checked(step, entry)
            path = self.layout.step_dir(step) / entry.rel
            if not tensorfile.is_current_image(memoryview(mapped)):
                mapped.close()
                return self._load(path)          # the previous format: torch.load(weights_only=True)
            with _corrupt_on_codec_error(path):
                return codec.load_buffer(mapped, entry.bytes, path)   # tensors: views of the mapping
        return self._load(real_file(self.layout, step, payload_rel_at(self.layout, step, inner_index, rank)))

    def _committed_entry(self, step: int, inner_index: int, rank: int) -> Optional[FileEntry]:
        """The commit-record entry of a payload of a committed step (the K = 1 `0/` form resolved from
        the record's own list); None when the step has no commit record."""
        record = self.read_commit(step)
        if record is None:
            return None
        entries = {e.rel: e for e in record.files}
        for rel in (self.layout.payload_rel(inner_index, rank), self.layout.legacy_k1_rel(rank)[0]):
            if rel in entries:
                return entries[rel]
        raise CorruptStepError(self.layout.commit_path(step),
                               f"lists no entry for {self.layout.payload_rel(inner_index, rank)}")

    def _load(self, path: Path) -> Any:
        with _corrupt_on_codec_error(path):
            return codec.load_from(path)

    def read_step(self, step: int, rank: int) -> List[Any]:
        """The K mini-batches of this rank in inner order (a committed step's verified, as for a hit)."""
        status, reason, batches, _metas = self.read_served(step, rank)
        if status == "complete" and reason is None:
            return batches
        if reason is not None and status == "corrupt":
            raise CorruptStepError(self.layout.step_dir(step), reason)
        return [self.read_inner(step, i, rank) for i in range(self.layout.K)]

    def logical_bytes(self, step: int, stored_bytes: int) -> int:
        """The step's bytes at full width: `stored_bytes` (what its files take on disk) with each
        payload's stored size replaced by the full-width size its meta.json records (written with
        compression=zstd); a payload whose meta records none counts as stored. Reads K x W metas."""
        total = stored_bytes
        for i, r, _p, _m in expected_rels(self.layout):
            try:
                meta = self.read_meta(step, i, r)
            except (CorruptStepError, OSError):
                continue
            logical, stored = meta.get("logical_bytes"), meta.get("bytes")
            if type(logical) is int and type(stored) is int and logical >= 0 and stored >= 0:
                total += logical - stored
        return total

    def read_meta(self, step: int, inner_index: int, rank: int) -> Dict[str, Any]:
        check_position(self.layout, step, inner_index, rank)
        if self.layout.is_url:
            rel = meta_rel_at(self.layout, step, inner_index, rank)
            data = self.backend.read_small(f"{step}/{rel}")
            if data is None:
                raise CorruptStepError(self.layout.step_dir(step) / rel, "missing")
            return _parse_meta(self.layout.step_dir(step) / rel, data)
        path = real_file(self.layout, step, meta_rel_at(self.layout, step, inner_index, rank))
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as exc:
            raise CorruptStepError(path, f"meta file cannot be read: {exc.strerror or exc}") from None
        return _parse_meta(path, data)


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


def _parse_meta(path: Path, data: bytes) -> Dict[str, Any]:
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise CorruptStepError(path, f"meta file cannot be read: {exc}") from None
    if not isinstance(doc, dict):
        raise CorruptStepError(path, "meta file is not a JSON object")
    return doc


def _mismatch(path: Path, size: int, digest: str, entry: FileEntry) -> Optional[str]:
    if size != entry.bytes:
        return f"{path}: {size} bytes, the commit record says {entry.bytes}"
    if digest != entry.checksum:
        return f"{path}: checksum {digest} does not match the commit record's {entry.checksum}"
    return None
