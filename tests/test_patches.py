"""Every patch on third-party code is listed in docs/design.md ("Third-party code we patch") as its
module's table says (skip_harness.integrations.verl_patches, trl_patches), and the shared checks."""
from __future__ import annotations

from pathlib import Path

from skip_harness.integrations import trl_patches, verl_patches
from skip_harness.integrations.patches import passes_through, rows

DESIGN = Path(__file__).resolve().parents[1] / "docs" / "design.md"


def test_design_md_lists_every_patch_with_its_guard():
    text = DESIGN.read_text()
    section = text[text.index("## Third-party code we patch"):]
    for table in (verl_patches.PATCHES, trl_patches.PATCHES):
        assert rows(table) in section, rows(table)


def test_an_override_passes_through_only_with_args_and_kwargs_after_a_leading_part():
    expected = ("model", "input_ids", "attention_mask")
    assert passes_through(("*args", "**kwargs"), expected)
    assert passes_through(("model", "*args", "**kwargs"), expected)
    assert not passes_through(("input_ids", "*args", "**kwargs"), expected)
    assert not passes_through(("model", "*args"), expected)
    assert not passes_through(expected, expected)
