"""The tests' handle on a namespace on an object store: the one commit protocol (`store.namespace.Namespace`)
over the object storage (`storage.ObjectStorage`) and its lease (`locker.LeaseLocker`) -- what
`store.open.open_namespace` builds for a URL -- plus the few conveniences the tests use (the lease held by
hand: `acquire` / `release`, `write`, `read_checked`). Test code: it lived in the package as
`store/objstore/backend.py`, the layer contract's one exception (issue 29).

Keys are those of the POSIX layout, relative to the namespace URL (`s3://bucket/prefix/{exp}_{proj}/
GBS...`): `{step}/[{i}/]tq_batch[_rank{r}].pt`, `.../meta[_rank{r}].json`, `{step}/commit.json`,
`.lock` (the lease), `.quarantine/...`. What is particular to an object store -- create-only puts and
their fencing, the copy that sets a step aside, the index rewritten once at release instead of appended
-- follows from its capabilities (`ObjectStorage.caps`) in the namespace and the index, not from code here.
"""
from __future__ import annotations

from typing import Any, Dict, Iterator, List, Optional

from skip_harness.store.layout import COMMIT_NAME, parse_step_name
from skip_harness.store.namespace import Namespace
from skip_harness.store.objstore.client import ObjectClient
from skip_harness.store.objstore.lease import NamespaceLease
from skip_harness.store.objstore.locker import LeaseHold, LeaseLocker
from skip_harness.store.objstore.storage import ObjectStorage
from skip_harness.store.storage import DIR
from skip_harness.store.urls import join_url

QUARANTINE_DIR = ".quarantine"


class ObjectNamespace(Namespace):
    """The namespace at `url` (an object-store URL)."""

    storage: ObjectStorage
    locker: LeaseLocker

    def __init__(self, url: str, client: Optional[ObjectClient] = None):
        storage = ObjectStorage(url, client)
        super().__init__(storage, LeaseLocker(storage))

    def __repr__(self) -> str:
        return f"ObjectNamespace({self.url!r})"

    @property
    def client(self) -> ObjectClient:
        return self.storage.client

    @property
    def read_only(self) -> bool:
        return self.storage.denied is not None

    @property
    def held(self) -> Optional[NamespaceLease]:
        return self.locker.held

    @staticmethod
    def step_key(step: int, rel: str = "") -> str:
        return f"{int(step)}/{rel}" if rel else str(int(step))

    def key_url(self, key: str) -> str:
        return self.where(key)

    # ---- the lease, held by hand (the harness holds it through `lock`)

    def lease(self, **kw: Any) -> NamespaceLease:
        return self.locker.lease(**kw)

    def acquire(self, timeout: float = 0.0, **kw: Any) -> Optional[NamespaceLease]:
        """Hold the namespace (`LeaseLocker.acquire`): the lease, or None for a read-only credential."""
        return self.locker.acquire(timeout, **kw)

    def release(self) -> None:
        """Give back the lease `acquire` took, first running the release hooks (the index) while it is ours."""
        held = self.locker.held
        if held is None:
            return
        if not held.lost.is_set():
            self.run_release_hooks()
        self.locker.give_back(held)

    # ---- conveniences

    def write(self, step: int, rel: str, data: Any) -> int:
        """Put one file of `step` (create-only, fenced, its size checked); returns the size."""
        return self.write_payload(step, rel, data, memoryview(data).nbytes)

    def read_checked(self, step: int, rel: str, size: int, xxh3_128: str, out: Any = None) -> Any:
        """`ObjectStorage.read_checked` of file `rel` of `step`."""
        return self.storage.read_checked(self.step_key(step, rel), size, xxh3_128, out)

    def read_commit(self, step: int) -> Optional[bytes]:
        return self.read_small(self.step_key(step, COMMIT_NAME))

    def objects(self) -> Iterator[Dict[str, Any]]:
        """Every object of the namespace (one recursive listing)."""
        return self.client.list(None)

    def step_numbers(self) -> List[int]:
        """Only the step numbers (a delimiter listing: one request per 1000 steps)."""
        return sorted(s for s in (parse_step_name(e.name) for e in self.storage.list_dir("") if e.kind == DIR)
                      if s is not None)


def list_namespaces(dump_dir_url: str, client: Optional[ObjectClient] = None) -> List[str]:
    """The namespace URLs under a dump_dir URL: `{dump_dir}/{exp}_{proj}/{leaf}`."""
    client = client or ObjectClient(dump_dir_url)
    out = []
    for group in client.list_dirs(None):
        for leaf in client.list_dirs(group):
            out.append(join_url(client.url, group, leaf))
    return out


__all__ = ["LeaseHold", "ObjectNamespace", "QUARANTINE_DIR", "list_namespaces"]
