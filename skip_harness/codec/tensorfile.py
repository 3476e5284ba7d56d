"""The cache's payload file format (FORMAT_VERSION 5): the encoded structure as a small JSON header
followed by the stored bytes of every tensor.

    MAGIC (8 bytes) | u32 format version | u32 0 | u64 header length | header (UTF-8 JSON) | pad |
    tensor bytes, each at a 64-byte aligned offset

The header holds ``format``, ``tensors`` (one ``[dtype, shape, offset, nbytes]`` per tensor, or
``[dtype, shape, offset, nbytes, how]`` where ``how`` says how it is stored: ``name`` (the field, for
messages and `show`), ``as`` (a narrower integer dtype holding every value: lossless narrowing) and
``zstd`` (``[[stored, raw], ...]``: the bytes as consecutive zstd frames, one per chunk, so a load
decompresses chunks in parallel and a damaged chunk names its field); ``nbytes`` is always the stored
length, so a checksum over the file covers what is stored and needs no decompression) and ``tree``
(the encoded structure: JSON scalars and lists as themselves, every other value a one-key object, e.g.
``{"T": 3}`` for tensor 3, ``{"d": [[key, value], ...]}`` for a dict, ``{"j": value}`` for a value of
plain JSON kept as it is -- lists, str-keyed dicts and JSON scalars, e.g. a NonTensorStack's chat
messages, dumped in one call instead of node by node; version 5). Reading parses JSON and maps the
file: there is no unpickling at all. Files of the previous version (``torch.save`` of the encoded
structure, and older caches' ``torch.save`` files) are still read, with ``torch.load(weights_only=True)``;
formats 2 (no ``how``), 3 (no rules) and 4 (no ``j``) are read as they were written.

The format lives in four rooms: `fileimage` (the header and the layout; the one copy into a buffer),
`compression` (narrowing and zstd chunks, and their parallel decompression), `fileread` (an image read
back from memory) and `torchsave` (the previous format). This module is their face, and `write`.
It moves encoded structures (`codec.encode`'s output) to and from files; errors are `CodecError`s
without the path, which `codec` adds once.
"""
from __future__ import annotations

from typing import Any, BinaryIO, Dict, Optional

import torch

from skip_harness.codec.compression import (  # noqa: F401  (the format's face)
    StoredForm, fill_stored, narrowest_dtype, stored_image,
)
from skip_harness.codec.fileimage import (  # noqa: F401  (the format's face)
    FORMAT_VERSION, MAGIC, FileImage, _byte_view, laid_out, pack_into, pack_parts, plan, shapes_only, staged_tensors,
)
from skip_harness.codec.fileread import (  # noqa: F401  (the format's face)
    StoredField, is_current_image, read_buffer, read_skeleton, stored_fields,
)
from skip_harness.codec.torchsave import sanitized, torch_load  # noqa: F401


def write(fileobj: BinaryIO, structure: Any, names: Optional[Dict[int, str]] = None,
          form: Optional[StoredForm] = None) -> int:
    """Write an encoded structure to an open binary file object (anything with write()) in the current
    format, the tensors' bytes straight from their memory (or as `form` stores them). Returns the bytes
    written."""
    image = plan(structure, names)
    if form is not None and form.transforms:
        stored = stored_image(image, [t.contiguous() for t in image.tensors], form)
        fileobj.write(stored.head)
        pos = len(stored.head)
        for off, piece in stored.pieces:
            if off > pos:
                fileobj.write(bytes(off - pos))
            mv = _byte_view(piece) if isinstance(piece, torch.Tensor) else piece
            fileobj.write(mv)
            pos = off + len(mv)
        if stored.nbytes > pos:
            fileobj.write(bytes(stored.nbytes - pos))
        return stored.nbytes
    fileobj.write(image.head)
    pos = len(image.head)
    for t, off in zip(image.tensors, image.offsets):
        if off > pos:
            fileobj.write(bytes(off - pos))
        view = _byte_view(t.contiguous())
        if len(view):
            fileobj.write(view)
        pos = off + len(view)
    return pos
