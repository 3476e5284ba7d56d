"""Where things live: namespace and file paths from (namespace key, step, inner index, rank).

Pure path arithmetic, no I/O. Every other module asks this one for a path; nobody formats a cache
path anywhere else.

Layout of one namespace (see README "On-disk layout"):

    K = 1, W = 1:  {step}/tq_batch.pt            {step}/meta.json
    K > 1:         {step}/{i}/tq_batch.pt        {step}/{i}/meta.json
    W > 1:         ... tq_batch_rank{r}.pt       ... meta_rank{r}.json
    every step:    {step}/commit.json            (the commit record, written last)
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Callable, Iterator, Optional, Tuple

from skip_harness.store.urls import UrlPath, is_url, place

PAYLOAD_NAME = "tq_batch.pt"
META_NAME = "meta.json"
COMMIT_NAME = "commit.json"
LOCK_NAME = ".lock"
LOCK_HOLDER_NAME = ".lock.holder.json"
QUARANTINE_DIR = ".quarantine"
VALUES_DIR = ".values"          # what each step produced when recorded (store.values): {step}.json
TIER_DIR = ".tier"              # a step's second tier (store.tier): rewards, reference log-probs
TMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"

_SHAPE_FIELDS = (("train_batch_size", "GBS"), ("n", "N"), ("max_prompt_length", "in"), ("max_response_length", "out"))
_LEAF_TOKEN_RE = re.compile(r"^(GBS|N|in|out|K|W)(0|[1-9][0-9]*)$")
_LEAF_ORDER = ("GBS", "N", "in", "out", "K", "W")
_STEP_RE = re.compile(r"^(0|[1-9][0-9]*)$")


@dataclass(frozen=True)
class NamespaceKey:
    """Everything that names a namespace.

    verl's shape values (train_batch_size, n, max_prompt_length, max_response_length) are optional: a
    trainer names the ones it has, and only those appear in the leaf name. K and W appear when one of
    them is > 1 (or when there is no shape value at all), so runs that differ in K or W never share
    a directory. The demo's (and verl's) leaf is exactly ``GBS{g}_N{n}_in{p}_out{r}`` for K = W = 1.
    """

    experiment_name: str
    project_name: str
    train_batch_size: Optional[int] = None
    n: Optional[int] = None
    max_prompt_length: Optional[int] = None
    max_response_length: Optional[int] = None
    K: int = 1
    W: int = 1

    @property
    def group_name(self) -> str:
        return f"{self.experiment_name}_{self.project_name}"

    @property
    def leaf_name(self) -> str:
        parts = [f"{tag}{getattr(self, name)}" for name, tag in _SHAPE_FIELDS if getattr(self, name) is not None]
        if self.K > 1 or self.W > 1 or not parts:
            parts += [f"K{self.K}", f"W{self.W}"]
        return "_".join(parts)

    def with_world_size(self, W: int) -> "NamespaceKey":
        return dataclasses.replace(self, W=W)

    def layout(self, dump_dir: "Path | str | UrlPath") -> "Layout":
        """The namespace's Layout under `dump_dir`: a local path, or an object-store URL
        (`s3://bucket/prefix`), kept a URL (`UrlPath`): `Path` would fold its `//`."""
        base: Any = place(dump_dir)          # Layout.root: a Path or a UrlPath
        return Layout(base / self.group_name / self.leaf_name, K=self.K, W=self.W)


is_url_text = is_url    # the one URL test (store.urls), under the name the command line imports


def parse_namespace_leaf(name: str) -> Optional[Tuple[int, int]]:
    """(K, W) if `name` is a namespace leaf directory name, else None.

    A leaf is `_`-joined tokens in the order GBS, N, in, out, K, W (each at most once, K and W
    together); `GBS64_N4_in128_out256`, `GBS64_N4_in128_out256_K3_W2`, `N8_K2_W1`, `K1_W1`."""
    tokens = name.split("_")
    seen: dict = {}
    last = -1
    for tok in tokens:
        m = _LEAF_TOKEN_RE.match(tok)
        if not m:
            return None
        pos = _LEAF_ORDER.index(m.group(1))
        if pos <= last:
            return None
        last = pos
        seen[m.group(1)] = int(m.group(2))
    if ("K" in seen) != ("W" in seen):
        return None
    if "K" not in seen:
        return 1, 1
    if seen["K"] < 1 or seen["W"] < 1:
        return None
    return seen["K"], seen["W"]


def namespace_leaf_values(name: str) -> Optional[dict]:
    """The values a namespace leaf name holds ({'train_batch_size': 64, 'n': 4, ..., 'K': 2, 'W': 1}: the
    shape fields it names, and K and W, 1 when absent), None if `name` is not a leaf name."""
    kw = parse_namespace_leaf(name)
    if kw is None:
        return None
    tags = {tag: field for field, tag in _SHAPE_FIELDS}
    out: dict = {}
    for tok in name.split("_"):
        m = _LEAF_TOKEN_RE.match(tok)
        if m is not None and m.group(1) in tags:
            out[tags[m.group(1)]] = int(m.group(2))
    out["K"], out["W"] = kw
    return out


def parse_step_name(name: str) -> Optional[int]:
    """The step number if `name` names a step directory (an int >= 0 without leading zeros)."""
    return int(name) if _STEP_RE.match(name) else None


def payload_name(rank: int, W: int) -> str:
    return PAYLOAD_NAME if W == 1 else f"tq_batch_rank{rank}.pt"


def meta_name(rank: int, W: int) -> str:
    return META_NAME if W == 1 else f"meta_rank{rank}.json"


@dataclass(frozen=True)
class Layout:
    """Paths inside one namespace directory `root` for a given K and W."""

    root: Path      # a UrlPath for an object store (`is_url`); a pack file's path for a pack (`name` set)
    K: int = 1
    W: int = 1
    name: str = ""  # `{experiment}_{project}/{leaf}` where the root's path does not end in it (a pack file)

    @property
    def leaf(self) -> str:
        """The namespace's leaf name (`GBS64_N4_in128_out256[_K.._W..]`: its batch shape, K and W)."""
        return self.name.rsplit("/", 1)[-1] if self.name else str(self.root).rstrip("/").rsplit("/", 1)[-1]

    @property
    def group(self) -> str:
        """The namespace's `{experiment}_{project}` name."""
        if self.name:
            return self.name.rsplit("/", 1)[0] if "/" in self.name else ""
        return Path(str(self.root).rstrip("/")).parent.name

    @property
    def packed(self) -> bool:
        """Whether the namespace is a pack file (read only, `store.packfile`)."""
        return bool(self.name)

    @property
    def is_url(self) -> bool:
        return isinstance(self.root, UrlPath)

    @property
    def url(self) -> str:
        """Where the namespace is, as text (a directory path or a URL), for messages."""
        return str(self.root)

    def step_dir(self, step: int) -> Path:
        return self.root / str(step)

    def inner_rel(self, inner_index: int) -> PurePosixPath:
        """Directory of inner index i relative to its step directory ('.' when K = 1)."""
        return PurePosixPath(".") if self.K == 1 else PurePosixPath(str(inner_index))

    def inner_dir(self, step: int, inner_index: int) -> Path:
        return self.step_dir(step) if self.K == 1 else self.step_dir(step) / str(inner_index)

    def payload_rel(self, inner_index: int, rank: int) -> str:
        """Path of a payload file relative to its step directory, '/'-separated (`inner_rel` / its name,
        as text: a listing asks for it tens of thousands of times)."""
        name = payload_name(rank, self.W)
        return name if self.K == 1 else f"{int(inner_index)}/{name}"

    def meta_rel(self, inner_index: int, rank: int) -> str:
        name = meta_name(rank, self.W)
        return name if self.K == 1 else f"{int(inner_index)}/{name}"

    def payload_path(self, step: int, inner_index: int, rank: int) -> Path:
        return self.step_dir(step) / self.payload_rel(inner_index, rank)

    def meta_path(self, step: int, inner_index: int, rank: int) -> Path:
        return self.step_dir(step) / self.meta_rel(inner_index, rank)

    def commit_path(self, step: int) -> Path:
        return self.step_dir(step) / COMMIT_NAME

    def legacy_k1_rel(self, rank: int) -> Tuple[str, str]:
        """For K = 1: the `{step}/0/...` form some older caches use (payload, meta), relative."""
        return f"0/{payload_name(rank, self.W)}", f"0/{meta_name(rank, self.W)}"

    def stored_rels(self, inner_index: int, rank: int, present: Callable[[str], bool]) -> Tuple[str, str]:
        """(payload rel, meta rel) of (inner_index, rank) as a step stores them -- the one place the
        older K = 1 layout is resolved: for K = 1, the `0/` form when the payload is not at its own
        place (`present(rel)`: whether the step holds `rel`) and the `0/` one is."""
        rels = self.payload_rel(inner_index, rank), self.meta_rel(inner_index, rank)
        if self.K == 1 and not present(rels[0]):
            legacy = self.legacy_k1_rel(rank)
            if present(legacy[0]):
                return legacy
        return rels

    def position_of(self, rel: str) -> Optional[Tuple[int, int]]:
        """(inner_index, rank) of the payload stored at `rel` in a step (either K = 1 form), else None."""
        for i, r, prel, _m in self.expected_rels():
            if rel == prel:
                return i, r
        if self.K == 1:
            for r in range(self.W):
                if rel == self.legacy_k1_rel(r)[0]:
                    return 0, r
        return None

    def expected_rels(self, ranks: Optional[range] = None) -> Iterator[Tuple[int, int, str, str]]:
        """(inner_index, rank, payload_rel, meta_rel) for every file a step needs."""
        for i in range(self.K):
            for r in ranks if ranks is not None else range(self.W):
                yield i, r, self.payload_rel(i, r), self.meta_rel(i, r)

    @property
    def lock_path(self) -> Path:
        return self.root / LOCK_NAME

    @property
    def lock_holder_path(self) -> Path:
        return self.root / LOCK_HOLDER_NAME

    @property
    def quarantine_dir(self) -> Path:
        return self.root / QUARANTINE_DIR

