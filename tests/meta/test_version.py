"""One version, written once: minddp.__version__. pyproject.toml reads it (setuptools'
`dynamic = ["version"]`), and the README and CHANGELOG name no newer one (issue 50.6: pyproject
said 0.4.0 while the README and CHANGELOG said 0.5.0)."""

import re
import shutil
import subprocess
import sys

import pytest

import minddp
from tests.conftest import ROOT

RELEASE = "0.6.0"  # this round's release: what the package, the CHANGELOG and the wheel say


def _key(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in version.split("."))


def test_the_version_is_this_rounds_release():
    assert minddp.__version__ == RELEASE


def test_pyproject_reads_the_version_from_the_package_and_writes_none_of_its_own():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "minddp.__version__"}
    written = re.findall(r'__version__\s*=\s*"([^"]+)"', (ROOT / "minddp" / "__init__.py").read_text())
    assert written == [minddp.__version__]


def test_the_changelogs_newest_release_is_the_version():
    headings = re.findall(r"^## (\d+\.\d+\.\d+)", (ROOT / "CHANGELOG.md").read_text(), flags=re.M)
    assert headings and headings[0] == minddp.__version__, (
        f"CHANGELOG.md's newest release is {headings[:1]}, minddp.__version__ is {minddp.__version__}: "
        "add its '## <version>' section (or set the version in minddp/__init__.py)")
    assert headings == sorted(headings, key=_key, reverse=True), headings


def test_the_readme_names_no_version_newer_than_the_package():
    named = set(re.findall(r"\b(?:minddp |in |version )(\d+\.\d+\.\d+)\b", (ROOT / "README.md").read_text()))
    assert named, "the README names minddp's versions in its 'What moved in X' notes"
    newer = [v for v in named if _key(v) > _key(minddp.__version__)]
    assert not newer, f"README.md names {newer}, newer than minddp.__version__ {minddp.__version__}"


@pytest.mark.slow  # a build backend in a subprocess (~2 s)
def test_a_built_package_has_the_version(tmp_path):
    """What pip records: the metadata setuptools builds from pyproject.toml (in a copy: the build
    writes into its source folder)."""
    src = tmp_path / "src"
    (src / "minddp").mkdir(parents=True)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copy(ROOT / "minddp" / "__init__.py", src / "minddp" / "__init__.py")  # read, not imported
    (tmp_path / "meta").mkdir()
    build = ("import sys; from setuptools import build_meta as b; "
             "print(b.prepare_metadata_for_build_wheel(sys.argv[1]))")
    p = subprocess.run([sys.executable, "-c", build, str(tmp_path / "meta")], cwd=src, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    metadata = (tmp_path / "meta" / p.stdout.split()[-1] / "METADATA").read_text()
    assert f"\nVersion: {minddp.__version__}\n" in metadata, metadata[:300]
