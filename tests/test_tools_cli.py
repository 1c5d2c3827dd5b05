"""One entry point for the tools: `minddp <tool>` and `python -m minddp <tool>`."""

import importlib
import subprocess
import sys

import pytest

from minddp.tools import TOOLS, main
from tests.conftest import BIN


def test_help_lists_every_tool(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    for name, (_, line) in TOOLS.items():
        assert f"  {name} " in out and line in out, name


def test_no_tool_or_an_unknown_one_is_exit_2_with_the_list(capsys):
    with pytest.raises(SystemExit) as done:
        main([])
    assert done.value.code == 2 and "prepare" in capsys.readouterr().out
    with pytest.raises(SystemExit) as done:
        main(["benchh"])
    err = capsys.readouterr().err
    assert done.value.code == 2 and "unknown tool 'benchh'" in err and "bench-ddp" in err


@pytest.mark.parametrize("name", sorted(TOOLS))
def test_every_tool_module_has_a_main(name):
    module = importlib.import_module(f"minddp.tools.{TOOLS[name][0]}")
    assert callable(module.main)


def test_a_tool_gets_its_own_arguments_and_name(capsys, monkeypatch):
    monkeypatch.setattr("sys.argv", ["minddp"])
    main(["costmodel", "allreduce", "--size", "512MB", "--n", "16", "--alpha-us", "5", "--beta-gbs", "50"])
    assert "total                           = 19.3500 ms" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["costmodel", "--help"])
    assert capsys.readouterr().out.startswith("usage: minddp costmodel")
    with pytest.raises(SystemExit):
        main(["bench_trainer", "--help"])  # the module's spelling works too
    assert capsys.readouterr().out.startswith("usage: minddp bench-trainer")


@pytest.mark.slow
def test_console_script_and_python_dash_m_run_the_dispatcher():
    for cmd in ([str(BIN / "minddp"), "--help"], [sys.executable, "-m", "minddp", "--help"]):
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        assert p.returncode == 0 and all(name in p.stdout for name in TOOLS), (cmd, p.stderr)
