"""The README stays a user's guide: short, and everything it points at exists."""

import re

import pytest

from minddp.tools import TOOLS
from tests.conftest import ROOT

README = (ROOT / "README.md").read_text()
DOCS = ["README.md", "CHANGELOG.md", "docs/communication.md", "docs/exercises.md"]


def links(path):
    """Relative link targets of a markdown file: [text](target) and ![alt](target)."""
    targets = re.findall(r"\]\(([^)\s]+)\)", (ROOT / path).read_text())
    return [t for t in targets if not re.match(r"[a-z]+:", t)]  # not http:, mailto:, ...


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to dashes."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_readme_is_at_most_350_lines():
    assert len(README.splitlines()) <= 350, "README.md is a user's guide: detail goes to docs/, CHANGELOG.md"


@pytest.mark.parametrize("path", DOCS)
def test_every_relative_link_and_anchor_exists(path):
    base = (ROOT / path).parent
    for target in links(path):
        file, _, anchor = target.partition("#")
        doc = (base / file).resolve() if file else ROOT / path
        assert doc.exists(), f"{path} links to {target}, which does not exist"
        if anchor and doc.suffix == ".md":
            anchors = {slug(h) for h in re.findall(r"^#+ (.*)$", doc.read_text(), re.M)}
            assert anchor in anchors, f"{path} links to #{anchor}; {doc.name} has {sorted(anchors)}"


def test_readme_links_the_measurement_files_the_make_targets_write():
    targets = set(links("README.md"))
    for name in ("docs/bench_ddp.md", "docs/bench_memory.md", "docs/bench_trainer.md", "docs/scaling.md",
                 "docs/timeline.png"):
        assert name in targets, f"README.md does not link {name}"


def test_readme_names_every_tool_and_only_real_ones():
    table = README.split("## Tools", 1)[1].split("What moved", 1)[0]
    first_cells = [row.split("|")[1] for row in table.splitlines() if row.startswith("| `")]
    named = {m.split()[0] for cell in first_cells for m in re.findall(r"`([^`]+)`", cell)}
    assert named == set(TOOLS), f"README tools table: {sorted(named)}; minddp --help: {sorted(TOOLS)}"


def test_every_make_target_the_readme_names_exists():
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z][\w-]*):", makefile, re.M))
    for name in set(re.findall(r"`make ([a-z][\w-]*)", README)):
        assert name in targets, f"README.md names `make {name}`, which the Makefile lacks"


def test_no_old_tool_module_is_given_as_a_command():
    """The tools moved behind `minddp <tool>`; only the table of what moved (old | new) names the
    old modules."""
    for line in README.splitlines():
        if re.search(r"-m minddp\.(?!demos)\w+", line):
            cells = line.split("|")
            assert line.startswith("|") and len(cells) > 2 and "minddp " in cells[-2], \
                f"README.md runs a tool by its old module name: {line}"


def test_the_readme_memory_table_is_what_make_bench_memory_measured():
    """The peaks quoted in the README are the committed docs/bench_memory.json's (largest rank)."""
    import json

    rows = json.loads((ROOT / "docs/bench_memory.json").read_text())["rows"]
    peak = {(r["model"], r["dp"], r["config"]): max(x["peak"] for x in r["ranks"]) / 1e6
            for r in rows if "ranks" in r}
    columns = ["torch-ddp", "minddp-ddp", "minddp-zero1", "torch-zero"]
    quoted = re.findall(r"^\| ([\d.]+M), (\d) \| (\d+) \| (\d+) \| (\d+) \| (\d+) \|$", README, re.M)
    assert len(quoted) >= 3
    for model, dp, *mb in quoted:
        for config, value in zip(columns, mb):
            assert round(peak[(f"gpt-{model}", int(dp), config)]) == int(value), (model, dp, config)
