"""One entry point for the tools: `minddp <tool>` and `python -m minddp <tool>`."""


import importlib
import sys

import pytest

from minddp.tools import TOOLS, main


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


# ------------------------------------------------------------------ minddp report
def fake_run(run_dir, lr, losses, overrides, extra_rows="", mfu=None, data_dir="/data/a"):
    """A run as train.py leaves it: metrics.jsonl, run.json with the full config, and the
    command line's overrides in .hydra/overrides.yaml."""
    import json

    (run_dir / ".hydra").mkdir(parents=True)
    rows = [{"step": i + 1, "loss": loss, "step_time_s": 0.1, "tokens_per_s": 1000.0 + i,
             **({} if mfu == "absent" else {"mfu": mfu})} for i, loss in enumerate(losses)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + extra_rows)
    config = {"optim": {"lr": lr, "min_lr": lr / 10}, "data": {"dir": data_dir}, "seed": 1,
              "wandb": {"name": str(run_dir)}}
    (run_dir / "run.json").write_text(json.dumps({"world_size": 1, "config": config}))
    (run_dir / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))


def test_report_columns_are_the_swept_keys_and_every_run_has_its_loss_curve(tmp_path, drawn_figures, capsys):
    """An lr sweep: optim.min_lr and data.dir differ too, but only optim.lr was set on the
    command line; the PNG holds a loss curve per run, its legends and titles inside it."""
    from minddp.tools import report

    curves = {0.001: [5.0, 4.0, 3.5], 0.003: [5.0, 3.0, 2.5]}
    for i, (lr, losses) in enumerate(curves.items()):
        fake_run(tmp_path / f"sweep/{i}", lr, losses, [f"optim.lr={lr}", "train.max_steps=3"],
                 data_dir=f"/data/{i}")
    report.main([str(tmp_path / "sweep")])
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("| "))
    assert header.split(" | ")[0] == "| optim.lr" and "min_lr" not in header and "data.dir" not in header
    assert f"wrote {tmp_path / 'sweep/report'}.md and {tmp_path / 'sweep/report'}.png" in out
    (fig,) = drawn_figures
    loss_axes = fig.axes[1]
    drawn = {line.get_label(): list(line.get_ydata()) for line in loss_axes.get_lines()}
    assert drawn == {f"optim.lr={lr}": losses for lr, losses in curves.items()}
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    renderer = FigureCanvasAgg(fig).get_renderer()  # pyplot's canvas is gone once the figure is closed
    page = fig.bbox
    for artist in [a.get_legend() for a in fig.axes] + [a.title for a in fig.axes]:
        box = artist.get_window_extent(renderer)
        assert page.x0 <= box.x0 and box.x1 <= page.x1 and page.y0 <= box.y0 and box.y1 <= page.y1, artist


def test_report_takes_mfu_null_or_absent_and_skips_malformed_rows_in_one_line(tmp_path, capsys):
    from minddp.tools import report

    fake_run(tmp_path / "a", 0.001, [5.0, 4.0], ["optim.lr=0.001"], mfu=None,
             extra_rows='{"step": 3, "loss"\n[1, 2]\n{"step": "x"}\n\n')
    fake_run(tmp_path / "b", 0.002, [5.0, 3.0], ["optim.lr=0.002"], mfu="absent")
    text = report.report(tmp_path)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "skipped 3 malformed row(s) (line 3, 4, 5)" in err, err
    rows = [line.split(" | ") for line in text.splitlines() if line.startswith("| 0.00")]
    assert [(r[0], r[1], r[-2], r[-1]) for r in rows] == [("| 0.001", "2", "-", "ok |"),
                                                         ("| 0.002", "2", "-", "ok |")], text


@pytest.mark.parametrize("name", sorted(TOOLS))
def test_every_tools_help_names_it_as_minddp_tool(name, capsys, monkeypatch):
    monkeypatch.setattr("sys.argv", ["minddp"])
    with pytest.raises(SystemExit) as done:
        main([name, "--help"])
    out = capsys.readouterr().out
    assert done.value.code == 0 and out.startswith(f"usage: minddp {name} "), out[:200]
    assert "python -m minddp" not in out.split("\n\n", 1)[0]


def test_costmodel_help_documents_every_subcommand(capsys, monkeypatch):
    from minddp.tools import costmodel

    monkeypatch.setattr("sys.argv", ["minddp"])
    with pytest.raises(SystemExit):
        main(["costmodel", "--help"])
    out = capsys.readouterr().out
    commands = costmodel._parser()._subparsers._group_actions[0].choices
    assert len(commands) == 6
    for cmd in commands:
        line = next((x for x in out.splitlines() if x.strip().startswith(cmd + " ")), "")
        assert len(line.split()) > 2, f"minddp costmodel --help: no help for {cmd}"


def test_a_tools_configuration_error_is_one_line_and_exit_2(monkeypatch, capsys):
    """e.g. more nccl ranks than GPUs (minddp.parallel.dist) raised inside a tool: no traceback."""
    import types

    import pytest

    import minddp.tools as tools
    from minddp.errors import ConfigError

    def fail():
        raise ConfigError("2 ranks on 1 GPU: use --nproc_per_node=1")

    monkeypatch.setitem(sys.modules, "minddp.tools._fails", types.SimpleNamespace(main=fail))
    monkeypatch.setitem(tools.TOOLS, "fails", ("_fails", "raises a configuration error"))
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    with pytest.raises(SystemExit) as exit_:
        tools.main(["fails"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "configuration error: 2 ranks on 1 GPU" in err, err
