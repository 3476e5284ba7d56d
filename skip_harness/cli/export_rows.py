"""A mini-batch as columns, one row per trajectory: its fields flattened (nested keys joined with '.'),
split along the mini-batch's length, and written as an Arrow table (a Parquet row group) or as JSON
lines. The conversion `skip-harness export` streams step by step (:mod:`skip_harness.cli.export`)."""
from __future__ import annotations

import json
import logging
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, Optional, Sequence, Tuple

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from skip_harness.codec.payload_kinds import is_tensordict
from skip_harness.errors import SkipHarnessError
from skip_harness.run.trajectories import leaves as _leaves  # the walk `action=compare` uses too

try:
    import numpy as np
except ImportError:  # pragma: no cover - numpy ships with torch wheels
    np = None


logger = logging.getLogger("skip_harness.cli.export")

INDEX_COLUMNS = ("step", "inner_index", "rank", "trajectory_index")
NAMESPACE_COLUMN = "namespace"
FORMATS = ("parquet", "jsonl")


class ExportError(SkipHarnessError):
    """The export cannot go on; the message names the step, field or path."""


# a mini-batch -> columns


@dataclass
class _Column:
    per_row: bool
    value: Any          # per_row: a tensor/ndarray with len == n_rows, or a list; else one value


def _is_td(obj: Any) -> bool:
    return is_tensordict(obj)


def _leading(value: Any) -> Optional[int]:
    if isinstance(value, torch.Tensor):
        return int(value.shape[0]) if value.dim() >= 1 else None
    if np is not None and isinstance(value, np.ndarray):
        return int(value.shape[0]) if value.ndim >= 1 else None
    if isinstance(value, list):
        return len(value)
    return None


def _batch_length(payload: Any, leaves: Sequence[Tuple[str, Any]]) -> int:
    """Trajectories in a mini-batch: a TensorDict's first batch dimension, else the most common
    first dimension of its tensors and lists (1 when it has none)."""
    if _is_td(payload) and len(payload.batch_size) >= 1:
        return int(payload.batch_size[0])
    if isinstance(payload, dict):
        for v in payload.values():
            if _is_td(v) and len(v.batch_size) >= 1:
                return int(v.batch_size[0])
    counts = Counter(n for _, v in leaves if (n := _leading(v)) is not None)
    if not counts:
        return 1
    best = max(counts.values())
    return max(n for n, c in counts.items() if c == best)


def columns_of(payload: Any, where: str) -> Tuple[int, Dict[str, _Column]]:
    """(number of rows, {column name: column}) for one mini-batch."""
    leaves = list(_leaves(payload))
    n = _batch_length(payload, leaves)
    cols: Dict[str, _Column] = {}
    for name, value in leaves:
        if name in INDEX_COLUMNS or name == NAMESPACE_COLUMN:
            name = f"batch.{name}"
        lead = _leading(value)
        if lead is not None and lead == n:
            cols[name] = _Column(True, value)
        elif isinstance(value, torch.Tensor) and value.dim() == 0:
            cols[name] = _Column(False, value.item())
        elif np is not None and isinstance(value, np.ndarray) and value.ndim == 0:
            cols[name] = _Column(False, value.item())
        elif lead is not None:
            logger.warning("%s: field %s has %d entries, not the mini-batch's %d: left out of the export",
                           where, name, lead, n)
        else:
            cols[name] = _Column(False, _plain(value))
    return n, cols


def _plain(value: Any) -> Any:
    """A value pyarrow and json can hold: tensors as lists, numpy scalars as numbers, dicts and other
    containers as JSON text, bytes kept as bytes (Parquet) ."""
    if isinstance(value, torch.Tensor):
        return _tensor_list(value)
    if np is not None and isinstance(value, np.ndarray):
        return value.tolist()
    if np is not None and isinstance(value, np.generic):
        return value.item()
    if isinstance(value, complex):
        return [value.real, value.imag]
    if isinstance(value, (dict, list, tuple)) or _is_td(value):
        return json.dumps(_jsonable(value), sort_keys=False, default=str)
    return value


def _jsonable(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return _tensor_list(value)
    if np is not None and isinstance(value, (np.ndarray, np.generic)):
        return value.tolist()
    if _is_td(value):
        return {str(k): _jsonable(value.get(k)) for k in value.keys()}
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, complex):
        return [value.real, value.imag]
    return value


def _tensor_list(t: torch.Tensor) -> Any:
    """A tensor as nested lists; a nested (jagged) tensor as one list per row."""
    if t.is_nested:
        return [_tensor_for_arrow(row).tolist() for row in t.unbind(0)]
    return _tensor_for_arrow(t).tolist()


def _tensor_for_arrow(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().cpu()
    if t.dtype in (torch.bfloat16,) or (t.is_floating_point() and t.element_size() == 1):
        t = t.float()
    if t.is_complex():
        t = torch.view_as_real(t)
    return t.contiguous()


def _arrow_rows(value: Any) -> pa.Array:
    """One Arrow value per row of a per-row column."""
    if isinstance(value, torch.Tensor) and value.is_nested:
        return pa.array(_tensor_list(value))
    if isinstance(value, torch.Tensor):
        arr = _tensor_for_arrow(value).numpy()
    elif np is not None and isinstance(value, np.ndarray):
        arr = np.ascontiguousarray(value)
    else:
        return pa.array([_plain(v) for v in value])
    if arr.dtype.kind in "OUSc":
        return pa.array([_plain(v) for v in arr.tolist()])
    out = pa.array(arr.reshape(-1))
    for dim in reversed(arr.shape[1:]):
        count = len(out) // dim if dim else 0
        small = len(out) < 2**31 - 1   # plain list<> (int32 offsets) whenever it fits: every reader knows it
        itype = np.int32 if small else np.int64
        offsets = np.arange(0, count * dim + 1, dim, dtype=itype) if dim else np.zeros(len(arr) + 1, dtype=itype)
        out = (pa.ListArray if small else pa.LargeListArray).from_arrays(pa.array(offsets), out)
    return out


# --------------------------------------------------------------------------------------------
# writers


class _ParquetSink:
    def __init__(self, path: Path, schema: Optional[pa.Schema] = None):
        self.path = path
        self.writer: Optional[pq.ParquetWriter] = None
        self.schema: Optional[pa.Schema] = schema

    def write(self, table: pa.Table, where: str) -> None:
        if self.schema is None:
            self.schema = table.schema
        if self.writer is None:
            self.writer = pq.ParquetWriter(str(self.path), self.schema)
        table = _conform(table, self.schema, where)
        self.writer.write_table(table)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _conform(table: pa.Table, schema: pa.Schema, where: str) -> pa.Table:
    """`table` with exactly `schema`'s columns and types (missing ones as nulls)."""
    extra = [n for n in table.column_names if schema.get_field_index(n) < 0]
    if not extra and table.schema.equals(schema):
        return table
    if extra:
        raise ExportError(f"{where}: field {extra[0]} is not in the earlier mini-batches' columns; export the "
                          f"namespaces separately (--namespace) or to JSON lines (--format jsonl)")
    arrays = []
    for f in schema:
        if f.name in table.column_names:
            col = table.column(f.name)
            if col.type != f.type:
                try:
                    col = col.cast(f.type)
                except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
                    raise ExportError(f"{where}: field {f.name} is {col.type} here, {f.type} in earlier "
                                      f"mini-batches ({exc})") from None
            arrays.append(col)
        else:
            arrays.append(pa.nulls(table.num_rows, type=f.type))
    return pa.Table.from_arrays(arrays, schema=schema)


def _table(meta_cols: Dict[str, Any], n: int, cols: Dict[str, _Column], where: str) -> pa.Table:
    names, arrays = [], []
    for name in INDEX_COLUMNS:
        names.append(name)
        arrays.append(pa.array(meta_cols[name], type=pa.int64()))
    for name, col in cols.items():
        names.append(name)
        try:
            arrays.append(_arrow_rows(col.value) if col.per_row else pa.array([col.value] * n))
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError) as exc:
            raise ExportError(f"{where}: field {name} cannot be written as a column: {exc}") from None
    names.append(NAMESPACE_COLUMN)
    arrays.append(pa.array([meta_cols[NAMESPACE_COLUMN]] * n, type=pa.string()))
    return pa.Table.from_arrays(arrays, names=names)


def _jsonl_rows(meta_cols: Dict[str, Any], n: int, cols: Dict[str, _Column]) -> Iterator[str]:
    values = {}
    for name, col in cols.items():
        if col.per_row:
            v = col.value
            values[name] = _tensor_list(v) if isinstance(v, torch.Tensor) else \
                (v.tolist() if np is not None and isinstance(v, np.ndarray) else [_jsonable(x) for x in v])
        else:
            values[name] = _jsonable(col.value)
    for j in range(n):
        row = {k: meta_cols[k][j] for k in INDEX_COLUMNS}
        for name, col in cols.items():
            row[name] = values[name][j] if col.per_row else values[name]
        row[NAMESPACE_COLUMN] = meta_cols[NAMESPACE_COLUMN]
        try:
            yield json.dumps(row, allow_nan=False)
        except ValueError:   # NaN or infinity: not JSON; written as null so every JSON reader opens the file
            yield json.dumps(_finite(row), allow_nan=False)


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if value == value and value not in (float("inf"), float("-inf")) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value
