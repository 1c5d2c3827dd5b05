"""Issue 43.7: a bucket-cap sweep's report.png is plotted against the swept key (not against a world
size that never changed), and the report says how loaded the machine was while each run trained."""

import json

from tests.files import line_data, md_rows


def sweep_run(folder, cap, load, world=1):
    """A run folder as train.py leaves it, with `ddp.bucket_cap_mb=cap` set on the command line."""
    (folder / ".hydra").mkdir(parents=True)
    rows = [{"step": i + 1, "loss": 5.0 - 0.1 * i, "step_time_s": 0.1 * (1 + cap / 100),
             "tokens_per_s": 1000.0 / (1 + cap / 100), "machine/load_1min": load} for i in range(5)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = {"ddp": {"bucket_cap_mb": cap}, "train": {"scaling": "strong"}}
    (folder / "run.json").write_text(json.dumps({"world_size": world, "config": config}))
    (folder / ".hydra" / "overrides.yaml").write_text(f"- ddp.bucket_cap_mb={cap}\n")


def test_a_cap_sweep_is_plotted_against_the_cap_in_numeric_order(tmp_path, drawn_figures):
    from minddp.tools import report

    for i, cap in enumerate([25, 1, 100, 5]):  # folder order is not numeric order
        sweep_run(tmp_path / f"job{i}", cap, load=1.0 + i)
    report.report(tmp_path)
    ax = drawn_figures[-1].axes[0]
    assert ax.get_xlabel() == "ddp.bucket_cap_mb"
    [(xs, ys)] = line_data(ax)
    assert list(xs) == [1, 5, 25, 100]
    assert list(ys) == sorted(ys, reverse=True)  # tokens/s falls with the cap in these rows


def test_the_report_gives_each_runs_machine_load_and_their_spread(tmp_path, drawn_figures):
    from minddp.tools import report

    for i, cap in enumerate([100, 5, 25, 1]):  # rows come out in the caps' numeric order
        sweep_run(tmp_path / f"job{i}", cap, load=[2.0, 4.0, 1.5, 0.5][i])
    text = report.report(tmp_path)
    rows = md_rows(text)
    assert [r["load"] for r in rows] == ["0.5", "4.0", "1.5", "2.0"]
    assert "Machine load" in text and "median 1.8, range 0.5-4.0" in text


def test_a_world_size_study_is_still_plotted_against_the_world_size(tmp_path, drawn_figures):
    from minddp.tools import report

    for world in (2, 1):
        sweep_run(tmp_path / f"w{world}", 25, load=1.0, world=world)
    report.report(tmp_path)
    ax = drawn_figures[-1].axes[0]
    assert ax.get_xlabel() == "world size"
    [(xs, _)] = line_data(ax)
    assert list(xs) == [1, 2]
