"""The project's Markdown renders its tables whole: a blank line inside a table ends it, and every
row after it rendered as plain text (README's options table did, from `storage_options` on)."""

from __future__ import annotations

import glob
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SEPARATOR = re.compile(r"^\|(\s*:?-+:?\s*\|)+\s*$")  # |---|---:| under a table's header


@pytest.mark.parametrize(
    "name", ["README.md", *sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))]
)
def test_no_table_is_cut_by_a_blank_line(name):
    lines = open(os.path.join(ROOT, name), encoding="utf-8").read().split("\n")
    cut = [
        i + 1
        for i in range(1, len(lines) - 1)
        if not lines[i].strip()
        and lines[i - 1].startswith("|")
        and lines[i + 1].startswith("|")
        and not (i + 2 < len(lines) and SEPARATOR.match(lines[i + 2]))  # a new table starts: its header
    ]
    assert not cut, f"{name}: a blank line inside a table at line(s) {cut}"
