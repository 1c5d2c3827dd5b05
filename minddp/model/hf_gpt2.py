"""GPT-2 in Hugging Face's layout, both ways: minddp's GPT is GPT-2's architecture under other
names. `transformers` reads a folder holding config.json + model.safetensors (save_pretrained's
layout); it is read and written here with `safetensors` alone (transformers is not needed).

    minddp                       transformers (GPT2LMHeadModel)
    tok_emb, pos_emb             transformer.wte, transformer.wpe
    blocks.<i>.ln1, ln2          transformer.h.<i>.ln_1, ln_2
    blocks.<i>.attn.qkv, proj    transformer.h.<i>.attn.c_attn, c_proj   Conv1D: weight transposed
    blocks.<i>.fc, fc_proj       transformer.h.<i>.mlp.c_fc, c_proj      Conv1D: weight transposed
    ln_f                         transformer.ln_f
    head (tied to tok_emb)       lm_head (tied to wte: not in the file, as save_pretrained writes it)

GELU: model.activation=gelu is torch's exact GELU (config.json "gelu"); gelu_tanh is its tanh
approximation, GPT-2's own ("gelu_new"; gelu_pytorch_tanh and gelu_fast are read as it too).
A model without biases (model.bias=false) is written with zero biases: the same function.

model.init_from=<folder>: the model's sizes default to the folder's (`folder_default`, the
`minddp.init_from` resolver) and are checked against it before anything is built
(`init_from_problems`); the trainer reads the weights in (minddp/train/init_from.py).
"""

from __future__ import annotations

import functools
import json
import os
import stat
from pathlib import Path

import torch

from ..errors import ConfigError
from ..io.atomic import umask

TO_HF_ACTIVATION = {"gelu": "gelu", "gelu_tanh": "gelu_new"}
FROM_HF_ACTIVATION = {"gelu": "gelu", "gelu_python": "gelu", "gelu_new": "gelu_tanh",
                      "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh"}
LAYER_NORM_EPS = 1e-5  # torch's nn.LayerNorm default, minddp's, GPT-2's
GPT2_VOCABS = (50_257, 50_304)  # GPT-2's tokenizer (and nanoGPT's padding of it): <|endoftext|> is 50256
CONFIG, WEIGHTS, WEIGHTS_INDEX, TORCH_WEIGHTS = ("config.json", "model.safetensors",
                                                 "model.safetensors.index.json", "pytorch_model.bin")
_BLOCK = {"ln1": "ln_1", "ln2": "ln_2", "attn.qkv": "attn.c_attn", "attn.proj": "attn.c_proj",
          "fc": "mlp.c_fc", "fc_proj": "mlp.c_proj"}  # minddp's block module -> GPT-2's
_CONV1D = ("attn.qkv", "attn.proj", "fc", "fc_proj")  # stored (in, out) by GPT-2, (out, in) by nn.Linear
_SIZES = ("n_layer", "n_head", "n_embd", "n_positions", "vocab_size")  # config.json's, positive integers
CONFIG_MAX_BYTES = 1 << 20  # a GPT-2's config.json is about 1 KiB
_BUFFERS = (".attn.bias", ".attn.masked_bias")  # the causal mask older transformers saved: not weights


class HFError(ConfigError):
    """A Hugging Face folder or a checkpoint that cannot be converted: one line naming the fix."""


# ------------------------------------------------------------------- names
def _pairs(n_layer: int) -> list[tuple[str, str, bool]]:
    """(minddp module, GPT-2 module without the `transformer.` prefix, transposed?) of every
    module with a weight and a bias (the embeddings: a weight only)."""
    pairs = [("tok_emb", "wte", False), ("pos_emb", "wpe", False)]
    for i in range(n_layer):
        pairs += [(f"blocks.{i}.{m}", f"h.{i}.{g}", m in _CONV1D) for m, g in _BLOCK.items()]
    return pairs + [("ln_f", "ln_f", False)]


# --------------------------------------------------------- minddp -> Hugging Face
def to_hf(weights: dict, model_cfg: dict) -> tuple[dict, dict]:
    """(safetensors' tensors, config.json's dict) of a GPT's full state dict and its model config."""
    if model_cfg.get("name", "gpt") != "gpt" or "tok_emb.weight" not in weights:
        raise HFError(f"model={model_cfg.get('name')} is not GPT-shaped: only model=gpt exports to "
                      "transformers' GPT-2 (for one torch.save file of any checkpoint: python -m "
                      "torch.distributed.checkpoint.format_utils dcp_to_torch CKPT_FOLDER OUT.pt)")
    vocab, n_embd = weights["tok_emb.weight"].shape
    n_layer = model_cfg["n_layer"]
    tensors = {}
    for ours, theirs, transposed in _pairs(n_layer):
        weight = weights[f"{ours}.weight"]
        tensors[f"transformer.{theirs}.weight"] = (weight.t() if transposed else weight).float().contiguous()
        if ours not in ("tok_emb", "pos_emb"):  # no bias (model.bias=false) is a zero bias
            bias = weights.get(f"{ours}.bias")
            bias = torch.zeros(weight.shape[0]) if bias is None else bias.float()
            tensors[f"transformer.{theirs}.bias"] = bias.contiguous()
    activation = str(model_cfg.get("activation", "gelu"))  # a config before model.activation: gelu
    dropout = float(model_cfg.get("dropout", 0.0))
    special = 50_256 if vocab in GPT2_VOCABS else None
    config = {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": vocab, "n_positions": weights["pos_emb.weight"].shape[0], "n_embd": n_embd,
        "n_layer": n_layer, "n_head": model_cfg["n_head"], "n_inner": None,
        "activation_function": TO_HF_ACTIVATION[activation],
        "resid_pdrop": dropout, "embd_pdrop": dropout, "attn_pdrop": dropout,
        "layer_norm_epsilon": LAYER_NORM_EPS, "initializer_range": 0.02,
        "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False, "tie_word_embeddings": True, "use_cache": True,
        "bos_token_id": special, "eos_token_id": special, "dtype": "float32",
    }
    return tensors, config


def write(folder: Path, tensors: dict, config: dict) -> None:
    """config.json and model.safetensors into `folder` (which exists)."""
    from safetensors.torch import save_file

    (folder / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, str(folder / WEIGHTS), metadata={"format": "pt"})
    os.chmod(folder / WEIGHTS, 0o666 & ~umask())  # safetensors makes it 0600: readable as config.json is


# --------------------------------------------------------- Hugging Face -> minddp
def read_config(folder) -> dict:
    """A save_pretrained folder's config.json; HFError naming what is missing or malformed."""
    folder = Path(folder)
    if not folder.is_dir():
        raise HFError(f"{folder} is not a folder: give a save_pretrained folder of a GPT-2 "
                      f"({CONFIG} + {WEIGHTS})")
    file = folder / CONFIG
    if not file.exists():
        raise HFError(f"{folder} has no {CONFIG}: give a save_pretrained folder of a GPT-2 "
                      f"({CONFIG} + {WEIGHTS})")
    try:
        config = json.loads(_read_small(file))
    except (ValueError, OSError) as e:
        raise HFError(f"{file} cannot be read ({e}): download the model again") from None
    if not isinstance(config, dict) or config.get("model_type") != "gpt2":
        kind = config.get("model_type") if isinstance(config, dict) else None
        raise HFError(f"{folder} holds a {kind!r} model ({CONFIG}'s model_type), not GPT-2: minddp's GPT "
                      "is GPT-2's architecture; give a GPT-2 folder (model_type gpt2)")
    if bad := _malformed(config):
        raise HFError(f"{file} has {', '.join(bad)}: not a GPT-2's config.json; download the model again")
    return config


def _read_small(file: Path, limit: int = CONFIG_MAX_BYTES) -> bytes:
    """A regular file's bytes, at most `limit`: a FIFO would block the open, a link to /dev/zero
    would read until memory runs out."""
    if not stat.S_ISREG(file.stat().st_mode):
        raise OSError("not a regular file")
    with open(file, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise OSError(f"larger than {limit // 1024} KiB")
    return data


def _malformed(config: dict) -> list[str]:
    """config.json's values of a type that would be a traceback later (a size that is not a
    positive integer cannot build the model; an activation that is not a name cannot be looked up)."""
    bad = [f"{k}={config[k]!r}" for k in _SIZES if k in config and not _positive_int(config[k])]
    if bad:
        bad = [f"{', '.join(bad)} (sizes are positive integers)"]
    if not isinstance(config.get("activation_function", ""), str):
        bad.append(f"activation_function={config['activation_function']!r} (a name)")
    return bad


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def unsupported(config: dict) -> list[str]:
    """What a GPT-2 config.json asks for that minddp's GPT does not compute."""
    n_embd, problems = config.get("n_embd", 768), []
    if config.get("activation_function", "gelu_new") not in FROM_HF_ACTIVATION:
        problems.append(f"activation_function={config['activation_function']!r} (minddp's GPT computes "
                        f"{', '.join(FROM_HF_ACTIVATION)})")
    if config.get("n_inner") not in (None, 4 * n_embd):
        problems.append(f"n_inner={config['n_inner']} (minddp's MLP is 4 x n_embd = {4 * n_embd} wide)")
    if config.get("layer_norm_epsilon", LAYER_NORM_EPS) != LAYER_NORM_EPS:
        problems.append(f"layer_norm_epsilon={config['layer_norm_epsilon']} (minddp's is {LAYER_NORM_EPS})")
    for key, wanted in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                        ("add_cross_attention", False)):
        if config.get(key, wanted) != wanted:
            problems.append(f"{key}={config[key]} (minddp's attention: {key}={wanted})")
    return problems


def architecture(config: dict) -> dict:
    """The model.* settings of the GPT a GPT-2 config.json describes (block_size: its n_positions)."""
    return {"n_layer": config.get("n_layer", 12), "n_head": config.get("n_head", 12),
            "n_embd": config.get("n_embd", 768), "block_size": config.get("n_positions", 1024),
            "vocab_size": config.get("vocab_size", 50_257), "bias": True,
            "activation": FROM_HF_ACTIVATION.get(config.get("activation_function", "gelu_new"), "gelu")}


# --------------------------------------------------- model.init_from's folder, before a build
CHECKED = ("n_layer", "n_head", "n_embd", "vocab_size", "bias", "activation")  # must equal the folder's


def folder_default(path, key: str, fallback):
    """The `minddp.init_from` resolver: the folder's value of model.<key>, or `fallback` without
    a folder. Never raises: a folder that cannot be used is refused by `init_from_problems`, naming
    why."""
    if not path:
        return fallback
    try:
        return architecture(folder_config(path))[key]
    except ConfigError:
        return fallback


def folder_config(path) -> dict:
    """read_config, once per version of the file (the resolver runs at every access of a size)."""
    file = Path(path) / CONFIG
    return _read(str(path), file.stat().st_mtime_ns if file.is_file() else None)


@functools.lru_cache(maxsize=8)
def _read(path: str, _mtime_ns) -> dict:
    return read_config(path)


def init_from_problems(m) -> list[str]:
    """One line (at most) on a model config whose init_from folder cannot be used or does not
    fit the sizes this run sets. No process group: the trainer agrees on it across ranks."""
    path = m.get("init_from") if m.name == "gpt" else None
    if not path:
        return []
    where = f"model.init_from={path}"
    try:
        config = folder_config(path)
    except ConfigError as e:
        return [f"{where}: {e}"]
    if bad := unsupported(config):
        return [f"{where} is a GPT-2 minddp's GPT cannot compute: {'; '.join(bad)}"]
    arch = architecture(config)
    differ = [k for k in CHECKED if m[k] is not None and str(m[k]) != str(arch[k])]
    if differ:
        theirs = ", ".join(f"{k}={arch[k]}" for k in CHECKED)
        ours = " ".join(f"model.{k}={m[k]}" for k in differ)
        return [f"{where} is a GPT-2 with {theirs} (its config.json), but this run sets {ours}: drop "
                f"{'that setting' if len(differ) == 1 else 'those settings'} (with init_from the model's "
                "sizes are the folder's) or start from another folder"]
    if m.block_size > arch["block_size"]:
        return [f"{where} has {arch['block_size']} positions (config.json's n_positions), fewer than "
                f"model.block_size={m.block_size}: set model.block_size <= {arch['block_size']}"]
    return []


def read_weights(folder) -> dict:
    """Every tensor of a save_pretrained folder: model.safetensors, its shards
    (model.safetensors.index.json) or an older pytorch_model.bin (read weights_only)."""
    from safetensors.torch import load_file

    folder = Path(folder)
    try:
        if (folder / WEIGHTS).is_file():
            return load_file(str(folder / WEIGHTS))
        if (folder / WEIGHTS_INDEX).is_file():
            shards = sorted(set(json.loads(_read_small(folder / WEIGHTS_INDEX))["weight_map"].values()))
            outside = [s for s in shards if Path(s).name != s or not (folder / s).is_file()]
            if outside:  # a shard is a regular file beside the index, never a path elsewhere
                raise OSError(f"{WEIGHTS_INDEX} names {outside[0]!r}, not a file in the folder")
            return {k: v for shard in shards for k, v in load_file(str(folder / shard)).items()}
        if (folder / TORCH_WEIGHTS).is_file():
            return torch.load(folder / TORCH_WEIGHTS, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - I/O, JSON, torch's and safetensors' own (SafetensorError)
        raise HFError(f"the weights in {folder} cannot be read ({type(e).__name__}: {str(e)[:160]}): "
                      "download the model again") from None
    raise HFError(f"{folder} has no {WEIGHTS} (nor {WEIGHTS_INDEX} or {TORCH_WEIGHTS}): give a "
                  "save_pretrained folder of a GPT-2")


def from_hf(tensors: dict, n_layer: int, block_size: int, where="the folder") -> dict:
    """minddp's full GPT state dict of a GPT-2's tensors (with or without the `transformer.`
    prefix), its position table cut to block_size (nanoGPT's crop_block_size)."""
    named = {k.removeprefix("transformer."): v for k, v in tensors.items()}
    lm_head = named.pop("lm_head.weight", None)
    out = {}
    for ours, theirs, transposed in _pairs(n_layer):
        for kind in ("weight", "bias") if ours not in ("tok_emb", "pos_emb") else ("weight",):
            t = named.pop(f"{theirs}.{kind}", None)
            if t is None:
                raise HFError(f"{where} has no tensor {theirs}.{kind}: not a GPT-2 of {n_layer} layers")
            matrix = kind == "weight" and not theirs.rsplit(".", 1)[-1].startswith("ln_")  # LayerNorm: 1-D
            _check_tensor(t, f"{theirs}.{kind}", 2 if matrix else 1, where)
            out[f"{ours}.{kind}"] = t.t() if transposed and kind == "weight" else t
    extra = [k for k in named if not k.endswith(_BUFFERS)]
    if extra:
        names = ", ".join(sorted(extra)[:3]) + (", ..." if len(extra) > 3 else "")
        raise HFError(f"{where} has tensors a GPT-2 of {n_layer} layers does not ({names}): its "
                      "config.json's n_layer is not its weights'")
    if lm_head is not None and not torch.equal(lm_head, out["tok_emb.weight"]):
        raise HFError(f"{where}'s lm_head is not tied to its wte: minddp's GPT ties the output "
                      "layer to the embedding (as GPT-2 does); this model cannot be started from")
    out["pos_emb.weight"] = out["pos_emb.weight"][:block_size]
    out["head.weight"] = out["tok_emb.weight"]  # tied
    return out


def _check_tensor(t: torch.Tensor, name: str, ndim: int, where) -> None:
    """A weight the GPT can take as it is: floating point (an integer or bool tensor would be
    cast silently), of its rank (a 0-dimensional one is an IndexError later), finite (a NaN
    would surface as a diverged first step)."""
    if not t.dtype.is_floating_point:
        dtype = str(t.dtype).removeprefix("torch.")
        raise HFError(f"{where}: its tensor {name} is {dtype}, not floating point: these are not a model's "
                      "weights; download the model again")
    if t.dim() != ndim:
        raise HFError(f"{where}: its tensor {name} has shape {tuple(t.shape)}, not {ndim}-dimensional: "
                      "not a GPT-2's weights; download the model again")
    if not torch.isfinite(t).all():
        raise HFError(f"{where}: its tensor {name} holds NaN or infinite values: these weights cannot be "
                      "trained from; download the model again (or export it from a run that did not diverge)")
