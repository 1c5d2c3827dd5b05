"""Every command in docs/exercises.md runs and prints what the text says."""


import re

import pytest

from tests import launch
from tests.conftest import BIN, ROOT

DOC = (ROOT / "docs" / "exercises.md").read_text()


def _commands():
    """(command, [expected substrings]) from the bash blocks."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", DOC, re.S):
        for line in block.strip().splitlines():
            if line.startswith("# expect: "):
                out[-1][1].append(line.removeprefix("# expect: "))
            elif line.strip():
                out.append((line.strip(), []))
    return out


COMMANDS = _commands()


def test_every_exercise_has_a_command():
    assert len(re.findall(r"^## \d+\.", DOC, re.M)) == 7
    assert len(COMMANDS) >= 8


@pytest.mark.slow
@pytest.mark.parametrize("command,expected", COMMANDS, ids=[c for c, _ in COMMANDS])
def test_exercise_command(command, expected):
    """Each command on forked ranks (tests/launch.py); torchrun itself runs one of them in
    test_demos.py::test_cli_under_torchrun_and_help."""
    p = launch.command(command, env={"OMP_NUM_THREADS": "1", "PATH": f"{BIN}:/usr/bin:/bin"})
    assert p.returncode == 0, p.stderr[-3000:]
    for text in expected:
        assert text in p.stdout + p.stderr, (text, p.stdout[-3000:])
