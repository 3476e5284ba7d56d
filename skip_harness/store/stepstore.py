"""A namespace's steps, opened: its layout, its namespace, the buffer pool and stored form its payloads
use, and the two jobs done on them -- `writer` (a `writer.StepWriter`: payloads, meta files and the
commit record last) and `reader` (a `reader.StepReader`: the one verified read path, and the one
`verify`). `status(step)` classifies a step from its listing (`status.classify_step`).

How bytes reach the storage is the backend's (`store.posix`, O_DIRECT from pool buffers and
fd-relative walks that never follow a link; `store.objstore`). Its namespace is opened by the caller
(`store.open.open_namespace`, or `open_store` for both at once) and handed in. Only `StepStore` is
defined here: the names it uses are imported from their own modules (`commit`, `status`, `writer`).

This module does no logging: it raises or returns, and the harness reports.
"""
from __future__ import annotations

from typing import Optional

from skip_harness.codec import StoredForm
from skip_harness.store.bufferpool import BufferPool
from skip_harness.store.layout import Layout
from skip_harness.store.namespace import Namespace
from skip_harness.store.reader import StepReader
from skip_harness.store.status import StepReport, classify_step
from skip_harness.store.writer import StepWriter


class StepStore:
    """One namespace's steps, opened: `writer` writes them, `reader` reads and verifies them."""

    def __init__(self, layout: Layout, namespace: Namespace, *, pool: Optional[BufferPool] = None,
                 form: Optional[StoredForm] = None):
        """`namespace`: the layout's namespace, as its run or command opened it (`store.open.open_namespace`).
        `pool`: the buffers payloads are staged in and read into (the harness sizes one for its K; by
        default a small one). `form`: how payloads are written (`codec.stored_form(compression, level)`;
        by default raw, at full width); files of every form are read."""
        self.layout = layout
        self.namespace = namespace
        self.pool = pool if pool is not None else BufferPool()
        self.form = form if form is not None else StoredForm(narrow=False)
        self.writer = StepWriter(layout, self.namespace, self.pool, self.form)
        self.reader = StepReader(layout, self.namespace, self.pool)

    def status(self, step: int) -> StepReport:
        """The step's StepReport (directory listings and lstat only; see `classify_step`)."""
        return classify_step(self.layout, step, namespace=self.namespace)
