"""model.init_from=<folder>: a fresh run starts from a GPT-2's weights (fine-tuning), read from a
Hugging Face save_pretrained folder (config.json + model.safetensors; minddp/model/hf_gpt2.py
converts).

The architecture comes from the folder, as nanoGPT's init_from=gpt2 takes it from the
checkpoint: conf/model/gpt.yaml's sizes (n_layer, n_head, n_embd, block_size, vocab_size, bias,
activation) default to the folder's config.json through the `minddp.init_from` resolver, so
`model.init_from=path/to/gpt2` alone builds that GPT-2. A size set on the command line is
checked against the folder (`hf_gpt2.init_from_problems`): the same value, or one line naming
the fix. block_size may be smaller than the folder's n_positions: the position table is cut
(nanoGPT's crop_block_size). model.dropout stays this run's. A resumed run takes its checkpoint
instead. Every rank reads the folder itself (a shared filesystem, as for the data) and takes its
tp part (`load_agreed`, here).
"""

from __future__ import annotations

import logging

import torch

from ..model import hf_gpt2
from ..model.build import build_model
from ..parallel import tensor_parallel as tp
from .data.tokens import init_from_fix
from .safety.together import together

log = logging.getLogger("minddp")


def load_agreed(model, m, vocab_size: int, mesh) -> None:
    """The folder's weights into this rank's model (its tp part), on every rank; a folder that
    one rank cannot use stops every rank with one line."""
    error = None
    try:
        _load(model, m, vocab_size, mesh)
    except Exception as e:  # noqa: BLE001 - raised on every rank by together
        error = e
    together(error)
    activation = hf_gpt2.folder_config(m.init_from).get("activation_function", "gelu_new")
    log.info(f"model.init_from: the weights of {m.init_from} ({m.n_layer} layers, activation_function "
             f"{activation} = model.activation={m.activation}, block_size {m.block_size})")


def _load(model, m, vocab_size: int, mesh) -> None:
    path = m.init_from
    where = f"model.init_from={path}"
    full = hf_gpt2.from_hf(hf_gpt2.read_weights(path), m.n_layer, m.block_size, where=where)
    with torch.device("meta"):  # this run's full (unsplit) shapes, without memory
        shapes = {k: v.shape for k, v in build_model(m, vocab_size).state_dict().items()}
    if full["tok_emb.weight"].shape[0] != vocab_size:
        raise hf_gpt2.HFError(
            f"model.init_from={path} has a vocabulary of {full['tok_emb.weight'].shape[0]}, this run's data "
            f"{vocab_size}: {init_from_fix(full['tok_emb.weight'].shape[0])}")
    for name, shape in shapes.items():
        if full[name].shape != shape:
            raise hf_gpt2.HFError(f"model.init_from={path}: its {name} has shape {tuple(full[name].shape)}, "
                                  f"this run's model {tuple(shape)}: its weights do not match its "
                                  "config.json")
    tp.load_full_state_dict(model, full, mesh.tp_size, mesh.tp_rank)
