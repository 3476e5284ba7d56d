"""The store's one face: every name the command line, the run, the integrations and the demo use of the store.

Outside `skip_harness/store/`, the package imports the store from here and from nowhere else (pyproject.toml's
import-linter contract "the front ends see the store through one face (store.api)", seen to break on a planted
import in tests/test_layers.py). The store's modules behind it (layout, scan, the backends ...) can then be
split, merged and renamed without touching a front end, and what the front ends rely on is this list.

Why a module and not the package's `__init__`: importing any store module (`store.layout`, say) runs the
package's `__init__` first; a face there would load the whole store -- torch with the codec, the backends --
for the light importers that need one leaf. `skip_harness.config` (composed by Hydra before anything runs)
and the package's lazy `skip_harness.NamespaceKey` name the leaves `store.urls` and `store.layout` for that
reason; they are the two exceptions, and the contract names config's. Everything else pays for the store
it uses anyway.

Every name is imported from the module that defines it (nothing here is new code), grouped by what it is for:

- **open a namespace**: `open_namespace` (a command's or a run's namespace: its lock file, or its lease on an
  object store), `open_store` (a command's: the namespace opened and its `StepStore` on it, in one call),
  `open_dump_dir` (the root a run writes under), `namespaces_at` (the namespaces under a
  directory or URL), `Namespace` (the opened one, handed down: its storage and its commit protocol).
- **layout and URLs**: `Layout` (where a namespace's steps, payloads and records live), `NamespaceKey`,
  `namespace_leaf_values`, `parse_namespace_leaf`, `parse_step_name`, `payload_rel_at`, `PAYLOAD_NAME`,
  `UrlPath`, `is_url`, `local_path`, `dump_dir_problem` (what is wrong with a dump_dir's text).
- **read and write steps**: `StepStore` (a namespace's reader and writer), `StepReader`, `StepWriter`,
  `BufferPool` (reused read buffers), `Fingerprint` (what a step was generated from).
- **a loose payload file** (`show FILE`, outside any namespace): `load_payload_file`, `payload_file_fields`,
  `payload_file_meta`, `payload_file_size`.
- **status and scan**: `StepStatus`, `STATUSES`, `StepReport`, `classify_step`, `scan_namespace`, `stale_temporaries`,
  `NamespaceReport`.
- **logged values and the second tier**: `ValuesStore`, `config_changes`, `config_digest`, `flatten_config`,
  `numbers_of`, `new_run_id`; what a filter discarded (`Discarded`, read by
  `StepReader.read_discarded`); `TierStore`, `TierRecord`, `key_digest`, `read_step_tier`.
- **locking**: `Hold`, `HeldByThisProcess`, `new_run_token`; who holds a local namespace, read without trying
  its lock (`read_lock_holder`), and whether a process of this host still runs (`process_runs_since`).
- **cleanup and retention**: `plan_cleanup`, `CleanupPlan`, `CleanupItem`, `CleanupResult`; `RetentionRules`,
  `plan_retention`, `StepAge`, `bytes_left`, `parse_age`, `parse_size`.
- **packs** (`skip-harness pack` / `unpack`; a pack opens as a read-only namespace): `write_pack`, `unpack`,
  `read_pack_info` (its manifest: a `PackInfo`), `is_pack`, `bless_pack` (new expected values written into a
  pack), `PackError`.
- **verl's own dump** (import-verl's input, read only): `find_verl_namespaces`, `scan_verl_namespaces`,
  `VerlNamespace`, `VerlStep`, `read_verl_meta`, `load_trusted` (the one unpickling in skip_harness).
"""
from __future__ import annotations

# open a namespace
from skip_harness.store.namespace import Namespace
from skip_harness.store.namespaces import namespaces_at
from skip_harness.store.open import open_dump_dir, open_namespace, open_store

# layout and URLs
from skip_harness.store.layout import (PAYLOAD_NAME, Layout, NamespaceKey, namespace_leaf_values, parse_namespace_leaf,
                                       parse_step_name)
from skip_harness.store.paths import payload_rel_at
from skip_harness.store.urls import UrlPath, dump_dir_problem, is_url, local_path, place

# read and write steps
from skip_harness.store.bufferpool import BufferPool
from skip_harness.store.fingerprint import Fingerprint
from skip_harness.store.reader import StepReader
from skip_harness.store.stepstore import StepStore
from skip_harness.store.writer import StepWriter

# a loose payload file
from skip_harness.store.payload_file import load as load_payload_file
from skip_harness.store.payload_file import sibling_meta as payload_file_meta
from skip_harness.store.payload_file import size as payload_file_size
from skip_harness.store.payload_file import stored_fields as payload_file_fields

# status and scan
from skip_harness.store.scan import NamespaceReport, classify_step, scan_namespace, stale_temporaries
from skip_harness.store.status import STATUSES, StepReport, StepStatus

# logged values and the second tier
from skip_harness.store.tier import TierRecord, TierStore, key_digest, read_step_tier
from skip_harness.store.discards import Discarded
from skip_harness.store.values import (ValuesStore, as_number, config_changes, config_digest, flatten_config, new_run_id,
                                       numbers_of)

# locking
from skip_harness.store.locking import HeldByThisProcess, Hold, new_run_token
from skip_harness.store.open import process_runs_since, read_lock_holder

# cleanup and retention
from skip_harness.store.cleanup import CleanupItem, CleanupPlan, CleanupResult, plan_cleanup
from skip_harness.store.retention import RetentionRules, StepAge, bytes_left, parse_age, parse_size, plan_retention

# packs: one recording as one read-only file
from skip_harness.store.open import PackError, is_pack
from skip_harness.store.pack import PackInfo, bless_pack, read_pack_info, unpack, write_pack

# verl's own dump
from skip_harness.store.verl_dump import VerlNamespace, VerlStep, find_verl_namespaces, load_trusted, scan_verl_namespaces
from skip_harness.store.verl_dump import read_meta as read_verl_meta

__all__ = [
    # open a namespace
    "Namespace", "namespaces_at", "open_dump_dir", "open_namespace", "open_store",
    # layout and URLs
    "PAYLOAD_NAME", "Layout", "NamespaceKey", "UrlPath", "dump_dir_problem", "is_url", "local_path", "place",
    "namespace_leaf_values", "parse_namespace_leaf", "parse_step_name", "payload_rel_at",
    # read and write steps
    "BufferPool", "Fingerprint", "StepReader", "StepStore", "StepWriter",
    # a loose payload file
    "load_payload_file", "payload_file_fields", "payload_file_meta", "payload_file_size",
    # status and scan
    "STATUSES", "NamespaceReport", "StepReport", "StepStatus", "classify_step", "scan_namespace", "stale_temporaries",
    # logged values and the second tier
    "Discarded", "as_number",
    "TierRecord", "TierStore", "ValuesStore", "config_changes", "config_digest", "flatten_config", "key_digest",
    "new_run_id", "numbers_of", "read_step_tier",
    # locking
    "HeldByThisProcess", "Hold", "new_run_token", "process_runs_since", "read_lock_holder",
    # cleanup and retention
    "CleanupItem", "CleanupPlan", "CleanupResult", "RetentionRules", "StepAge", "bytes_left", "parse_age",
    "parse_size", "plan_cleanup", "plan_retention",
    # packs
    "PackError", "PackInfo", "bless_pack", "is_pack", "read_pack_info", "unpack", "write_pack",
    # verl's own dump
    "VerlNamespace", "VerlStep", "find_verl_namespaces", "load_trusted", "read_verl_meta", "scan_verl_namespaces",
]
