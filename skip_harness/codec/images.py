"""A payload <-> its file image (the format of `tensorfile`): `save_to` / `plan` write one, `load_buffer` /
`check_buffer` / `stored_fields` read one back from memory. The codec never opens a file: the store
reads or maps the bytes. Every failure to load is a `CodecError` that names the file once."""
from __future__ import annotations

import contextlib
import os
from typing import Any, BinaryIO, Iterator, Optional, Union

from skip_harness.codec import tensorfile
from skip_harness.codec.payload_kinds import UnregisteredTypeError
from skip_harness.codec.structure import decode, encode_named
from skip_harness.codec.tensorfile import StoredForm
from skip_harness.errors import CodecError

def save_to(fileobj: BinaryIO, payload: Any, form: Optional[StoredForm] = None) -> int:
    """Write `payload` to an open binary file object (anything with write()) in the current format.
    The tensors' bytes are written straight from their memory (no pickling, no copy, no container),
    or narrowed and compressed as `form` says. Returns the bytes written."""
    structure, names = encode_named(payload)
    return tensorfile.write(fileobj, structure, names, form)


def plan(payload: Any, *, staged: bool = False) -> tensorfile.FileImage:
    """`payload` encoded and laid out as a file image at full width (for `tensorfile.pack_into`, then
    `tensorfile.stored_image` for a compressed form); raises what `encode` raises for a payload the
    cache refuses. `staged`: for a compressed form, no header yet (`tensorfile.plan`'s `staged`: the
    writer thread lays it out)."""
    structure, names = encode_named(payload)
    return tensorfile.plan(structure, names, staged=staged)


def stored_form(compression: str, level: int = 3) -> StoredForm:
    """The StoredForm of a `compression` setting: `none` stores tensors raw at full width (the fastest
    write: the staged copy goes to disk as it is); `zstd` narrows integers and compresses at `level`."""
    name = getattr(compression, "value", compression)
    if name == "none":
        return StoredForm(narrow=False)
    if name == "zstd":
        return StoredForm(narrow=True, zstd_level=int(level), dedupe=True, shuffle=True)
    raise CodecError(f"unknown compression {name!r} (none or zstd)")


def load_buffer(buffer: Any, size: int, path: Union[str, os.PathLike],
                alloc: Optional[Any] = None) -> Any:
    """Decode the file image of `size` bytes held in `buffer` (anything memoryview takes), read from
    `path` (named in errors; the codec opens nothing). Never runs code stored in it: anything that is
    not tensors, containers, scalars and registered types raises CodecError, as does any other
    failure. A current-format image's tensors are views of the buffer's memory, those stored narrowed
    or compressed views of `alloc(nbytes)` (a writable buffer) when given, else of new memory; an
    image in the previous format (the previous version's torch.save) goes through
    torch.load(weights_only=True)."""
    with _errors_naming(os.fspath(path)):
        view = memoryview(buffer).cast("B")[:size]
        if not tensorfile.is_current_image(view):
            return decode(tensorfile.torch_load(view))
        return decode(tensorfile.read_buffer(buffer, size, alloc))


def stored_fields(buffer: Any, size: int, path: Union[str, os.PathLike]) -> "list[tensorfile.StoredField]":
    """How each tensor of the file image in `buffer` is stored -- field, dtype, stored dtype,
    compression, bytes at full width and as stored -- from its header alone ([] for a torch.save
    image). CodecError naming `path` when the header is damaged."""
    with _errors_naming(os.fspath(path)):
        return tensorfile.stored_fields(buffer, size)


def check_buffer(buffer: Any, size: int, path: Union[str, os.PathLike]) -> None:
    """Raise CodecError (naming `path` once) unless the file image in `buffer` would load safely: its
    header and every record are well formed and everything lies within it. Touches no tensor data,
    builds no registered type (a process that registered nothing can check any file) and runs
    nothing from it."""
    with _errors_naming(os.fspath(path)):
        decode(tensorfile.read_skeleton(buffer, size), check_only=True)


@contextlib.contextmanager
def _errors_naming(spath: str) -> Iterator[None]:
    """Every failure of loading `spath` as a CodecError (UnregisteredTypeError kept) naming the file once."""
    try:
        yield
    except UnregisteredTypeError as exc:
        raise UnregisteredTypeError(f"{spath}: {exc}") from None
    except CodecError as exc:
        raise CodecError(f"{spath}: {exc}") from None
    except (OSError, ValueError, RecursionError, RuntimeError, MemoryError) as exc:
        # (MemoryError: a damaged header asking for more memory than there is, e.g. a compressed
        # tensor's full-width size)
        raise CodecError(f"{spath}: cannot be loaded: {tensorfile.sanitized(exc)}") from None
