"""Payload <-> file without pickled code.

A payload is whatever a trainer's `sample` returns: tensors, dicts (str/int keys), lists, tuples,
ints, floats, bools, complex numbers, strings, bytes, None, NumPy arrays and scalars, TensorDicts,
and dataclasses / namedtuples whose type was registered with :func:`register_type`.

`encode` turns a payload into a structure of plain CPU tensors, plain containers and scalars. Anything
else is written as a *tagged dict* ``{TAG: kind, ...}``:

    "tensor"      a tensor that lived on another device: ``device`` (str) and ``data`` (CPU tensor)
    "tensordict"  a TensorDict: ``batch_size`` (list of ints), ``device`` (str or None), ``keys``, ``values``
    "nontensor"   a tensordict NonTensorData or MetaData: ``class``, ``batch_size``, ``device``, ``value``
    "nontensorstack"  a tensordict NonTensorStack: ``batch_size``, ``device``, ``items`` (its values as
                  nested lists, one level per batch dimension)
    "ndarray"     a NumPy array: numeric ones as a CPU tensor in ``data``; others as ``items`` + ``shape``
    "npscalar"    a NumPy scalar: ``dtype`` and ``value``
    "jagged"      a nested tensor of layout torch.jagged: its dense components ``values``, ``offsets`` and
                  ``lengths`` (None unless set), ``ragged_idx``, ``min_seqlen`` / ``max_seqlen`` (None
                  unless cached) and ``device``
    "nested"      a nested tensor of layout torch.strided: ``items`` (its components) and ``device``
    "dict"        a user dict that itself holds the key TAG (escaped): ``keys``, ``values``
    "object"      a registered dataclass or namedtuple: ``type`` (its registered name), ``fields``, ``values``

`decode` is the inverse. A registered type is rebuilt from this process's name -> class registry
(`payload_kinds`); nothing is ever imported or called by a name found in a file.

`plan` / `save_to` turn a payload into a file image in the format of `tensorfile` (a JSON header and
the raw tensor bytes); `load_buffer` / `check_buffer` / `stored_fields` read one back from memory
(loading unpickles nothing). The codec never opens a file: the store reads or maps the bytes
(`store.payload_file` for a loose file, a backend's verified read for a step). Every failure to load
is a `CodecError` that names the file once.

This module is the codec's face: the rest of the package imports the codec from here (the store's
writer and reader included). The rooms behind it: `structure` (encode / decode), `images` (payload <->
file image), `tensorfile` (the file format's face over `fileimage`, `compression`, `fileread` and
`torchsave`), `payload_kinds` (what a payload may hold; registered types), `minibatch` (`merge`), `rechunk` (a step's mini-batches cut and joined along the batch dimension:
`regroup`, `take`, `cut`, `join`, `batch_rows`).
"""
from __future__ import annotations

from skip_harness.errors import CodecError  # noqa: F401
from skip_harness.codec.minibatch import merge  # noqa: F401
from skip_harness.codec.rechunk import cut, join, regroup, take  # noqa: F401
from skip_harness.codec.rechunk import rows as batch_rows  # noqa: F401
from skip_harness.codec.payload_kinds import (  # noqa: F401
    ORIGIN_ATTR, UnregisteredTypeError, register_type, registered_name, unregister_type,
)
from skip_harness.codec.structure import TAG, decode, encode, encode_named  # noqa: F401
from skip_harness.codec.images import check_buffer, load_buffer, plan, save_to, stored_fields, stored_form  # noqa: F401
from skip_harness.codec.tensorfile import (  # noqa: F401  (the file format, for the store's writer and reader)
    FORMAT_VERSION, MAGIC, StoredField, StoredForm,
)
