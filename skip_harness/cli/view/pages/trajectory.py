"""One trajectory: its whole prompt and response, coloured by a per-token field, and its values."""
from __future__ import annotations

from typing import Any, Dict

from skip_harness.cli.view.data import Cache, ViewedNamespace
from skip_harness.cli.view.decode import Decoder, show
from skip_harness.cli.view.pages.step import ids_only
from skip_harness.cli.view.pages.common import BadQuery, NotFound, _decoder, _no_step, colour_keys, token_row


def trajectory(cache: Cache, ns: ViewedNamespace, step: int, ref: str, decoder: Decoder, color: str = "") -> Dict[str, Any]:
    report = cache.scan(ns)
    s = report.get(step)
    if s is None:
        raise _no_step(ns, step, report)
    read, table = cache.table(ns, s)
    if table is None:
        raise NotFound(f"step {step} of {ns.layout.root} is {read.status}: {read.reason}")
    decoder = _decoder(ns, s, decoder)
    at = next((k for k, t in enumerate(table.trajectories) if t.ref == ref), None)
    if at is None:
        raise NotFound(f"step {step} of {ns.layout.root} has no trajectory {ref} (inner.rank.index)")
    t = table.trajectories[at]
    shown = show(t, decoder)
    keys = colour_keys([shown])
    if color and keys and color not in keys:
        raise BadQuery(f"color={color!r}: colour by one of {', '.join(keys)}")
    asked = color if color in keys else ""
    color = asked or (keys[0] if keys else "")
    return {"ns": ns, "step": step, "traj": t, "asked_color": asked, "shown": shown, "advantage_computed": table.advantage_computed,
            "colour_row": token_row(shown, color) if color else None, "colour_keys": keys, "color": color,
            "prev_ref": table.trajectories[at - 1].ref if at > 0 else None,
            "next_ref": table.trajectories[at + 1].ref if at + 1 < len(table.trajectories) else None,
            "count": len(table.trajectories), "position": at + 1, "decoder_name": decoder.name,
            "dead": t.group in table.dead, "ids_only": ids_only(decoder, [shown])}


