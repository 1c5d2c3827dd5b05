"""One entry point for the tools: `minddp <tool>` and `python -m minddp <tool>`."""


import subprocess
import sys

import pytest

from minddp.tools import TOOLS
from tests.conftest import BIN


@pytest.mark.slow
def test_console_script_and_python_dash_m_run_the_dispatcher():
    for cmd in ([str(BIN / "minddp"), "--help"], [sys.executable, "-m", "minddp", "--help"]):
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        assert p.returncode == 0 and all(name in p.stdout for name in TOOLS), (cmd, p.stderr)
