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


def bash_commands():
    """Every command line of the README's ```bash blocks: (program, arguments), after the
    leading VAR=value assignments, without the trailing comment."""
    import shlex

    for block in re.findall(r"```bash\n(.*?)```", README, re.S):
        for line in block.splitlines():
            words = shlex.split(line.split(" #", 1)[0].strip(), comments=True)
            while words and re.match(r"^[A-Z_]+=", words[0]):
                words = words[1:]
            if words:
                yield words[0], words[1:]


def test_readme_commands_refer_to_things_that_exist():
    """After `make train` and `source .venv/bin/activate`, each command's program, script,
    module, tool and make target exists: the venv the Makefile makes, its console script,
    the files in this repository."""
    import importlib.util

    import tomllib  # noqa: I001 - ruff's target version does not know it as stdlib

    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z][\w-]*):", makefile, re.M))
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert re.search(r"^VENV\s*\?=\s*\.venv$", makefile, re.M), "the README activates .venv"
    seen = set()
    for prog, args in bash_commands():
        seen.add(prog)
        if prog == "make":
            assert args[0] in targets, f"README: make {args[0]}: no such target"
        elif prog == "minddp":
            assert "minddp" in scripts and args[0] in TOOLS, f"README: minddp {args[0]}: no such tool"
        elif prog in ("python", "torchrun"):
            own = args[:next((i for i, a in enumerate(args) if a.endswith(".py")), len(args))]
            if "-m" in own:  # after the script, -m is Hydra's multirun
                module = own[own.index("-m") + 1]
                assert importlib.util.find_spec(module.split(".")[0]) and importlib.util.find_spec(module), \
                    f"README: -m {module}: no such module"
            else:
                script = next(a for a in args if a.endswith(".py"))
                assert (ROOT / script).is_file(), f"README: {prog} {script}: no such file"
        elif prog == "sbatch":
            script = next(a for a in args if a.startswith("slurm/"))
            assert (ROOT / script).is_file(), f"README: sbatch {script}: no such file"
        elif prog == "source":
            assert args == [".venv/bin/activate"], args
        elif prog != "export":
            assert (ROOT / prog).is_file(), f"README runs {prog}, which is not in the repository"
    assert {"make", "python", "torchrun", "minddp", "source"} <= seen, seen


@pytest.mark.slow
def test_make_help_lists_every_target_with_one_line():
    import subprocess

    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z][\w-]*):", makefile, re.M))
    out = subprocess.run(["make", "-s", "help"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    listed = {line.split()[1]: line for line in out.splitlines()}
    assert set(listed) == targets, sorted(set(listed) ^ targets)
    assert all(len(line.split(None, 2)) == 3 for line in listed.values()), out  # each has its line


# run after the README's snippet, in its namespace: "gradients are averaged when backward
# returns" means each rank's grad equals one process's gradient of the loss on every rank's batch
# (the step's initial weights recovered from SGD's update: w0 = w + lr * grad)
AVERAGED_CHECK = """
import torch.distributed as _dist
_n = _dist.get_world_size() if _dist.is_initialized() else 1
_xs, _ys = [torch.empty_like(x) for _ in range(_n)], [torch.empty_like(y) for _ in range(_n)]
if _n > 1:
    _dist.all_gather(_xs, x), _dist.all_gather(_ys, y)
else:
    _xs, _ys = [x], [y]
_ref = torch.nn.Linear(10, 1).to(dev)
with torch.no_grad():
    for _p, _q in zip(_ref.parameters(), model.module.parameters()):
        _p.copy_(_q + 0.1 * _q.grad)
torch.nn.functional.mse_loss(_ref(torch.cat(_xs)), torch.cat(_ys)).backward()
for _p, _q in zip(_ref.parameters(), model.module.parameters()):
    torch.testing.assert_close(_q.grad, _p.grad)
assert _n == 1 or not torch.equal(_xs[0], _xs[1])  # the ranks' batches differ: a real average
print(f"gradients averaged over {_n} rank(s)")
"""


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_the_engine_snippet_runs_as_written(tmp_path, nproc):
    import subprocess
    import sys

    from tests.conftest import BIN
    from tests.launch import free_port

    engine = README.split("## The engine", 1)[1]
    snippet = re.search(r"```python\n(.*?)```", engine, re.S).group(1)
    (tmp_path / "example.py").write_text(snippet + AVERAGED_CHECK)
    cmd = ([sys.executable] if nproc == 1 else
           [str(BIN / "torchrun"), f"--nproc_per_node={nproc}", "--rdzv_backend=c10d",
            f"--rdzv_endpoint=127.0.0.1:{free_port()}"])
    p = subprocess.run([*cmd, "example.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                       env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"gradients averaged over {nproc} rank(s)" in p.stdout, p.stdout[-2000:]
