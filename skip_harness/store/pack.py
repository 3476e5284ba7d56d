"""Packs: one recording (or a range of its steps) as one portable, read-only file (`skip-harness pack`).

`write_pack(namespace, out, steps)` copies a namespace's committed steps -- each step's files and commit
record, its second tier (`.tier/{step}/`), its recorded values (`.values/{step}.json`), what a filter
discarded from it (`.values/discarded-{step}.json`) and the training-side config they name
(`.values/config-{digest}.json`) -- into a ZIP of stored members led by a manifest (`store.packfile` has
the format and reads it in place: `replay_from`, `ls`, `verify`, `show`, `diff` and `view` open a pack as
a namespace). Every byte copied is checked: a step file against its
commit record, every member against the manifest when it is read back. `unpack(pack, dump_dir)` restores
the namespace under `{dump_dir}/{experiment}_{project}/{leaf}`, each step as the store writes one (files,
then the commit record, under the namespace's lock). `bless_pack` replaces the recorded values of some
steps (and the training-side config) in a new file renamed over the pack, and appends to its `blessed`
history. Nothing here is pickled; nothing holds an absolute path.
"""
from __future__ import annotations

import functools
import json
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple, Union

from skip_harness.codec import MAGIC
from skip_harness.errors import CorruptStepError
from skip_harness.store.checksum import checksum_bytes
from skip_harness.store.commit import COMMIT_FORMAT, parse_commit
from skip_harness.store.discards import discards_key
from skip_harness.store.layout import COMMIT_NAME, TIER_DIR, VALUES_DIR, Layout
from skip_harness.store.namespaces import namespaces_at
from skip_harness.store.open import (PACK_FORMAT, PACK_VERSION, PackError, PackMember, const_bytes, memory_namespace,
                                     open_namespace, pack_file_size, pack_layout, read_manifest,
                                     safe_member, write_pack_file)
from skip_harness.store.scan import scan_namespace
from skip_harness.store.status import StepStatus
from skip_harness.store.urls import place
from skip_harness.store.values import ValuesStore, config_changes, config_digest, config_key, flatten_config, values_key

_JSON = (".json", ".jsonl")

PathLike = Union[str, "os.PathLike[str]"]


@dataclass(frozen=True)
class PackInfo:
    """What a pack's manifest says: its namespace (`{experiment}_{project}/{leaf}`; the leaf gives the batch
    shape, K and W), its steps, the bytes of the namespace it holds (`bytes`: members less the manifest)
    and of the file (`file_bytes`), the generation fingerprint, the training-side config of its values,
    when it was packed, and its blessed history (oldest first)."""

    path: Path
    namespace: str
    K: int
    W: int
    steps: Tuple[int, ...]
    bytes: int
    file_bytes: int
    fingerprint: Optional[Dict[str, Any]]
    training_config: Optional[Dict[str, Any]]
    packed: float
    blessed: Tuple[Dict[str, Any], ...] = ()
    members: int = 0
    version: int = PACK_VERSION
    extra: Dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def leaf(self) -> str:
        return self.namespace.rsplit("/", 1)[-1]

    @property
    def overhead(self) -> int:
        """The file's bytes beyond the namespace's: the manifest and the ZIP headers."""
        return self.file_bytes - self.bytes


def read_pack_info(pack_path: PathLike) -> PackInfo:
    """The manifest of the pack at `pack_path`. PackError naming it when it is no pack or a damaged one."""
    manifest, members = read_manifest(pack_path)
    layout = pack_layout(pack_path)
    assert layout is not None
    return PackInfo(
        path=Path(pack_path), namespace=layout.name, K=layout.K, W=layout.W,
        steps=tuple(int(s) for s in manifest.get("steps", [])),
        bytes=sum(i.file_size for i in members.values()), file_bytes=pack_file_size(pack_path),
        fingerprint=manifest.get("fingerprint"), training_config=manifest.get("training_config"),
        packed=float(manifest.get("packed") or 0.0), blessed=tuple(manifest.get("blessed") or ()),
        members=len(members), version=int(manifest["version"]), extra=manifest)


def _checked(where: str, name: str, data: bytes) -> bytes:
    """A member's bytes, refused when they are neither JSON nor a codec file image (a pickle, a torch.save)."""
    why = safe_member(name)
    if why is not None:
        raise PackError(where, f"{name}: {why}")
    if not name.endswith(_JSON) and data[:len(MAGIC)] != MAGIC:
        raise PackError(where, f"{name} is not a skip_harness file image (an older torch.save payload, or a "
                        "pickle?): a pack holds none; load and rewrite that step with this version first")
    return data


def _layout_of(namespace: Any) -> Layout:
    if isinstance(namespace, Layout):
        return namespace
    try:
        found = namespaces_at(place(namespace))
    except FileNotFoundError:        # a namespace URL with nothing under it, a dump dir that is not there
        raise PackError(str(namespace), "does not exist: no namespace to pack") from None
    if len(found) != 1:
        raise PackError(str(namespace), f"names {len(found)} namespaces; a pack holds one (name its directory)")
    return found[0]


def write_pack(namespace: Any, out_path: PathLike, steps: Optional[Iterable[int]] = None) -> PackInfo:
    """Pack the committed steps of `namespace` (a namespace's path or URL, or its Layout) -- those in
    `steps` when given -- into the file `out_path` (replaced atomically). PackError when there is no
    complete step to pack, or a file is damaged or not in a form a pack holds."""
    layout = _layout_of(namespace)
    if layout.packed:
        raise PackError(layout.url, "is a pack already")
    ns = open_namespace(layout)
    report = scan_namespace(layout, ns, rewrite_index=False)
    wanted = None if steps is None else {int(s) for s in steps}
    chosen = [r for r in report.steps if r.status == StepStatus.COMPLETE and (wanted is None or r.step in wanted)]
    if not chosen:
        which = "" if wanted is None else f" among steps {_ranges(sorted(wanted))}"
        raise PackError(layout.url, f"no complete step to pack{which}")
    storage = ns.storage
    where = layout.url

    def small(key: str) -> bytes:
        data = storage.get(key)
        if data is None:
            raise CorruptStepError(ns.where(key), "missing")
        return _checked(where, key, data)

    members: List[PackMember] = []
    fingerprint: Optional[Dict[str, Any]] = None
    digests: List[str] = []
    for r in chosen:
        s = r.step
        record_bytes = small(f"{s}/{COMMIT_NAME}")
        record = parse_commit(record_bytes, layout, s, ns.where(f"{s}/{COMMIT_NAME}"))
        if fingerprint is None and record.fingerprint is not None:
            fingerprint = record.fingerprint.to_json()
        for entry in record.files:
            key = f"{s}/{entry.rel}"
            members.append(PackMember(key, entry.bytes, entry.checksum,
                                   functools.partial(small, key)))    # checked against the record when copied
        members.append(PackMember(f"{s}/{COMMIT_NAME}", len(record_bytes), checksum_bytes(record_bytes),
                               const_bytes(record_bytes)))
        extra = [e.key for e in storage.list(f"{TIER_DIR}/{s}/")]
        vkey = values_key(s)
        vdata = storage.get(vkey)
        if vdata is not None:
            extra.append(vkey)
            recorded = ValuesStore(ns).read_step(s)
            if recorded is not None and recorded.config and recorded.config not in digests:
                digests.append(recorded.config)
        if storage.get(discards_key(s)) is not None:     # what a filter discarded from it (store.discards)
            extra.append(discards_key(s))
        for key in extra:
            data = small(key)
            members.append(PackMember(key, len(data), checksum_bytes(data), const_bytes(data)))
    training_config = None
    for digest in digests:
        data = storage.get(config_key(digest))
        if data is not None:
            members.append(PackMember(config_key(digest), len(data), checksum_bytes(data), const_bytes(data)))
            training_config = ValuesStore(ns).read_config(digest)
    members.sort(key=lambda m: m.name)
    manifest = {
        "format": PACK_FORMAT, "version": PACK_VERSION, "namespace": f"{layout.group}/{layout.leaf}",
        "K": layout.K, "W": layout.W, "steps": [r.step for r in chosen], "fingerprint": fingerprint,
        "training_config": training_config, "packed": time.time(), "packed_on": socket.gethostname(),
        "commit_format": COMMIT_FORMAT, "blessed": [],
    }
    write_pack_file(Path(out_path), manifest, members)
    return read_pack_info(out_path)


def _ranges(steps: List[int]) -> str:
    out: List[str] = []
    for s in steps:
        if out and "-" not in out[-1].split(",")[-1] and int(out[-1]) + 1 == s:
            out[-1] = f"{out[-1]}-{s}"
        elif out and "-" in out[-1] and int(out[-1].split("-")[1]) + 1 == s:
            out[-1] = f"{out[-1].split('-')[0]}-{s}"
        else:
            out.append(str(s))
    return ",".join(out)


# --------------------------------------------------------------------------------------------
# unpacking


def unpack(pack_path: PathLike, dump_dir: Any) -> Any:
    """Restore the namespace the pack holds under `dump_dir` (`{dump_dir}/{experiment}_{project}/{leaf}`; a
    local path or an object-store URL, as any dump_dir),
    each step as the store writes one: its files, its second tier and values, then its commit record last
    (under the namespace's lock), every member verified as it is read. A step already there with the same
    commit record is left as it is; one there with another is refused (PackError). Returns the
    namespace's root."""
    packed = pack_layout(pack_path)
    if packed is None:
        raise PackError(str(pack_path), "not a skip_harness pack")
    src = open_namespace(packed)
    manifest = src.storage.manifest        # type: ignore[attr-defined]
    base: Any = place(dump_dir)
    layout = Layout(base / packed.group / packed.leaf, K=packed.K, W=packed.W)
    dst = open_namespace(layout)
    hold = dst.lock(0.0)
    try:
        if hold.read_only:
            raise PackError(layout.url, f"cannot be written: {hold.why}")
        names = sorted(manifest["members"])
        for step in sorted(int(s) for s in manifest.get("steps", [])):
            record_key = f"{step}/{COMMIT_NAME}"
            record = src.storage.get(record_key)
            assert record is not None
            there = dst.storage.get(record_key)
            if there is not None:
                if there == record:
                    continue
                raise PackError(dst.where(record_key), "holds another recording of this step; unpack elsewhere "
                                "or remove the step first")
            step_files = [n for n in names if n.startswith(f"{step}/") and n != record_key]
            tier = [n for n in names if n.startswith(f"{TIER_DIR}/{step}/")]
            tier.sort(key=lambda n: n.endswith(".json"))     # a tier entry's record after its values
            for name in step_files:
                data = src.storage.get(name)
                assert data is not None
                dst.write_payload(step, name.split("/", 1)[1], data, len(data))
            beside = [k for k in (values_key(step), discards_key(step)) if k in manifest["members"]]
            for name in tier + beside:
                data = src.storage.get(name)
                assert data is not None
                dst.write_small(name, data)
            dst.commit(step, record)
        for name in names:
            if name.startswith(f"{VALUES_DIR}/config-"):
                data = src.storage.get(name)
                assert data is not None
                dst.write_small(name, data)
    finally:
        hold.release()
    bad = [r for r in scan_namespace(layout, dst).steps
           if r.step in set(manifest.get("steps", [])) and r.status != StepStatus.COMPLETE]
    if bad:
        raise PackError(layout.url, f"step {bad[0].step} is {bad[0].status} after unpacking: {bad[0].reason}")
    return layout.root


# --------------------------------------------------------------------------------------------
# blessing: new expected values written into the pack


def _member_bytes(storage: Any, name: str) -> bytes:
    return storage.get(name) or b""


def bless_pack(pack_path: PathLike, values: Mapping[int, Mapping[str, float]],
               training_config: Optional[Mapping[str, Any]], reason: str,
               machine: Optional[Mapping[str, str]] = None) -> None:
    """Replace the recorded values of the steps in `values` (and, when given, the recorded training-side
    config: a nested or flattened mapping) inside the pack, and append `{"when", "reason",
    "config_changes", "steps", ...}` to its blessed history. The pack is rewritten to a temporary file
    and renamed over itself; every member copied is verified. PackError for a step the pack lacks."""
    packed = pack_layout(pack_path)
    if packed is None:
        raise PackError(str(pack_path), "not a skip_harness pack")
    src = open_namespace(packed)
    storage = src.storage
    manifest = dict(storage.manifest)        # type: ignore[attr-defined]
    steps = set(int(s) for s in manifest.get("steps", []))
    missing = sorted(set(int(s) for s in values) - steps)
    if missing:
        raise PackError(str(pack_path), f"holds no step {missing[0]} (it holds {_ranges(sorted(steps))})")
    old_store, scratch = ValuesStore(src), memory_namespace("bless")
    new_store = ValuesStore(scratch)
    before = manifest.get("training_config") or {}
    for s in sorted(values):
        old = old_store.read_step(int(s))
        if old is not None and old.config:
            before = old_store.read_config(old.config) or before
            break
    digest: Optional[str] = None
    flat: Optional[Dict[str, Any]] = None
    if training_config is not None:
        flat = flatten_config(dict(training_config))
        digest = config_digest(flat)
        new_store.write_config(digest, flat)
    for s, vals in values.items():
        step = int(s)
        old = old_store.read_step(step)
        record = src.storage.get(f"{step}/{COMMIT_NAME}")
        created = json.loads(record)["created"] if record else None
        new_store.write_step(step, {str(k): float(v) for k, v in vals.items()}, commit_created=created,
                             config=digest if digest is not None else (old.config if old else None),
                             machine=machine if isinstance(machine, Mapping) else None)
    replaced = {e.key: scratch.storage.get(e.key) for e in scratch.storage.list("")}
    members: List[PackMember] = []
    for name, listed in manifest["members"].items():
        if name in replaced:
            continue
        members.append(PackMember(name, int(listed["bytes"]), str(listed["checksum"]),
                               functools.partial(_member_bytes, storage, name)))
    for name, data in replaced.items():
        assert data is not None
        members.append(PackMember(name, len(data), checksum_bytes(data), const_bytes(data)))
    members.sort(key=lambda m: m.name)
    changes = [] if flat is None else [{"key": k, "recorded": a, "now": b} for k, a, b in config_changes(before, flat)]
    blessing: Dict[str, Any] = {
        "when": time.time(), "when_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "reason": str(reason),
        "steps": sorted(int(s) for s in values), "config_changes": changes, "host": socket.gethostname(),
    }
    if flat is not None:
        manifest["training_config"] = flat
    manifest["blessed"] = list(manifest.get("blessed") or []) + [blessing]
    manifest.pop("members", None)
    write_pack_file(Path(pack_path), manifest, members)
    storage.close()                          # type: ignore[attr-defined]


__all__ = ["PackInfo", "bless_pack", "read_pack_info", "unpack", "write_pack"]
