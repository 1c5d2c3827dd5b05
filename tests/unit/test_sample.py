"""minddp sample: finds the data folder a run recorded, names what is missing, and decodes
byte, BPE and nanoGPT character vocabularies; GPT-2 ids without a tokenizer come out as ids."""


import json
import os
import pickle

import pytest
import torch

from minddp.model.build import build_model
from minddp.tools import sample

MODEL = {"name": "gpt", "n_layer": 1, "n_head": 2, "n_embd": 16, "block_size": 16, "dropout": 0.0,
         "bias": True}


def fake_run(run_dir, data_dir, vocab):
    """A run directory with one checkpoint of a tiny untrained GPT, as the trainer saves it."""
    cfg = {"model": {**MODEL, "vocab_size": vocab}, "data": {"name": "tokens", "dir": str(data_dir)}}
    torch.manual_seed(0)
    model = build_model(sample._Cfg(cfg["model"]), vocab)
    (run_dir / "checkpoints").mkdir(parents=True)
    torch.save({"model": model.state_dict(), "optimizer": {}, "scheduler": {}, "step": 1, "config": cfg},
               run_dir / "checkpoints" / "ckpt_00000001.pt")
    return run_dir


def run(capsys, *argv):
    try:
        sample.main([str(a) for a in argv])
        code = 0
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def char_folder(folder, chars="abcdefgh \n"):
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": len(chars), "itos": dict(enumerate(chars)),
                     "stoi": {c: i for i, c in enumerate(chars)}}, f)
    return folder


def test_nanogpt_char_vocabulary_decodes(tmp_path, capsys):
    run_dir = fake_run(tmp_path / "run", char_folder(tmp_path / "data"), 10)
    code, out, err = run(capsys, run_dir, "--prompt", "abc", "--tokens", "30")
    assert code == 0, err
    assert out.startswith("abc") and set(out) <= set("abcdefgh \n") and len(out) >= 30


def test_byte_and_bpe_tokenizer_files_decode(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "tokenizer.json").write_text(json.dumps({"type": "bytes", "vocab_size": 256}))
    codec = sample.Codec.for_folder(tmp_path / "b")
    assert codec.name == "bytes" and codec.decode(codec.encode("héllo")) == "héllo"
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["the cat sat on the mat"] * 50, trainers.BpeTrainer(
        vocab_size=280, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    (tmp_path / "p").mkdir()
    tok.save(str(tmp_path / "p" / "tokenizer.json"))
    codec = sample.Codec.for_folder(tmp_path / "p")
    assert codec.name.startswith("bpe") and codec.decode(codec.encode("the cat sat")) == "the cat sat"


def test_a_relative_data_dir_of_an_older_run_is_found_from_another_directory(tmp_path, capsys, monkeypatch):
    project = tmp_path / "project"
    char_folder(project / "data" / "chars")
    run_dir = fake_run(project / "outputs" / "2026-12-01" / "10-00-00", "data/chars", 10)  # relative
    monkeypatch.chdir(tmp_path)  # not the project: the folder is found above the run dir
    code, out, err = run(capsys, run_dir, "--prompt", "ab", "--tokens", "5")
    assert code == 0 and out.startswith("ab"), err


def test_a_missing_data_folder_is_named(tmp_path, capsys):
    run_dir = fake_run(tmp_path / "run", tmp_path / "moved", 10)
    code, _, err = run(capsys, run_dir, "--tokens", "5")
    assert code == 2
    assert f"the data folder this run trained on, '{tmp_path / 'moved'}' (data.dir in its saved config), " \
           "does not exist" in err and "--data DIR" in err, err
    char_folder(tmp_path / "here")
    assert run(capsys, run_dir, "--data", tmp_path / "here", "--prompt", "a", "--tokens", "3")[0] == 0


def test_gpt2_ids_without_a_tokenizer_are_printed_as_ids(tmp_path, capsys):
    (tmp_path / "shards").mkdir()  # llm.c's GPT-2 shards bring no tokenizer file
    run_dir = fake_run(tmp_path / "run", tmp_path / "shards", 50_257)
    code, out, err = run(capsys, run_dir, "--tokens", "4", "--temperature", "0")
    assert code == 0, err
    assert "tokenizer.json and a meta.pkl with itos are missing, so these GPT-2 token ids cannot be turned " \
           "into text; printing the ids" in err
    ids = [int(i) for i in out.split()]
    assert ids[0] == 50_256 and len(ids) == 5 and all(0 <= i < 50_257 for i in ids)
    code, _, err = run(capsys, run_dir, "--prompt", "hello")
    assert code == 2 and "give --prompt-ids instead" in err
    code, out, _ = run(capsys, run_dir, "--prompt-ids", "464, 3290", "--tokens", "2")
    assert code == 0 and [int(i) for i in out.split()][:2] == [464, 3290]


@pytest.mark.parametrize("name,content,message", [
    ("meta.pkl", b"\x80\x04trunc", "meta.pkl cannot be read"),
    ("tokenizer.json", b"{not json", "tokenizer.json is not JSON"),
    ("tokenizer.json", b'{"model": 3}', "neither minddp's bytes marker nor a Hugging Face tokenizers file"),
])
def test_a_broken_tokenizer_file_is_named(tmp_path, capsys, name, content, message):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / name).write_bytes(content)
    run_dir = fake_run(tmp_path / "run", tmp_path / "d", 10)
    code, _, err = run(capsys, run_dir, "--tokens", "2")
    assert code == 2 and message in err and "Traceback" not in err, err


def test_no_checkpoint_is_a_clear_error(tmp_path, capsys):
    code, _, err = run(capsys, tmp_path)
    assert code == 2 and f"no checkpoint under {tmp_path}/checkpoints" in err
    assert not os.path.exists(tmp_path / "checkpoints")


@pytest.mark.parametrize("args,message", [
    (["--prompt-ids", "99999"], "--prompt-ids: 99999 is outside this model's vocabulary (ids 0 to 9)"),
    (["--prompt-ids", "-1"], "--prompt-ids: -1 is outside this model's vocabulary"),
    (["--prompt-ids", "abc"], "--prompt-ids 'abc': give integer token ids"),
    (["--temperature", "nan"], "--temperature must be a finite number >= 0 (0: greedy), got nan"),
    (["--top-k", "-5"], "--top-k must be >= 0 (0: off), got -5"),
    (["--tokens", "-1"], "--tokens must be >= 0"),
])
def test_bad_arguments_are_one_line_errors(tmp_path, capsys, args, message):
    run_dir = fake_run(tmp_path / "run", char_folder(tmp_path / "d"), 10)
    code, out, err = run(capsys, run_dir, *args)
    errors = [line for line in err.splitlines() if "error" in line]
    assert code == 2 and out == "" and len(errors) == 1 and "Traceback" not in err, err
    assert errors[0].startswith("minddp sample: error: ") and message in errors[0], err


def test_a_junk_newest_checkpoint_falls_back_to_the_previous_one_and_says_so(tmp_path, capsys):
    char_folder(tmp_path / "d")
    run_dir = fake_run(tmp_path / "run", tmp_path / "d", 10)
    junk = run_dir / "checkpoints" / "ckpt_00000002.pt"
    junk.write_bytes(os.urandom(3000))
    code, out, err = run(capsys, run_dir, "--prompt", "a", "--tokens", "3")
    assert code == 0 and len(out) >= 3, err
    assert "loading the model from" in err and "generating 3 tokens" in err
    assert f"warning: checkpoint {junk} is unreadable" in err and "trying the previous checkpoint" in err
    code, out, err = run(capsys, junk)  # the file itself: nothing to fall back to
    assert code == 2 and out == "" and f"minddp sample: error: checkpoint {junk} is unreadable" in err
    assert "Traceback" not in err


def _with_data_info(run_dir, **data):
    """The checkpoint as the trainer writes it: what the run read from its data beside the config."""
    path = run_dir / "checkpoints" / "ckpt_00000001.pt"
    state = torch.load(path, weights_only=True)
    torch.save({**state, "data": data}, path)
    return run_dir


def _bytes_folder(folder):
    folder.mkdir(parents=True)
    (folder / "tokenizer.json").write_text(json.dumps({"type": "bytes", "vocab_size": 256}))
    return folder


def test_a_model_vocabulary_padded_past_the_bytes_samples_only_bytes(tmp_path, capsys):
    """model.vocab_size=512 on byte data: before, bytes() of an id >= 256 after generating (exit 1)."""
    run_dir = _with_data_info(fake_run(tmp_path / "run", _bytes_folder(tmp_path / "data"), 512),
                              vocab_size=512, vocab_source="model.vocab_size")
    code, out, err = run(capsys, run_dir, "--prompt", "ab", "--tokens", "200", "--temperature", "2",
                         "--top-k", "0")
    assert code == 0 and out.startswith("ab"), err
    assert "sampling only the tokenizer's 256 ids of the model's 512" in err


def test_a_data_folder_re_prepared_with_another_tokenizer_is_refused_before_generating(tmp_path, capsys):
    """A BPE run (a vocabulary of 1000 from its meta.pkl) whose folder now holds bytes."""
    run_dir = _with_data_info(fake_run(tmp_path / "run", _bytes_folder(tmp_path / "data"), 1000),
                              vocab_size=1000, vocab_source="meta.pkl")
    code, out, err = run(capsys, run_dir, "--prompt", "ab", "--tokens", "5")
    assert code == 2 and out == "" and "generating" not in err, err
    assert "the tokenizer (bytes) has 256 ids, the run trained on a vocabulary of 1000 (meta.pkl)" in err
    assert "pass --data with the folder it trained on" in err and err.count("\n") == 2  # loading + the error


def test_a_tokenizer_larger_than_the_model_is_refused(tmp_path, capsys):
    run_dir = fake_run(tmp_path / "run", _bytes_folder(tmp_path / "data"), 100)
    code, _, err = run(capsys, run_dir, "--prompt", "ab", "--tokens", "5")
    assert code == 2 and "the tokenizer (bytes) has 256 ids, the model only 100" in err, err


def test_a_char_vocabulary_whose_itos_is_a_list_decodes(tmp_path, capsys):
    chars = "abcdefgh \n"
    folder = tmp_path / "data"
    folder.mkdir()
    with open(folder / "meta.pkl", "wb") as f:  # the trainer accepts it (only vocab_size is read)
        pickle.dump({"vocab_size": len(chars), "itos": list(chars),
                     "stoi": {c: i for i, c in enumerate(chars)}}, f)
    run_dir = fake_run(tmp_path / "run", folder, len(chars))
    code, out, err = run(capsys, run_dir, "--prompt", "abc", "--tokens", "20")
    assert code == 0 and out.startswith("abc") and set(out) <= set(chars), err


def test_a_file_torch_save_did_not_write_is_not_a_minddp_checkpoint(tmp_path, capsys):
    """`minddp sample README.md` passed on torch's advice to retry with weights_only=False (which
    would let a file run code): it says the file is not a minddp checkpoint (issue 50.6)."""
    from tests.conftest import ROOT

    code, out, err = run(capsys, ROOT / "README.md")
    assert code == 2 and out == "" and "Traceback" not in err, err
    assert f"minddp sample: error: {ROOT / 'README.md'} is not a minddp checkpoint" in err, err
    assert "weights_only" not in err and "Re-running" not in err, err


def test_a_damaged_checkpoint_never_passes_on_torchs_advice_to_load_it_unsafely(tmp_path, capsys):
    """A ckpt_<step>.pt of junk is a damaged checkpoint: named so, alone or beside an older one."""
    char_folder(tmp_path / "d")
    run_dir = fake_run(tmp_path / "run", tmp_path / "d", 10)
    junk = run_dir / "checkpoints" / "ckpt_00000002.pt"
    junk.write_bytes(b"\x80\x02" + os.urandom(3000))  # a pickle's start: torch's older format
    for target in (junk, run_dir):
        code, _, err = run(capsys, target, "--prompt", "a", "--tokens", "2")
        assert f"checkpoint {junk} is unreadable" in err and "weights_only" not in err, err
        assert code == (2 if target == junk else 0), err
