"""The one renderer of the tools' reports. A tool builds a report: a list of blocks, each a
paragraph (a string) or a table ({"header": [...], "rows": [[...], ...]}), and its raw
measurements; `write` keeps both as JSON (for scripts, tests, a later re-rendering) and
writes the markdown rendered from that JSON beside it."""

from __future__ import annotations

import json
import statistics
from pathlib import Path


def table(header: list[str], rows: list[list]) -> dict:
    return {"header": list(header), "rows": [[str(c) for c in r] for r in rows]}


def markdown(blocks: list) -> str:
    """Paragraphs and tables, a blank line between blocks."""
    out = []
    for b in blocks:
        if isinstance(b, str):
            out.append(b)
            continue
        lines = ["| " + " | ".join(b["header"]) + " |", "|" + "---|" * len(b["header"])]
        out.append("\n".join(lines + ["| " + " | ".join(r) + " |" for r in b["rows"]]))
    return "\n\n".join(out)


def count(n: float) -> str:
    """A parameter count a small model does not print as 0.0M: 10.8M, 23.4K, 512."""
    return f"{n / 1e6:.1f}M" if n >= 1e5 else f"{n / 1e3:.1f}K" if n >= 1e3 else f"{n:.0f}"


def megabytes(nbytes: float, signed: bool = False) -> str:
    """Whole MB, but two decimals under 10 MB (a small model's states are not 0), and never -0."""
    text = f"{nbytes / 1e6:{'+' if signed else ''}.{0 if abs(nbytes) >= 10e6 else 2}f}"
    return text.lstrip("+-") if float(text) == 0 else text


def median_spread(values, fmt: str = ".3f") -> list[str]:
    """[median, min-max] of repeated measurements: how every ratio is reported."""
    return [format(statistics.median(values), fmt), f"{min(values):{fmt}}-{max(values):{fmt}}"]


def write(out: str | Path, blocks: list, data: dict | None = None) -> tuple[Path, Path]:
    """`out` as .json (blocks and data) and .md (rendered from the JSON just written)."""
    stem = Path(out).with_suffix("")
    doc = {"blocks": blocks, "data": data or {}}
    json_path, md_path = stem.with_suffix(".json"), stem.with_suffix(".md")
    json_path.write_text(json.dumps(doc, indent=1) + "\n")
    md_path.write_text(markdown(json.loads(json_path.read_text())["blocks"]) + "\n")
    return json_path, md_path
