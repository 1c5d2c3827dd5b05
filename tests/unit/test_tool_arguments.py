"""Every tool's arguments are declared and checked one way (minddp.tools.arguments): a bad one is
one line on stderr and exit 2, before the tool builds a model or starts a process group. Each
call below ran into a traceback, an exit 1 or a tool that started anyway before (issue 50.3)."""

import json

import pytest

from minddp.tools import TOOLS
from minddp.tools import main as tools_main
from minddp.tools.arguments import (
    BadValue,
    choice_list,
    float_list,
    int_list,
    positive_float,
    positive_int,
    size,
    writable_out,
)

BAD = {
    "scaling": ["--worlds 1,x", "--worlds 0", "--worlds=", "--worlds 1,,2", "--worlds -2", "--caps 0",
                "--caps nan", "--caps x", "--steps 0", "--warmup -1", "--steps 4 --warmup 4", "--repeats 0",
                "--variants nope", "--variants ddp,nope", "--preset nope", "--mode x",
                "--reuse {tmp}/missing", "--reuse {tmp}/afile", "--calibration {tmp}/notjson.txt",
                "--calibration {tmp}/empty.json", "--calibration {tmp}", "--out {tmp}/afile/s",
                "--out /proc/nope/s", "--calibration {tmp}/missing.json", "bogus.key=1"],
    "timeline": ["--bucket-mb -1", "--bucket-mb 0", "--bucket-mb nan", "--bucket-mb x", "--n-layer 0",
                 "--n-embd 100", "--n-embd -6", "--out {tmp}/afile/t", "--out {tmp}/", "--compile x"],
    "bench-ddp": ["--caps x", "--caps=", "--caps -1", "--caps 1,inf", "--repeats 0", "--rounds x",
                  "--steps-per-round 0", "--batch 0", "--n-embd 7", "--n-layer -1", "--compile-cap 0",
                  "--link-gbps -1", "--link-gbps nan", "--out {tmp}/afile/b", "--backend x", "--compile x"],
    "bench": ["-b x", "-b 0", "-b 64M -e 8", "-f 1", "-f nan", "--op nope", "--op=", "-d x", "-w -1", "-n 0",
              "--csv {tmp}/afile/x.csv", "--json {tmp}/afile/x.json", "--backend x"],
    "calibrate": ["--out {tmp}/afile/c.json", "--ops nope", "-f 0.5", "-n 0", "-w x", "--repeats 0",
                  "-b 1G", "-e -1"],
    "bench-debug": ["--iters 0", "--block x", "--iters=-5"],
    "bench-trainer": ["--repeats 0", "--rounds -1", "--steps x", "--out {tmp}/afile/t"],
    "bench-host": ["--repeats 0", "--rounds -1", "--steps-per-round x", "--layers 0", "--layers x,1",
                   "--hook-reps 0", "--out {tmp}/afile/h"],
    "bench-memory": ["--models nope", "--models=", "--dp 0", "--dp=", "--dp 2,x", "--configs nope",
                     "--steps 0", "--reuse {tmp}/missing.json", "--reuse {tmp}/notjson.txt",
                     "--reuse {tmp}/empty.json", "--out {tmp}/afile/m"],
    "costmodel": ["", "bogus", "ddp --params 124M --world 8", "allreduce --size 1MB --n 4",
                  "allreduce --size 1MB --n 4 --calibration {tmp}/notjson.txt",
                  "allreduce --size 1MB --n 4 --calibration {tmp}/empty.json",
                  "allreduce --size 1MB --n 4 --calibration {tmp}/missing.json",
                  "allreduce --size 1MB --n 4 --preset nope", "allreduce --size x --n 4 --preset ib-ndr",
                  "allreduce --size 1MB --n x --preset ib-ndr", "tree --preset ib-ndr",
                  "ddp --params 124M --world 8 --preset ib-ndr --dtype fp7"],
    "report": ["{tmp}/missing", "{tmp}/afile", "{tmp}/runs --out {tmp}/afile/rep",
               "{tmp}/runs --out /proc/nope/rep", "{tmp}/runs --out {tmp}/runs/", "", "{tmp}/runs"],
    "debug": ["", "{tmp}/missing", "{tmp}/afile", "{tmp} {tmp}"],
    "sample": ["", "{tmp} --tokens x", "{tmp} --temperature x", "{tmp} --seed 1.5", "{tmp} --nope"],
    "export": ["", "{tmp}/runs", "--to {tmp}/o", "{tmp}/runs --to {tmp}/o --nope"],
    "prepare": ["", "{tmp}/afile", "{tmp}/afile --out {tmp}/o --tokenizer x",
                "{tmp}/afile --out {tmp}/o --vocab-size x"],
}
CASES = [(tool, call) for tool, calls in BAD.items() for call in calls]


@pytest.fixture
def places(tmp_path, monkeypatch):
    """A file (where a folder is needed), a file that is not JSON, a JSON without the keys, a
    folder of runs; the working directory is tmp_path (a default output lands there)."""
    (tmp_path / "afile").write_text("a file\n")
    (tmp_path / "notjson.txt").write_text("# not JSON\n")
    (tmp_path / "empty.json").write_text(json.dumps({}))
    (tmp_path / "runs").mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.argv", ["minddp"])
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    return tmp_path


def call(capsys, tool: str, argv: str, tmp) -> tuple[int, str, str]:
    args = argv.format(tmp=tmp).split() if argv.strip() else []
    try:
        tools_main([tool, *args])
        code = 0
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_every_tool_has_bad_calls_in_the_table():
    assert sorted(BAD) == sorted(TOOLS)


@pytest.mark.parametrize(("tool", "argv"), CASES, ids=[f"{t} {a}" for t, a in CASES])
def test_a_bad_argument_is_one_line_and_exit_2(tool, argv, places, capsys):
    before = sorted(places.rglob("*"))
    code, out, err = call(capsys, tool, argv, places)
    assert sorted(places.rglob("*")) == before, "a refused call left a folder (issue 56.12)"
    assert code == 2, (code, err[-2000:])
    assert "Traceback" not in err and err.count("\n") == 1, err[-2000:]
    assert err.startswith(f"minddp {tool}") and "error: " in err, err
    assert out == "", out[:500]


@pytest.mark.parametrize(("tool", "argv", "says"), [
    ("scaling", "--worlds 1,x", "--worlds '1,x': 'x' is not a whole number"),
    ("scaling", "--worlds 0", "--worlds '0': 0 is not possible: it must be a finite number >= 1"),
    ("scaling", "--worlds=", "--worlds '' is not a comma-separated list of whole numbers (e.g. 1,2,4)"),
    ("scaling", "--calibration {tmp}/notjson.txt", "{tmp}/notjson.txt is not a calibration JSON"),
    ("scaling", "--calibration {tmp}/empty.json", "is not a calibration JSON (`make calibrate` writes one) "
                                                  "(KeyError"),
    ("scaling", "--steps 4 --warmup 4", "--warmup 4 leaves none of --steps 4 to measure"),
    ("scaling", "--variants ddp,nope", "'nope' is not one of ddp, zero1, overlap"),
    ("timeline", "--bucket-mb -1", "--bucket-mb -1 is not possible: it must be a finite number > 0"),
    ("timeline", "--n-embd 100", "--n-embd 100 is not a multiple of the study GPT's 6 heads (e.g. 96)"),
    ("bench-ddp", "--caps x", "--caps 'x': 'x' is not a number"),
    ("report", "{tmp}/runs --out {tmp}/afile/rep", "--out {tmp}/afile is a file"),
    ("report", "{tmp}/runs --out /proc/nope/rep", "--out /proc/nope cannot be written"),
    ("report", "{tmp}/missing", "folder {tmp}/missing does not exist"),  # issue 56.12: "is not a folder"
    ("report", "{tmp}/afile", "folder {tmp}/afile is a file, not a folder"),
    ("scaling", "--calibration {tmp}/missing.json", "{tmp}/missing.json: no such file; give a calibration"),
    ("scaling", "bogus.key=1", "overrides bogus.key=1: Could not override 'bogus.key'. (Key 'bogus' not in"),
    ("costmodel", "ddp --params 124M --world 8", "ddp: give --preset, --calibration, or both --alpha-us"),
    ("bench", "-b 64M -e 8", "-b/--minbytes 6.4e+07 is more than -e/--maxbytes 8"),
])
def test_the_line_names_the_option_the_value_and_what_it_takes(tool, argv, says, places, capsys):
    _, _, err = call(capsys, tool, argv, places)
    assert says.format(tmp=places) in err, err
    assert err.rstrip().endswith(f"(`minddp {tool} --help` lists the options)"), err


def test_under_torchrun_each_rank_says_which_it_is(places, capsys, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    code, _, err = call(capsys, "timeline", "--bucket-mb -1", places)
    assert code == 2 and err.startswith("[rank 1] minddp timeline: error: --bucket-mb -1"), err


def test_good_values_parse_to_what_the_tools_use(places):
    from minddp.perf.sweep import OPS
    from minddp.tools import bench, scaling

    args = scaling.parse(["--worlds", "1, 2,4", "--caps", "1,25.5", "--variants", "auto"])
    assert args.worlds == [1, 2, 4] and args.caps == [1.0, 25.5]
    assert args.variants == ["ddp", "zero1", "overlap"]
    assert scaling.parse([]).calibration is None  # the default: docs/calibration.json, else the preset
    args = bench.parse_sweep(bench._parser(), ["--op", "all", "-b", "1KiB", "-e", "1MB"])
    assert args.op == OPS and args.minbytes == 1024 and args.maxbytes == 1e6
    args = bench.parse_sweep(bench._parser(), ["--op", "all_reduce,broadcast"])
    assert args.op == ["all_reduce", "broadcast"]


def test_the_types_alone():
    assert positive_int("3") == 3 and positive_float("0.5") == 0.5 and size("64MiB") == 2**26
    assert int_list()("4") == [4] and float_list()("1e-3,2") == [1e-3, 2.0]
    assert choice_list(["a", "b"], every="all")("all") == ["a", "b"]
    for parse, text in [(positive_int, "0"), (positive_float, "inf"), (size, "-5MB"), (size, "1.2.3MB"),
                        (int_list(), "1,"), (float_list(), ","), (choice_list(["a"]), "a,b")]:
        with pytest.raises(BadValue):
            parse(text)


def test_an_output_prefix_gets_its_folder(tmp_path):
    """A missing folder is made (the tool writes there next); nothing else is left behind."""
    folder = tmp_path / "new" / "deeper"
    assert writable_out(str(folder / "report")) == str(folder / "report")
    assert folder.is_dir() and not any(folder.iterdir())
