"""GPT-2 in Hugging Face's layout both ways (minddp/model/hf_gpt2.py) and model.init_from's
checks of a folder (hf_gpt2.init_from_problems), against `transformers` itself: a small GPT-2
made and saved here (no Hub), loaded with GPT2LMHeadModel.from_pretrained."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from minddp.errors import ConfigError
from minddp.model import hf_gpt2
from minddp.model.gpt import GPT, GPTConfig
from minddp.train.config import register, validate
from tests import hf_models
from tests.conftest import compose_config

register()  # the schema and the minddp.init_from resolver, as train.py has them

def minddp_gpt(folder) -> GPT:
    """The GPT a save_pretrained folder describes, with its weights (what model.init_from builds)."""
    arch = hf_gpt2.architecture(hf_gpt2.read_config(folder))
    model = GPT(GPTConfig(**arch)).eval()
    model.load_state_dict(hf_gpt2.from_hf(hf_gpt2.read_weights(folder), arch["n_layer"], arch["block_size"]))
    return model


def export(model: GPT, folder, **cfg):
    folder.mkdir()
    c = model.cfg
    sizes = {"name": "gpt", "n_layer": c.n_layer, "n_head": c.n_head, "activation": c.activation, **cfg}
    hf_gpt2.write(folder, *hf_gpt2.to_hf(model.state_dict(), sizes))
    return hf_models.load(folder)


@pytest.mark.parametrize("activation,hf_name", [("gelu", "gelu"), ("gelu_tanh", "gelu_new")])
@pytest.mark.parametrize("bias", [True, False])
def test_an_export_loads_in_transformers_with_minddps_logits(tmp_path, activation, hf_name, bias):
    torch.manual_seed(0)
    ours = GPT(GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=4, n_embd=32, bias=bias,
                         activation=activation)).eval()
    theirs = export(ours, tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["model_type"] == "gpt2" and config["activation_function"] == hf_name
    sizes = ("n_layer", "n_head", "n_embd", "n_positions", "vocab_size")
    assert [config[k] for k in sizes] == [2, 4, 32, 32, 64]
    assert config["tie_word_embeddings"]
    assert "lm_head.weight" not in load_file(tmp_path / "out" / "model.safetensors")  # as save_pretrained
    ids = hf_models.ids(length=32)
    assert (hf_models.logits(ours, ids) - hf_models.logits(theirs, ids)).abs().max() < hf_models.TOLERANCE
    assert theirs.lm_head.weight.data_ptr() == theirs.transformer.wte.weight.data_ptr()  # tied, as GPT-2


@pytest.mark.parametrize("activation", ["gelu_new", "gelu", "gelu_pytorch_tanh"])
def test_a_save_pretrained_gpt2_computes_the_same_in_minddp(tmp_path, activation):
    theirs = hf_models.saved(tmp_path / "gpt2", activation_function=activation)
    ours = minddp_gpt(tmp_path / "gpt2")
    assert ours.cfg.activation == ("gelu" if activation == "gelu" else "gelu_tanh")
    ids = hf_models.ids()
    assert (hf_models.logits(ours, ids) - hf_models.logits(theirs, ids)).abs().max() < hf_models.TOLERANCE


def test_the_wrong_gelu_is_more_than_rounding(tmp_path):
    """Why model.activation exists: GPT-2's weights under the exact GELU give other logits (the
    MLP's inputs made wider, where the two GELUs part most: |x| of 1 to 4)."""
    theirs = hf_models.gpt2()
    with torch.no_grad():
        for block in theirs.transformer.h:
            block.mlp.c_fc.weight.mul_(3)
    theirs.save_pretrained(tmp_path / "gpt2")
    ours = minddp_gpt(tmp_path / "gpt2")
    for block in ours.blocks:
        block.approximate = "none"
    wrong = hf_models.logits(ours, hf_models.ids()) - hf_models.logits(theirs, hf_models.ids())
    assert wrong.abs().max() > 10 * hf_models.TOLERANCE  # 3.0e-4 here; 2.4e-7 with gelu_tanh


def test_round_trip_hf_minddp_hf_gives_back_the_same_logits(tmp_path):
    first = hf_models.saved(tmp_path / "gpt2")
    back = export(minddp_gpt(tmp_path / "gpt2"), tmp_path / "back")
    ids = hf_models.ids()
    assert torch.equal(hf_models.logits(first, ids), hf_models.logits(back, ids))
    assert back.config.activation_function == "gelu_new"


def test_the_hubs_older_layout_reads_too(tmp_path):
    """The Hub's gpt2 file: names without `transformer.`, the attention mask saved as attn.bias."""
    theirs = hf_models.saved(tmp_path / "gpt2")
    tensors = load_file(tmp_path / "gpt2" / "model.safetensors")
    old = {k.removeprefix("transformer."): v for k, v in tensors.items()}
    old["h.0.attn.bias"] = torch.tril(torch.ones(1, 1, 32, 32))
    save_file(old, tmp_path / "gpt2" / "model.safetensors", metadata={"format": "pt"})
    ids = hf_models.ids()
    assert (hf_models.logits(minddp_gpt(tmp_path / "gpt2"), ids)
            - hf_models.logits(theirs, ids)).abs().max() < hf_models.TOLERANCE


def test_a_cut_position_table_keeps_the_logits_of_short_sequences(tmp_path):
    theirs = hf_models.saved(tmp_path / "gpt2")
    tensors = hf_gpt2.read_weights(tmp_path / "gpt2")
    ours = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32,
                         activation="gelu_tanh")).eval()
    ours.load_state_dict(hf_gpt2.from_hf(tensors, 2, 16))
    ids = hf_models.ids(length=16)
    assert (hf_models.logits(ours, ids) - hf_models.logits(theirs, ids)).abs().max() < hf_models.TOLERANCE


# ---------------------------------------------------------------- folders that cannot be used
def _config(folder, **changes):
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


@pytest.mark.parametrize("changes,message", [
    ({"n_inner": 100}, "n_inner=100"),
    ({"layer_norm_epsilon": 1e-6}, "layer_norm_epsilon=1e-06"),
    ({"activation_function": "relu"}, "activation_function='relu'"),
    ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx=True"),
    ({"model_type": "llama"}, "holds a 'llama' model"),
])
def test_a_folder_minddps_gpt_cannot_compute_is_one_line(tmp_path, changes, message):
    hf_models.saved(tmp_path / "gpt2")
    _config(tmp_path / "gpt2", **changes)
    [line] = hf_gpt2.init_from_problems(compose_config(f"model.init_from={tmp_path / 'gpt2'}").model)
    assert message in line and "\n" not in line


def test_a_missing_folder_or_config_is_one_line(tmp_path):
    [line] = hf_gpt2.init_from_problems(compose_config(f"model.init_from={tmp_path / 'x'}").model)
    assert "is not a folder" in line
    (tmp_path / "empty").mkdir()
    [line] = hf_gpt2.init_from_problems(compose_config(f"model.init_from={tmp_path / 'empty'}").model)
    assert "has no config.json" in line and "save_pretrained" in line


@pytest.mark.parametrize("breakage,message", [
    ("no weights", "has no model.safetensors"),
    ("untied head", "lm_head is not tied"),
    ("one layer more", "h.2.attn.c_attn.bias"),
    ("one layer less", "has no tensor h.1"),
])
def test_weights_that_do_not_fit_their_config_are_refused(tmp_path, breakage, message):
    folder = tmp_path / "gpt2"
    hf_models.saved(folder)
    tensors = load_file(folder / "model.safetensors")
    if breakage == "no weights":
        (folder / "model.safetensors").unlink()
    else:
        if breakage == "untied head":
            tensors["lm_head.weight"] = tensors["transformer.wte.weight"] + 1
        elif breakage == "one layer more":
            tensors.update({k.replace("h.1.", "h.2."): v.clone() for k, v in tensors.items() if ".h.1." in k})
        else:
            tensors = {k: v for k, v in tensors.items() if ".h.1." not in k}
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=message):
        hf_gpt2.from_hf(hf_gpt2.read_weights(folder), 2, 32)


# ---------------------------------------------------------------- the sizes: from the folder
def test_the_sizes_default_to_the_folders(tmp_path):
    hf_models.saved(tmp_path / "gpt2", activation_function="gelu_new")
    m = compose_config(f"model.init_from={tmp_path / 'gpt2'}").model
    assert (m.n_layer, m.n_head, m.n_embd, m.block_size, m.vocab_size, m.bias, m.activation) == \
        (2, 4, 32, 32, 64, True, "gelu_tanh")
    assert hf_gpt2.init_from_problems(m) == []
    plain = compose_config().model  # without init_from: minddp's own defaults, unchanged
    assert (plain.n_layer, plain.n_embd, plain.block_size, plain.vocab_size, plain.activation) == \
        (4, 128, 128, None, "gelu")


def test_a_size_set_on_the_command_line_must_be_the_folders(tmp_path):
    hf_models.saved(tmp_path / "gpt2")
    cfg = compose_config(f"model.init_from={tmp_path / 'gpt2'}", "model.n_layer=4", "model.activation=gelu",
                         "data=synthetic")
    with pytest.raises(ConfigError) as e:
        validate(cfg, 1)
    line = str(e.value)
    assert "n_layer=2" in line and "model.n_layer=4 model.activation=gelu" in line and "drop those" in line
    same = compose_config(f"model.init_from={tmp_path / 'gpt2'}", "model.n_layer=2", "model.block_size=16",
                          "data=synthetic")
    validate(same, 1)  # the folder's own value, and a shorter block: accepted


def test_a_block_longer_than_the_folders_positions_is_refused(tmp_path):
    hf_models.saved(tmp_path / "gpt2")
    cfg = compose_config(f"model.init_from={tmp_path / 'gpt2'}", "model.block_size=64", "data=synthetic")
    with pytest.raises(ConfigError, match=r"32 positions .* set model.block_size <= 32"):
        validate(cfg, 1)


def test_init_from_is_a_setting_of_the_gpt_only():
    with pytest.raises(Exception, match="init_from"):
        compose_config("model=mlp", "model.init_from=/x")


# ---------------------------------------------------------------- issue 56.4: malformed folders
@pytest.mark.parametrize("value", [None, "abc", 32.5, [32], True, 0])
def test_a_size_in_config_json_that_is_not_a_positive_integer_is_one_line(tmp_path, value):
    """It reached the typed schema through the resolver: a Hydra traceback, exit 1."""
    hf_models.saved(tmp_path / "gpt2")
    _config(tmp_path / "gpt2", n_embd=value)
    cfg = compose_config(f"model.init_from={tmp_path / 'gpt2'}", "data=synthetic")
    with pytest.raises(ConfigError) as e:
        validate(cfg, 1)
    assert f"n_embd={value!r} (sizes are positive integers)" in str(e.value) and "\n" not in str(e.value)


def test_an_activation_that_is_not_a_name_is_one_line(tmp_path):
    hf_models.saved(tmp_path / "gpt2")
    _config(tmp_path / "gpt2", activation_function=["gelu"])
    [line] = hf_gpt2.init_from_problems(compose_config(f"model.init_from={tmp_path / 'gpt2'}").model)
    assert "activation_function=['gelu'] (a name)" in line


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", ["fifo", "/dev/zero", "folder", "too large"])
def test_a_config_json_that_is_not_a_small_regular_file_is_one_line(tmp_path, kind):
    """A FIFO blocked start-up in open(); a link to /dev/zero read until memory ran out."""
    import os

    folder = tmp_path / "gpt2"
    hf_models.saved(folder)
    config = folder / "config.json"
    if kind == "too large":
        config.write_text(json.dumps({**json.loads(config.read_text()), "pad": "x" * (2 << 20)}))
    else:
        config.unlink()
        {"fifo": lambda: os.mkfifo(config), "/dev/zero": lambda: config.symlink_to("/dev/zero"),
         "folder": config.mkdir}[kind]()
    [line] = hf_gpt2.init_from_problems(compose_config(f"model.init_from={folder}").model)
    assert "config.json cannot be read (" in line, line
    assert ("larger than 1024 KiB" if kind == "too large" else "not a regular file") in line


def _weights(folder, **changes):
    tensors = load_file(folder / "model.safetensors")
    for name, change in changes.items():
        tensors[f"transformer.{name}"] = change(tensors[f"transformer.{name}"])
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("name,change,message", [
    ("wpe.weight", lambda t: t[0, 0].clone(), r"wpe.weight has shape \(\), not 2-dimensional"),
    ("h.0.ln_1.bias", lambda t: t[None].clone(), r"h.0.ln_1.bias has shape \(1, 32\), not 1-dimensional"),
    ("h.1.mlp.c_fc.weight", lambda t: t.index_fill(0, torch.tensor([3]), torch.nan), "holds NaN or infinite"),
    ("wte.weight", lambda t: t * float("inf"), "holds NaN or infinite"),
    ("wte.weight", lambda t: t.long(), "is int64, not floating point"),
    ("ln_f.weight", lambda t: t > 0, "is bool, not floating point"),
])
def test_weights_that_are_not_a_models_are_refused(tmp_path, name, change, message):
    """0-dim: an IndexError; NaN: blamed on an update before step 1; int64/bool: cast silently."""
    folder = tmp_path / "gpt2"
    hf_models.saved(folder)
    _weights(folder, **{name: change})
    with pytest.raises(ConfigError, match=message) as e:
        hf_gpt2.from_hf(hf_gpt2.read_weights(folder), 2, 32, where="model.init_from=x")
    assert str(e.value).startswith(f"model.init_from=x: its tensor {name} ") and "\n" not in str(e.value)


# ---------------------------------------------------------------- issue 56.5: the data's vocabulary
def test_a_gpt2_of_another_vocabulary_is_refused_on_byte_data(tmp_path):
    """A GPT-2 vocabulary (50257) fine-tuned on byte ids as if they were BPE ids."""
    from minddp.train.data import load_data

    cfg = compose_config("data=text", "data.max_bytes=4096")
    for vocab in (50_257, 64):
        with pytest.raises(ConfigError) as e:
            load_data(cfg.data, 16, vocab, init_from="/m/gpt2")
        line = str(e.value)
        assert line.startswith(f"model.init_from=/m/gpt2 has a vocabulary of {vocab}, but data=text's "
                               "ids are bytes (a vocabulary of 256): train it on data in its own tokens: ")
        assert "drop model.vocab_size" not in line
    assert "GPT-2's tokenizer" in load_data_error(cfg, 50_257)
    assert load_data(cfg.data, 16, 256, init_from="/m/bytes")[2].vocab_size == 256  # a byte model fits


def load_data_error(cfg, vocab) -> str:
    from minddp.train.data import load_data

    with pytest.raises(ConfigError) as e:
        load_data(cfg.data, 16, vocab, init_from="/m/gpt2")
    return str(e.value)


def test_token_data_of_another_vocabulary_names_init_from_not_model_vocab_size(tmp_path):
    import pickle

    import numpy as np

    from minddp.train.data import load_data

    data = tmp_path / "data"
    data.mkdir()
    for split in ("train", "val"):
        np.arange(300, dtype=np.uint16).tofile(data / f"{split}.bin")
    cfg = compose_config("data=tokens", f"data.dir={data}")
    with pytest.raises(ConfigError, match="ids < 64") as e:  # no meta.pkl: the ids' range decides
        load_data(cfg.data, 16, 64, init_from="/m/gpt2")
    assert "the data is not in the tokens of model.init_from=/m/gpt2" in str(e.value), e.value
    assert "set model.vocab_size" not in str(e.value)
    (data / "meta.pkl").write_bytes(pickle.dumps({"vocab_size": 300}))
    line = load_data_error(cfg, 50_257)
    assert line.startswith("model.init_from=/m/gpt2 has a vocabulary of 50257, but "), line
    assert "says the data's is 300" in line and "drop model.vocab_size" not in line, line


def test_a_shard_index_naming_a_file_outside_the_folder_is_one_line(tmp_path):
    folder = tmp_path / "gpt2"
    hf_models.saved(folder)
    (folder / "model.safetensors").rename(folder / "model-00001-of-00001.safetensors")
    names = load_file(folder / "model-00001-of-00001.safetensors")
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {**{k: "model-00001-of-00001.safetensors" for k in names}, "x": "/dev/zero"}}))
    with pytest.raises(ConfigError, match="names '/dev/zero', not a file in the folder"):
        hf_gpt2.read_weights(folder)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    del index["weight_map"]["x"]
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    assert set(hf_gpt2.read_weights(folder)) == set(names)  # the sharded layout itself reads
