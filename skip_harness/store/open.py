"""Opening a cache: a dump_dir or a namespace's layout -> its `Namespace` on the backend its URL's scheme names.

The backends are looked up by scheme in `store.registry` (where a package registers its own: an entry
point of the group `skip_harness.backends`). skip_harness's own are defined and registered here, the
only module that imports them (an import-linter contract holds it): a local path (`file`) opens the POSIX
storage with its flock locker, a local pack file (`pack`, which claims a path by its first bytes:
`Backend.claims`) the read-only pack
storage (`store.packfile`, whose format names `store.pack` takes from here), an object-store URL (`s3`,
`gs`, `az`, ..., `memory`) the object store's (`store.objstore`, which needs the [s3] extra; imported only
when a URL is used).

A namespace is opened once -- by a run's startup (`run.startup`), by a command -- and handed down to
everything that reads or writes it (the scan, the cleanup, the step store): an object store's namespace
holds its client and the lease the run takes, which every write of the run checks. Nothing here keeps
namespaces between calls (a test holds it: tests/test_layers.py).
"""
from __future__ import annotations

import importlib
import os
from typing import Any, Callable, List, Optional, Tuple, Union

from skip_harness.codec import StoredForm
from skip_harness.errors import ConfigError, SkipHarnessError
from skip_harness.store.bufferpool import BufferPool
from skip_harness.store.layout import Layout, parse_namespace_leaf
from skip_harness.store.locking import Locker
from skip_harness.store.memory import MemoryLocker, MemoryStorage
from skip_harness.store.namespace import Namespace
from skip_harness.store.packfile import (MANIFEST_NAME, PACK_FORMAT, PACK_VERSION, PackError, PackLocker, PackMember,
                                         PackReadOnly, PackStorage, const_bytes, is_pack, pack_file_size, read_manifest,
                                         safe_member, write_pack_file)
from skip_harness.store.posix.holder import LockHolder, read_holder
from skip_harness.store.posix.lock import FlockLocker
from skip_harness.store.posix.processes import process_runs_since  # noqa: F401  (the store's face re-exports it)
from skip_harness.store.posix.storage import PosixStorage
from skip_harness.store.registry import (Backend, BackendLoadError, NoBackendError, backend_claiming, backend_for,
                                        register_backend)
from skip_harness.store.stepstore import StepStore
from skip_harness.store.storage import DIR, Storage
from skip_harness.store.urls import (DUMP_DIR_KEY, URL_SCHEMES, UrlPath, dump_dir_problem, is_url, join_url, local_path,
                                     url_scheme)

LOCAL_SCHEME = "file"       # a local path (or a file:// URL)
PACK_SCHEME = "pack"        # a local path whose first bytes are a pack file's


class DumpDir:
    """A dump_dir: the namespaces under it (`{experiment}_{project}/{shape leaf}`), listed through its
    storage (directories on POSIX, key prefixes on an object store; links never followed)."""

    def __init__(self, storage: Storage, opener: Callable[[str], Namespace]):
        self.storage = storage
        self.url = storage.url
        self._opener = opener

    def namespace(self, rel: str) -> Namespace:
        """The namespace at `rel` (`'{experiment}_{project}/GBS...'`) under this dump_dir."""
        leaf = rel.rstrip("/").rsplit("/", 1)[-1]
        if parse_namespace_leaf(leaf) is None:
            raise ValueError(f"{join_url(self.url, rel)}: {leaf!r} is not a namespace name")
        return self._opener(rel)

    def list_namespaces(self) -> List[str]:
        """The `rel` of every namespace under this dump_dir (two levels), sorted."""
        out: List[str] = []
        for group in self.storage.list_dir(""):
            if group.kind != DIR or group.name.startswith("."):
                continue
            try:
                leaves = self.storage.list_dir(group.key)
            except OSError:
                continue
            out += [leaf.key for leaf in leaves if leaf.kind == DIR and parse_namespace_leaf(leaf.name) is not None]
        return sorted(out)


def memory_namespace(name: str = "namespace") -> Namespace:
    """A namespace held in this process's memory (the reference storage, `store.memory`: no URL, so no
    scheme or backend names it): a scratch namespace (store.pack's bless) and the protocol's tests."""
    url = f"memory:{name}"
    return Namespace(MemoryStorage(url), MemoryLocker(url))


# ---- skip_harness's own backends, registered as a package's would be (store.registry)


class PosixBackend(Backend):
    """A directory on a local or shared file system (`store.posix`), locked by flock."""

    schemes = (LOCAL_SCHEME,)

    def dump_dir(self, url: str) -> Storage:
        return PosixStorage(local_path(url))

    def namespace(self, layout: Layout) -> Tuple[Storage, Locker]:
        return PosixStorage(layout.root), FlockLocker(layout)

    def holder(self, layout: Layout) -> Optional[LockHolder]:
        return read_holder(layout)        # its flock lock's record: pid, host, since


class PackBackend(Backend):
    """A pack file (`store.packfile`): one namespace, read in place, never written."""

    schemes = (PACK_SCHEME,)

    def dump_dir(self, url: str) -> Storage:
        raise PackError(url, "a pack file holds one namespace, read in place: name the file itself, not a "
                        "dump_dir in it")

    def namespace(self, layout: Layout) -> Tuple[Storage, Locker]:
        storage = PackStorage(layout.root)
        return storage, PackLocker(storage.url)

    def claims(self, layout: Layout) -> bool:
        return layout.packed or is_pack(layout.root)     # named by its manifest, or told by its first bytes


class ObjectStoreBackend(Backend):
    """An S3-compatible bucket, GCS, Azure or obstore's in-process `memory://` (`store.objstore`, on obstore:
    the [s3] extra, imported the first time a URL is opened); its locker is a lease object."""

    schemes = URL_SCHEMES

    def _objstore(self, url: str) -> Any:
        try:
            objstore = importlib.import_module("skip_harness.store.objstore")
            return objstore.open_storage, objstore.open_locker
        except (ImportError, AttributeError) as exc:
            raise ConfigError(
                DUMP_DIR_KEY,
                f"{url}: object storage needs the [s3] extra (pip install 'skip_harness[s3]'): {exc}",
            ) from None

    def dump_dir(self, url: str) -> Storage:
        open_storage, _ = self._objstore(url)
        return open_storage(url, dump_dir=True)

    def namespace(self, layout: Layout) -> Tuple[Storage, Locker]:
        open_storage, open_locker = self._objstore(str(layout.root))
        storage = open_storage(str(layout.root))
        return storage, open_locker(storage)      # its client, and the lease's locker


for _builtin in (PosixBackend(), PackBackend(), ObjectStoreBackend()):
    register_backend(_builtin)
del _builtin


# ---- opening


def _on(url: str, opening: Callable[[], Any]) -> Any:
    """`opening()` for the URL `url`, its failures a ConfigError naming the dump_dir's key and `url`."""
    try:
        return opening()
    except ConfigError:
        raise
    except (NoBackendError, BackendLoadError) as exc:
        raise ConfigError(DUMP_DIR_KEY, f"{url}: {exc}") from None
    except SkipHarnessError as exc:
        raise ConfigError(DUMP_DIR_KEY, str(exc) if str(exc).startswith(url) else f"{url}: {exc}") from None
    except ValueError as exc:
        raise ConfigError(DUMP_DIR_KEY, f"{url}: not a URL the {url_scheme(url)}:// backend can open: {exc}") from None


def open_dump_dir(dump_dir: Union[str, os.PathLike]) -> DumpDir:
    """The DumpDir of a dump_dir, on the backend its scheme names (`store.registry`): a local path -> POSIX;
    `s3://`, `gs://`, ... -> the object store (`skip_harness.store.objstore`, which needs the [s3] extra);
    a registered backend's scheme -> that backend. ConfigError naming `skip.rollout_tq.dump_dir` when the
    URL cannot be served here."""
    why = dump_dir_problem(dump_dir)
    if why is not None:
        raise ConfigError(DUMP_DIR_KEY, why)
    if isinstance(dump_dir, os.PathLike) or not is_url(dump_dir):
        root = local_path(dump_dir)
        local = backend_for(LOCAL_SCHEME)

        def on_disk(rel: str) -> Namespace:
            kw = parse_namespace_leaf(rel.rstrip("/").rsplit("/", 1)[-1])
            assert kw is not None
            return Namespace(*local.namespace(Layout(root / rel, K=kw[0], W=kw[1])))

        return DumpDir(local.dump_dir(str(root)), on_disk)
    url = str(dump_dir)
    backend: Backend = _on(url, lambda: backend_for(url_scheme(url) or ""))
    storage: Storage = _on(url, lambda: backend.dump_dir(url))

    def at_url(rel: str) -> Namespace:
        kw = parse_namespace_leaf(rel.rstrip("/").rsplit("/", 1)[-1])
        assert kw is not None
        layout = Layout(UrlPath(join_url(storage.url, rel)), K=kw[0], W=kw[1])  # type: ignore[arg-type]
        return Namespace(*backend.namespace(layout))

    return DumpDir(storage, at_url)


def pack_layout(path: Union[str, os.PathLike]) -> Optional[Layout]:
    """The Layout of the pack file at `path` (its K and W, and its namespace's name, from its manifest),
    None when `path` is no pack. PackError when it looks like one but its manifest cannot be read."""
    if is_url(path) or not is_pack(path):
        return None
    manifest, _ = read_manifest(path)
    name = str(manifest.get("namespace", ""))
    kw = parse_namespace_leaf(name.rsplit("/", 1)[-1])
    if kw is None:
        raise PackError(str(path), f"its manifest names no namespace ({name!r})")
    return Layout(local_path(path), K=kw[0], W=kw[1], name=name)


def open_namespace(layout: Layout) -> Namespace:
    """The namespace of a Layout, on its backend: the POSIX one for a directory, the read-only pack one for
    a pack file (`layout.packed`, or a path that is a pack file), the backend of its URL's scheme for a URL
    layout (`layout.is_url`: the object store's, or a registered one's). Opened once by each run
    (`run.startup`) and each command, and handed down: an object store's namespace holds its client and
    the lease the run takes, which its writes check."""
    if not layout.is_url:
        return Namespace(*_local_backend(layout).namespace(layout))
    root = layout.root
    return open_dump_dir(str(root.parent.parent)).namespace(f"{root.parent.name}/{root.name}")


def _local_backend(layout: Layout) -> Backend:
    """The backend of a local layout: the one that claims it (`Backend.claims`), else the `file` one."""
    return backend_claiming(layout) or backend_for(LOCAL_SCHEME)


def read_lock_holder(layout: Layout) -> Optional[LockHolder]:
    """Who holds a local namespace's lock (its holder record: pid, host, since), read by its backend
    (`Backend.holder`) without trying the lock and never through a link; None for a URL (an object store's
    lease says, once opened: `Namespace.holder()`), or when there is no record."""
    if layout.is_url:
        return None
    holder: Optional[LockHolder] = _local_backend(layout).holder(layout)
    return holder


def open_store(layout: Layout, *, pool: Optional[BufferPool] = None, form: Optional[StoredForm] = None) -> StepStore:
    """The steps of a layout's namespace, opened here (`open_namespace`): for a caller that opens one
    namespace for one job (a command, a test, a benchmark). A run opens its namespace at startup instead,
    and builds its `StepStore` on that one."""
    return StepStore(layout, open_namespace(layout), pool=pool, form=form)


__all__ = ["LOCAL_SCHEME", "MANIFEST_NAME", "PACK_FORMAT", "PACK_SCHEME", "PACK_VERSION", "DumpDir", "ObjectStoreBackend",
           "PackBackend", "PackError", "PosixBackend", "PackMember", "PackReadOnly",
           "const_bytes", "is_pack", "pack_file_size", "read_manifest", "safe_member", "write_pack_file", "memory_namespace", "open_dump_dir", "open_namespace", "open_store", "pack_layout"]
