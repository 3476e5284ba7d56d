"""A payload file by its path, outside a step's verified read: an older cache's `torch.save` files,
a step without a commit record, and `show` / `check` on a loose file.

The store opens the file (never following a link) and maps it; the codec decodes the mapped bytes
and knows nothing of where they came from. A committed step is read through its namespace's backend
instead (`reader.StepReader`), verified against its commit record.
"""
from __future__ import annotations

import os
from typing import Any, List, Union

from skip_harness import codec
from skip_harness.codec import tensorfile

PathLike = Union[str, os.PathLike]


def load(path: PathLike, mmap: bool = True) -> Any:
    """The payload in the file at `path` (this format or the previous version's torch.save): never runs
    code from it; CodecError naming the file on any failure. With `mmap` the tensors are private
    (copy-on-write) views of the mapped file, read lazily."""
    return codec.load_from(path, mmap=mmap)


def check(path: PathLike) -> None:
    """CodecError naming the file unless it would load safely (header, records and bounds; no tensor
    data read, no registered type built, nothing run)."""
    codec.check_file(path)


def stored_fields(path: PathLike) -> List[tensorfile.StoredField]:
    """How each tensor of the file is stored, from its header alone ([] for a torch.save file)."""
    return codec.stored_fields(path)
