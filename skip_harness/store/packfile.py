"""A pack file as a read-only storage: one recording (or a range of its steps) in one file, served in place.

The format (`skip-harness pack`, `store.pack`): a ZIP archive whose members are *stored* (no ZIP
compression: a payload is already compressed by the codec, and a stored member is a plain byte range of
the file, read at its offset with no unpacking), named by the namespace's own keys (`3/commit.json`,
`3/0/tq_batch.pt`, `.values/3.json`, `.tier/3/...`). Its first member is the manifest,
`.skip-harness-pack.json` (JSON): the format and its version, the namespace's name (its leaf gives the
batch shape, K and W), its steps and bytes, the generation fingerprint, when it was packed, its blessed
history, and every other member's size and xxh3-128 checksum (the store's checksum, `store.checksum`).
A pack is told by its first bytes (a ZIP local header naming the manifest), never by its extension.

Why a ZIP: random access through the central directory, a format every language and `unzip -l` read,
nothing to decode that could run code (no pickle: a member named like one -- `.pkl`, `.pickle`, verl's
`.dp` -- makes the whole pack refused, and every member is JSON or a codec file image, checked by its
magic when read), and the stdlib writes it.

`PackStorage` implements `store.storage.Storage` over such a file: listings from the manifest, every
member's bytes checked against the manifest's size and checksum in the pass that reads them (a flipped
byte is a `CorruptStepError` naming the pack and the member); every write refused (`PackReadOnly`).
`PackLocker` gives a read-only hold: a run served from a pack (`replay_from`) keeps its own values in
its own namespace. Absolute paths are nowhere inside: a pack copied to another machine is the same pack.
"""
from __future__ import annotations

import json
import os
import struct
import threading
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple, Union

from skip_harness.codec import MAGIC
from skip_harness.errors import CorruptStepError, StoreError
from skip_harness.store.checksum import check_read, checksum_bytes
from skip_harness.store.locking import Hold, Locker
from skip_harness.store.storage import DIR, FILE, Capabilities, Entry, Storage

MANIFEST_NAME = ".skip-harness-pack.json"
PACK_FORMAT = "skip_harness pack"
PACK_VERSION = 1
#: member names a pack never holds: pickles (a pack loads without running anything from it)
PICKLE_SUFFIXES = (".pkl", ".pickle", ".pck", ".dp", ".npy.pkl", ".joblib")
_LOCAL = struct.Struct("<4sHHHHHIIIHH")       # a ZIP local file header (30 bytes)
_LOCAL_MAGIC = b"PK\x03\x04"
_JSON_SUFFIXES = (".json", ".jsonl")
_EPOCH = (1980, 1, 1, 0, 0, 0)        # every member's ZIP time: a pack's bytes depend on its contents only
READ_ONLY = "a pack file is read only (skip-harness unpack FILE DUMP_DIR restores a namespace that can be written)"


class PackError(StoreError):
    """A file that is not a pack skip_harness can read, or a damaged one (its path, what is wrong)."""


class PackReadOnly(StoreError):
    """A write to a pack: packs are never written in place."""


def is_pack(path: Union[str, os.PathLike]) -> bool:
    """Whether `path` is a pack file: a regular file (not a link) that starts with a ZIP local header
    naming the manifest. Reads 64 bytes; never raises for a path that is not one."""
    try:
        if not os.path.isfile(path) or os.path.islink(path):
            return False
        with open(path, "rb") as f:
            head = f.read(_LOCAL.size + len(MANIFEST_NAME))
    except OSError:
        return False
    if len(head) < _LOCAL.size + len(MANIFEST_NAME) or head[:4] != _LOCAL_MAGIC:
        return False
    name_len = _LOCAL.unpack(head[:_LOCAL.size])[9]
    return name_len == len(MANIFEST_NAME) and head[_LOCAL.size:] == MANIFEST_NAME.encode()


def pickle_like(name: str) -> bool:
    low = name.lower()
    return low.endswith(PICKLE_SUFFIXES)


def safe_member(name: str) -> Optional[str]:
    """Why a member's name is not one a pack holds, else None."""
    if not name or name.startswith("/") or "\\" in name or name.endswith("/"):
        return "not a relative file name"
    if any(part in ("", ".", "..") for part in name.split("/")):
        return "a name with an empty, '.' or '..' part"
    if pickle_like(name):
        return "named like a pickle: a pack holds no pickle"
    return None


def read_manifest(path: Union[str, os.PathLike]) -> Tuple[Dict[str, Any], Dict[str, zipfile.ZipInfo]]:
    """The manifest of the pack at `path` and its members (name -> ZipInfo), checked: the format and
    version, member names, no ZIP compression, every member listed in the manifest with its size.
    PackError naming the path otherwise."""
    where = str(path)
    if not is_pack(path):
        raise PackError(where, f"not a skip_harness pack (its first member is not {MANIFEST_NAME})")
    try:
        with zipfile.ZipFile(path) as zf:
            infos = zf.infolist()
            manifest = json.loads(zf.read(MANIFEST_NAME))      # CRC-32 checked by zipfile
    except (zipfile.BadZipFile, OSError, ValueError, KeyError) as exc:
        raise PackError(where, f"a damaged pack: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != PACK_FORMAT:
        raise PackError(where, f"its manifest is not a {PACK_FORMAT!r} manifest")
    version = manifest.get("version")
    if not isinstance(version, int) or version > PACK_VERSION or version < 1:
        raise PackError(where, f"pack format version {version!r}: this skip_harness reads version {PACK_VERSION}"
                        " (written by a newer skip_harness?)")
    listed = manifest.get("members")
    if not isinstance(listed, dict):
        raise PackError(where, "its manifest lists no members")
    members: Dict[str, zipfile.ZipInfo] = {}
    for info in infos:
        name = info.filename
        if name == MANIFEST_NAME:
            continue
        why = safe_member(name)
        if why is not None:
            raise PackError(where, f"member {name!r}: {why}")
        if info.compress_type != zipfile.ZIP_STORED:
            raise PackError(where, f"member {name!r} is compressed inside the ZIP; a pack stores its members")
        entry = listed.get(name)
        if not isinstance(entry, dict) or entry.get("bytes") != info.file_size:
            raise PackError(where, f"member {name!r} is not in the manifest with its size {info.file_size}")
        members[name] = info
    missing = sorted(set(listed) - set(members))
    if missing:
        raise PackError(where, f"member {missing[0]!r} is in the manifest but not in the pack")
    return manifest, members


# ---- writing a pack file: the manifest first, then every member (stored), into a temporary file renamed


def const_bytes(data: bytes) -> Callable[[], bytes]:
    return lambda: data


@dataclass
class PackMember:
    """One member to write: its name, size and checksum (for the manifest), and how to read its bytes."""

    name: str
    size: int
    checksum: str
    read: Callable[[], bytes]


def write_pack_file(out: Path, manifest: Dict[str, Any], members: List[PackMember]) -> None:
    """Write the pack at `out` atomically: a temporary file beside it, fsynced, renamed over it. Every
    member's bytes are checked against its size and checksum as they are copied (PackError otherwise)."""
    manifest = dict(manifest, members={m.name: {"bytes": m.size, "checksum": m.checksum} for m in members})
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".tmp-{out.name}.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            with zipfile.ZipFile(f, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
                zf.writestr(zipfile.ZipInfo(MANIFEST_NAME, _EPOCH),     # first: what `is_pack` looks for
                            json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode())
                for m in members:
                    data = m.read()
                    if len(data) != m.size or checksum_bytes(data) != m.checksum:
                        raise PackError(m.name, f"changed or damaged while it was packed ({len(data)} bytes, "
                                        f"expected {m.size} with checksum {m.checksum})")
                    info = zipfile.ZipInfo(m.name, _EPOCH)
                    info.file_size = len(data)
                    zf.writestr(info, data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            tmp.unlink()
    try:
        fd = os.open(out.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass




def pack_file_size(path: Union[str, os.PathLike]) -> int:
    """The pack file's size in bytes."""
    return os.path.getsize(path)


class PackStorage(Storage):
    """The members of one pack file, read in place (os.pread at each member's offset), each checked
    against the manifest. Every write raises PackReadOnly."""

    caps = Capabilities(mmap=False, access_times=False, append=False, atomic_rename=False, directories=False)

    def __init__(self, path: Union[str, os.PathLike]):
        self.path = Path(path)
        self.url = str(path)
        self.manifest, self._infos = read_manifest(path)
        self._sums: Dict[str, Tuple[int, str]] = {
            name: (int(e["bytes"]), str(e.get("checksum", ""))) for name, e in self.manifest["members"].items()}
        self._offsets: Dict[str, int] = {}
        self._guard = threading.Lock()
        self._fd: Optional[int] = None
        packed = self.manifest.get("packed")
        self._mtime = int(float(packed) * 1e9) if isinstance(packed, (int, float)) else None

    def where(self, key: str = "") -> str:
        return f"{self.url} (member {key})" if key else self.url

    def close(self) -> None:
        with self._guard:
            fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def __del__(self) -> None:  # pragma: no cover - best effort
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass

    # ---- the bytes of a member
    def _file(self) -> int:
        with self._guard:
            if self._fd is None:
                self._fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            return self._fd

    def _offset(self, key: str) -> int:
        off = self._offsets.get(key)
        if off is None:
            info = self._infos[key]
            head = os.pread(self._file(), _LOCAL.size, info.header_offset)
            if len(head) != _LOCAL.size or head[:4] != _LOCAL_MAGIC:
                raise CorruptStepError(self.where(key), "its ZIP local header is damaged")
            fields = _LOCAL.unpack(head)
            off = info.header_offset + _LOCAL.size + fields[9] + fields[10]
            self._offsets[key] = off
        return off

    def _read_into(self, key: str, view: memoryview) -> int:
        off, got, fd = self._offset(key), 0, self._file()
        while got < len(view):
            n = os.preadv(fd, [view[got:]], off + got)
            if n <= 0:
                break
            got += n
        return got

    def _check_kind(self, key: str, head: Any) -> None:
        if not key.endswith(_JSON_SUFFIXES) and bytes(head[:len(MAGIC)]) != MAGIC:
            raise CorruptStepError(self.where(key), "neither JSON nor a skip_harness file image: a pack holds no "
                                   "other kind of file (no pickle)")

    def _known(self, key: str) -> Optional[Tuple[int, str]]:
        return self._sums.get(key)

    # ---- reading
    def get(self, key: str) -> Optional[bytes]:
        known = self._known(key)
        if known is None:
            return None
        size, checksum = known
        buf = bytearray(size)
        got = self._read_into(key, memoryview(buf))
        where = self.where(key)
        if got != size:
            raise CorruptStepError(where, f"{got} bytes, the pack's manifest says {size}")
        digest = checksum_bytes(buf)
        if digest != checksum:
            raise CorruptStepError(where, f"checksum {digest} does not match the pack's manifest ({checksum})")
        self._check_kind(key, buf)
        return bytes(buf)

    def get_stamped(self, key: str) -> Tuple[Optional[bytes], Optional[str]]:
        data = self.get(key)
        return (None, None) if data is None else (data, self._sums[key][1])

    def get_verified(self, key: str, size: int, checksum: str, pool: Any) -> Any:
        where = self.where(key)
        known = self._known(key)
        if known is None:
            raise CorruptStepError(where, "missing from the pack")
        if known != (size, checksum):
            raise CorruptStepError(where, f"the pack's manifest says {known[0]} bytes, checksum {known[1]}; the "
                                   f"commit record says {size}, {checksum}")
        lease = pool.acquire(size)
        try:
            got = self._read_into(key, lease.view(size))
        except BaseException:
            lease.release()
            raise
        check_read(where, lease, got, size, checksum)
        try:
            self._check_kind(key, lease.view(min(size, len(MAGIC))))
        except BaseException:
            lease.release()
            raise
        return lease

    def _entry(self, key: str) -> Entry:
        size, checksum = self._sums[key]
        return Entry(key, FILE, size, checksum, self._mtime, None)

    def stat(self, key: str) -> Optional[Entry]:
        if key in self._sums:
            return self._entry(key)
        prefix = key.rstrip("/") + "/"
        return Entry(key.rstrip("/"), DIR) if key and any(k.startswith(prefix) for k in self._sums) else None

    def list(self, prefix: str = "") -> Iterator[Entry]:
        return iter([self._entry(k) for k in sorted(self._sums) if k.startswith(prefix)])

    def list_dir(self, prefix: str = "") -> List[Entry]:
        if prefix and not prefix.endswith("/"):
            prefix += "/"
        out: Dict[str, Entry] = {}
        for k in self._sums:
            if not k.startswith(prefix):
                continue
            head, sep, _ = k[len(prefix):].partition("/")
            key = prefix + head
            out[key] = Entry(key, DIR) if sep else self._entry(key)
        return [out[k] for k in sorted(out)]

    # ---- writing: never
    def _refuse(self, key: str) -> Any:
        raise PackReadOnly(self.where(key), READ_ONLY)

    def put(self, key: str, data: Any, nbytes: Optional[int] = None) -> int:
        return self._refuse(key)

    def put_if_absent(self, key: str, data: Any) -> Optional[str]:
        return self._refuse(key)

    def delete(self, key: str) -> int:
        return self._refuse(key)

    def delete_prefix(self, prefix: str) -> int:
        return self._refuse(prefix)

    def copy(self, src: str, dst: str) -> None:
        self._refuse(dst)


class _ReadOnlyHold(Hold):
    why = READ_ONLY

    def release(self) -> None:
        return None


class PackLocker(Locker):
    """A pack's lock: nobody ever holds it for writing; every hold is read-only."""

    def __init__(self, url: str):
        self.url = url

    def lock(self, timeout: float = 0.0) -> Hold:
        return _ReadOnlyHold()

    def writable(self) -> Optional[str]:
        return READ_ONLY

    def fence(self, strict: bool = False, key: str = "") -> None:
        raise PackReadOnly(f"{self.url} (member {key})" if key else self.url, READ_ONLY)


__all__ = ["MANIFEST_NAME", "PACK_FORMAT", "PACK_VERSION", "PackError", "PackLocker", "PackMember", "PackReadOnly",
           "PackStorage", "const_bytes", "is_pack", "pack_file_size", "pickle_like", "read_manifest", "safe_member",
           "write_pack_file"]
