"""Storage backends by URL scheme: what `store.open` opens a dump_dir or a namespace through.

A backend is a `Backend`: the URL schemes it serves, the storage of a dump_dir (whose listing shows the
`{experiment}_{project}/{leaf}` namespaces under it) and the storage and locker of one namespace. What
it stores is the storage's business (`store.storage.Storage`, the ten operations and their docstrings);
who may write is the locker's (`store.locking.Locker`); the commit protocol above them (`Namespace`) is
written once for every backend and never by one.

skip_harness's own register themselves in `store.open` with `register_backend`: `file` (a local path:
the POSIX directory, `store.posix`), `pack` (a local path whose first bytes are a pack file's, which the
pack backend `claims`: `store.packfile`, read only) and the object stores' schemes (`s3`, `gs`, `az`, ..., `memory`:
`store.objstore`, extra [s3]). A package adds its own without touching skip_harness, by the entry point
group `skip_harness.backends` in its pyproject.toml -- the name is the scheme, the object a `Backend`
subclass, an instance of one, or a callable returning one, loaded the first time its scheme is used:

    [project.entry-points."skip_harness.backends"]
    mydb = "my_package.backend:MyDbBackend"

or at run time with `register_backend(MyDbBackend())`. Then `dump_dir: mydb://where/prefix` opens it.
`skip_harness.testing.store_tests.StoreTests` holds the protocol's tests a backend inherits
(docs/store.md#adding-a-backend).
"""
from __future__ import annotations

import abc
import importlib.metadata
import threading
from typing import Any, Dict, List, Optional, Tuple

from skip_harness.errors import SkipHarnessError
from skip_harness.store.layout import Layout
from skip_harness.store.locking import Locker
from skip_harness.store.storage import Storage

ENTRY_POINT_GROUP = "skip_harness.backends"


class Backend(abc.ABC):
    """A kind of storage the cache can live on, chosen by the scheme of its URL (`file` for a local path)."""

    #: the URL schemes it serves, lower case (`("mydb",)` serves `mydb://...`)
    schemes: Tuple[str, ...] = ()

    @abc.abstractmethod
    def dump_dir(self, url: str) -> Storage:
        """The storage of the dump_dir at `url` (a path for `file`): its keys are `{experiment}_{project}/
        {leaf}/...`, so its `list_dir` shows the namespaces. Opened without a request where the backend can
        (a listing reaches the storage). Errors: `SkipHarnessError` (a message naming `url`)."""

    @abc.abstractmethod
    def namespace(self, layout: Layout) -> Tuple[Storage, Locker]:
        """The storage of the namespace `layout` names (`layout.root`: a `Path`, or a `UrlPath` whose text
        is `{dump_dir url}/{experiment}_{project}/{leaf}`; `layout.K`, `layout.W` its shape) and the
        locker that lets one run write it. Each call opens it afresh (a run opens its namespace once and
        hands it down: nothing is kept between calls)."""

    def claims(self, layout: Layout) -> bool:
        """Whether a local layout (no scheme names its backend) is this backend's rather than the `file`
        one's: the pack file's says so for a file whose first bytes are a pack's. By default: never."""
        return False

    def holder(self, layout: Layout) -> Optional[Any]:
        """Who holds the lock of the local namespace `layout` names, read without trying the lock and never
        through a link (an object with `pid`, `host`, `since`, `describe()` and `to_json()`), or None: no
        record, or a backend whose locker says only once opened (`Namespace.holder()`). By default: None."""
        return None


class NoBackendError(SkipHarnessError):
    """No backend is registered for a URL's scheme (nor found under the entry point group)."""

    def __init__(self, scheme: str, known: List[str]):
        self.scheme = scheme
        super().__init__(f"no storage backend serves {scheme}:// (registered: {', '.join(known) or 'none'}; a "
                         f"package adds one under the entry point group {ENTRY_POINT_GROUP!r}, or calls "
                         "skip_harness.store.registry.register_backend)")


class BackendLoadError(SkipHarnessError):
    """An entry point of `skip_harness.backends` did not load or gave no `Backend`."""


_backends: Dict[str, Backend] = {}       # scheme -> the backend that serves it
_guard = threading.Lock()


def register_backend(backend: Backend, *, replace: bool = False) -> Backend:
    """Serve `backend.schemes` with `backend` from now on (returned). ValueError when a scheme is served by
    another backend already, unless `replace`; or when it names no scheme."""
    if not isinstance(backend, Backend):
        raise TypeError(f"register_backend takes a skip_harness.store.registry.Backend, got {type(backend).__name__}")
    schemes = [s.lower() for s in backend.schemes]
    if not schemes:
        raise ValueError(f"{type(backend).__name__}.schemes names no URL scheme")
    with _guard:
        for scheme in schemes:
            other = _backends.get(scheme)
            if other is not None and other is not backend and not replace:
                raise ValueError(f"scheme {scheme!r} is served by {type(other).__name__} already "
                                 "(register_backend(..., replace=True) to replace it)")
        for scheme in schemes:
            _backends[scheme] = backend
    return backend


def unregister_backend(backend: Backend) -> None:
    """Serve none of `backend`'s schemes any more (a test's cleanup)."""
    with _guard:
        for scheme in [s for s, b in _backends.items() if b is backend]:
            del _backends[scheme]


def registered_schemes() -> List[str]:
    """The schemes served now, sorted (entry points not yet loaded are not among them)."""
    with _guard:
        return sorted(_backends)


def backend_for(scheme: str) -> Backend:
    """The backend serving `scheme`: a registered one, else the entry point of that name in the group
    `skip_harness.backends` (loaded and registered). NoBackendError when there is none; BackendLoadError
    naming the entry point when it does not load."""
    scheme = scheme.lower()
    with _guard:
        found = _backends.get(scheme)
    if found is not None:
        return found
    point = _entry_point(scheme)
    if point is None:
        raise NoBackendError(scheme, registered_schemes())
    backend = _load(point)
    if scheme not in [s.lower() for s in backend.schemes]:
        raise BackendLoadError(f"entry point {point.name} = {point.value} (group {ENTRY_POINT_GROUP!r}) gives "
                               f"{type(backend).__name__}, whose schemes {backend.schemes!r} leave out {scheme!r}")
    with _guard:
        return _backends.setdefault(scheme, backend)


def backend_claiming(layout: Layout) -> Optional[Backend]:
    """The registered backend that claims the local `layout` (`Backend.claims`), None when none does (then
    the `file` backend serves it)."""
    with _guard:
        backends = list(dict.fromkeys(_backends.values()))
    return next((b for b in backends if b.claims(layout)), None)


def _entry_point(scheme: str) -> Optional[importlib.metadata.EntryPoint]:
    for point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if point.name.lower() == scheme:
            return point
    return None


def _load(point: importlib.metadata.EntryPoint) -> Backend:
    where = f"entry point {point.name} = {point.value} (group {ENTRY_POINT_GROUP!r})"
    try:
        obj: Any = point.load()
        backend = obj() if not isinstance(obj, Backend) and callable(obj) else obj
    except Exception as exc:        # a third party's import or constructor: named, never a traceback
        raise BackendLoadError(f"{where} failed to load: {type(exc).__name__}: {exc}") from None
    if not isinstance(backend, Backend):
        raise BackendLoadError(f"{where} gives {type(backend).__name__}, not a skip_harness.store.registry.Backend")
    return backend


__all__ = ["ENTRY_POINT_GROUP", "Backend", "BackendLoadError", "NoBackendError", "backend_claiming", "backend_for", "register_backend",
           "registered_schemes", "unregister_backend"]
