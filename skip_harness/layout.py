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

import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Iterator, Optional, Tuple

PAYLOAD_NAME = "tq_batch.pt"
META_NAME = "meta.json"
COMMIT_NAME = "commit.json"
LOCK_NAME = ".lock"
LOCK_HOLDER_NAME = ".lock.holder.json"
QUARANTINE_DIR = ".quarantine"
TMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"

_NS_RE = re.compile(r"^GBS(\d+)_N(\d+)_in(\d+)_out(\d+)(?:_K(\d+)_W(\d+))?$")
_STEP_RE = re.compile(r"^[1-9][0-9]*$")
_INNER_RE = re.compile(r"^(0|[1-9][0-9]*)$")


@dataclass(frozen=True)
class NamespaceKey:
    """Everything that names a namespace. K and W appear in the name only when one of them is > 1."""

    experiment_name: str
    project_name: str
    train_batch_size: int
    n: int
    max_prompt_length: int
    max_response_length: int
    K: int = 1
    W: int = 1

    @property
    def group_name(self) -> str:
        return f"{self.experiment_name}_{self.project_name}"

    @property
    def leaf_name(self) -> str:
        base = (
            f"GBS{self.train_batch_size}_N{self.n}"
            f"_in{self.max_prompt_length}_out{self.max_response_length}"
        )
        if self.K > 1 or self.W > 1:
            base += f"_K{self.K}_W{self.W}"
        return base

    @property
    def relpath(self) -> PurePosixPath:
        return PurePosixPath(self.group_name) / self.leaf_name

    def layout(self, dump_dir: Path | str) -> "Layout":
        return Layout(Path(dump_dir) / self.group_name / self.leaf_name, K=self.K, W=self.W)


def parse_namespace_leaf(name: str) -> Optional[Tuple[int, int]]:
    """(K, W) if `name` is a namespace leaf directory name, else None."""
    m = _NS_RE.match(name)
    if not m:
        return None
    if m.group(5) is None:
        return 1, 1
    return int(m.group(5)), int(m.group(6))


def parse_step_name(name: str) -> Optional[int]:
    """The step number if `name` names a step directory (an int >= 1 without leading zeros)."""
    return int(name) if _STEP_RE.match(name) else None


def parse_inner_name(name: str) -> Optional[int]:
    return int(name) if _INNER_RE.match(name) else None


def payload_name(rank: int, W: int) -> str:
    return PAYLOAD_NAME if W == 1 else f"tq_batch_rank{rank}.pt"


def meta_name(rank: int, W: int) -> str:
    return META_NAME if W == 1 else f"meta_rank{rank}.json"


@dataclass(frozen=True)
class Layout:
    """Paths inside one namespace directory `root` for a given K and W."""

    root: Path
    K: int = 1
    W: int = 1

    def step_dir(self, step: int) -> Path:
        return self.root / str(step)

    def inner_rel(self, inner_index: int) -> PurePosixPath:
        """Directory of inner index i relative to its step directory ('.' when K = 1)."""
        return PurePosixPath(".") if self.K == 1 else PurePosixPath(str(inner_index))

    def inner_dir(self, step: int, inner_index: int) -> Path:
        return self.step_dir(step) if self.K == 1 else self.step_dir(step) / str(inner_index)

    def payload_rel(self, inner_index: int, rank: int) -> str:
        """Path of a payload file relative to its step directory, '/'-separated."""
        return str(self.inner_rel(inner_index) / payload_name(rank, self.W))

    def meta_rel(self, inner_index: int, rank: int) -> str:
        return str(self.inner_rel(inner_index) / meta_name(rank, self.W))

    def payload_path(self, step: int, inner_index: int, rank: int) -> Path:
        return self.step_dir(step) / self.payload_rel(inner_index, rank)

    def meta_path(self, step: int, inner_index: int, rank: int) -> Path:
        return self.step_dir(step) / self.meta_rel(inner_index, rank)

    def commit_path(self, step: int) -> Path:
        return self.step_dir(step) / COMMIT_NAME

    def legacy_k1_rel(self, rank: int) -> Tuple[str, str]:
        """For K = 1: the `{step}/0/...` form some older caches use (payload, meta), relative."""
        return f"0/{payload_name(rank, self.W)}", f"0/{meta_name(rank, self.W)}"

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


def is_temporary_name(name: str) -> bool:
    return name.startswith(TMP_PREFIX)
