"""What a checkpoint holds of a training run, as one Stateful piece (torchtitan's shape:
`state_dict()` to save, `load_state_dict()` to restore): model, optimizer (replicated or ZeRO-1),
schedule position, data position and RNG, written at any dp/tp layout (sharded or not) and
loadable at any other. The run's identity (config, data, counters) is the manager's to add."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ...optim.zero_state import Piece
from ...parallel import tensor_parallel as tp
from .dcp_reader import SafeReader
from .errors import CheckpointError
from .folders import FOLDER
from .sharded import Shards


@dataclass
class RunState:
    """The run's training state. `lr_factor(step)`: this run's schedule (a resume keeps only the
    saved position, never the old optim.* settings)."""
    model: torch.nn.Module
    opt: object
    sched: object
    batches: object
    mesh: object
    device: torch.device
    lr_factor: object = None

    def state_dict(self, step: int, folder: bool) -> dict:
        """Every rank, at the same point. For a folder each rank's own tensors, placed in the whole
        ones (sharded.Shards: tp slices, ZeRO-1 parts), nothing gathered; for a file whole tensors
        (gathered over tp, a ZeRO-1 state over dp too), rank 0 writes them. Positions are global
        (samples seen), so any dp can resume."""
        model, opt, mesh = self.model, self.opt, self.mesh
        opt.wait_params()
        if folder:
            model_state, opt_state = own_model_state(model, mesh), own_optimizer_state(opt, mesh)
        else:
            model_state = tp.full_state_dict(model, mesh.tp_group, mesh.tp_size)
            opt_state = tp.full_optimizer_state(opt, model, mesh.tp_group, mesh.tp_size)
        epoch, pos = self.batches.position(step)
        return {"model": model_state, "optimizer": opt_state, "scheduler": self.sched.state_dict(),
                "step": step, "epoch": epoch, "position_in_epoch": pos,
                "samples_seen": self.batches.samples_seen(step),
                "rng": own_rng(self.device) if folder else gathered_rng(self.device)}

    def read_in_place(self, path, saved) -> int:
        """Every rank, a collective: a folder's tensors into this rank's model and optimizer, its
        parts only (`load_in_place`); the bytes read."""
        return load_in_place(path, saved, model=self.model, opt=self.opt, mesh=self.mesh)

    def load_state_dict(self, saved, path) -> int:
        """A loaded checkpoint into the model, optimizer, schedule and RNG; its step (0 without
        one). A state read in place (`read_in_place`) has its tensors already; one loaded whole (a
        file, a folder of 0.6) holds full tensors, so any layout resumes any other. This run's
        optim.* settings win over the saved ones."""
        if not saved:
            return 0
        mesh, inner = self.mesh, self.opt.optim
        settings = [{k: v for k, v in g.items() if k != "params"} for g in inner.param_groups]
        if not in_place(saved):
            try:
                tp.load_full_state_dict(self.model, saved["model"], mesh.tp_size, mesh.tp_rank)
            except (RuntimeError, KeyError) as e:
                raise CheckpointError(
                    f"checkpoint {path} was written by a different model: {str(e).splitlines()[0]} ... "
                    "Use the model config it was trained with, or train.resume=none") from None
            tp.load_full_optimizer_state(self.opt, saved["optimizer"], mesh.tp_size, mesh.tp_rank)
        for group, mine in zip(inner.param_groups, settings):
            group.update(mine)
        restore_schedule(self.opt, self.sched, self.lr_factor, saved["scheduler"]["last_epoch"])
        set_rng_state(saved["rng"][dist.get_rank() % len(saved["rng"])], self.device)
        return saved["step"]


def gathered_rng(device) -> list:
    """Every rank's RNG state, by rank (a collective): a file holds them all."""
    rng = [None] * dist.get_world_size()
    dist.all_gather_object(rng, rng_state(device))
    return rng


def own_rng(device) -> list:
    """Every rank's RNG state by rank, this rank's own and the others' as parts it does not hold
    (Piece without a tensor: a reference in state.pt, written by its rank): nothing gathered."""
    mine = rng_state(device)
    others = {k: Piece(tuple(v.shape), 0, None) for k, v in mine.items()}
    return [mine if r == dist.get_rank() else others for r in range(dist.get_world_size())]


def own_model_state(model, mesh) -> dict:
    """This rank's model tensors as Shards of the whole ones (its tp slices; the rest whole)."""
    specs = _specs(model)
    return {name: (Shards.of_param(t, specs.get(name), mesh.tp_size, mesh.tp_rank) if t.dim() else t)
            for name, t in model.state_dict().items()}


def own_optimizer_state(opt, mesh) -> dict:
    """The optimizer's state dict with this rank's tensors as Shards of its parameters' whole
    shape: a ZeRO-1 part (`sharded_state_dict`'s Pieces) or a replica's tp slice."""
    sharded = hasattr(opt, "sharded_state_dict")
    sd = opt.sharded_state_dict() if sharded else opt.state_dict()
    specs = tp.param_specs(opt)

    def own(v, idx):
        if isinstance(v, Piece):
            return v if v.tensor is None else Shards.of_flat_range(v.shape, v.lo, v.tensor, specs[idx],
                                                                   mesh.tp_size, mesh.tp_rank)
        if isinstance(v, torch.Tensor) and v.dim() > 0:
            return Shards.of_param(v, specs[idx], mesh.tp_size, mesh.tp_rank)
        return v
    state = {idx: {k: own(v, idx) for k, v in st.items()} for idx, st in sd["state"].items()}
    return {**sd, "state": state}


def _specs(model) -> dict:
    return {n: getattr(p, "tp_shard", None) for n, p in model.named_parameters(remove_duplicate=False)}


def in_place(saved) -> bool:
    """A state opened for an in-place load (FOLDER.open): its large tensors are meta tensors."""
    return bool(saved) and any(isinstance(v, torch.Tensor) and v.is_meta for v in saved["model"].values())


def load_in_place(path, saved, *, model, opt, mesh) -> int:
    """Every rank, a collective: model and optimizer tensors of the folder checkpoint `path`
    (`saved` opened by FOLDER.open) read into this rank's own tensors, in place, only the
    stored items they overlap (any dp, tp, ZeRO-1 or not at save). Nothing for a state loaded
    whole (a file, a folder of 0.6): load_model and load_training_state take those. Returns the
    bytes this rank read."""
    if not in_place(saved):
        return 0
    specs, targets = _specs(model), {}
    model_sd = model.state_dict()
    for name, t in model_sd.items():
        v = saved["model"].get(name)
        if isinstance(v, torch.Tensor) and v.is_meta:
            targets[f"model/{name}"] = Shards.of_param(t, specs.get(name), mesh.tp_size, mesh.tp_rank)
    opt_sd, finish = _optimizer_targets(opt, saved["optimizer"], mesh, targets, path)
    index = dist.get_rank() % len(saved["rng"])
    rng = saved["rng"][index]
    for k, v in rng.items():  # this rank's RNG state (a folder of 0.7 holds each rank's in DCP's files)
        if isinstance(v, torch.Tensor) and v.is_meta:
            rng[k] = targets[f"rng[{index}]/{k}"] = torch.empty(v.shape, dtype=v.dtype)
    read = FOLDER.load_into(path, targets)
    with torch.no_grad():
        for name, t in model_sd.items():  # the small ones (0-dim) came with state.pt
            v = saved["model"].get(name)
            if isinstance(v, torch.Tensor) and not v.is_meta:
                t.copy_(v)
    finish(opt_sd)
    return read


def _written_parts(path, state: dict, mesh) -> list[tuple[int, int, int]] | None:
    """(position, lo, numel) of the optimizer parts this rank wrote, where every writer of the
    checkpoint is a rank of this run and tp is 1: read whole, exactly as stored, and most likely
    the segments this rank steps once the engine rebuilds its buckets as the saving run did.
    None where that does not hold for every writer (decided from the index: alike on every
    rank); the parts are then cut as this rank's segments are now."""
    if mesh.tp_size != 1 or not state:
        return None
    index = SafeReader(path).read_metadata()
    world = dist.get_world_size()
    written: dict[int, dict[str, list]] = {}
    for i, info in index.storage_data.items():
        if i.fqn.startswith("optimizer/"):
            name = info.relative_path
            writer = int(name.split("_")[2]) if name.startswith("__") and name.count("_") >= 3 else world
            if writer >= world:
                return None
            written.setdefault(writer, {}).setdefault(i.fqn, []).append(tuple(i.offset))
    cuts = {}
    for writer, mine in written.items():
        cuts[writer] = []
        for pos, st in state.items():
            ranges = set()
            for key, v in st.items():
                if not (isinstance(v, torch.Tensor) and v.is_meta):
                    continue
                if v.dim() > 2:
                    return None
                fqn, cols = f"optimizer/state/{pos}/{key}", v.shape[-1] if v.dim() == 2 else 1
                chunks = index.state_dict_metadata[fqn].chunks
                sizes = {tuple(c.offsets): torch.Size(c.sizes).numel() for c in chunks}
                starts = {o: o[0] * cols + (o[1] if v.dim() == 2 else 0) for o in mine.get(fqn, ())}
                spans = sorted((starts[o], sizes[o]) for o in starts)
                if any(a + n != b for (a, n), (b, _) in zip(spans, spans[1:])):
                    return None
                ranges.add((spans[0][0], sum(n for _, n in spans)) if spans else None)
            if len(ranges) > 1:
                return None
            if ranges and (r := ranges.pop()) is not None:
                cuts[writer].append((pos, *r))
    return cuts.get(dist.get_rank(), [])


def _optimizer_targets(opt, saved: dict, mesh, targets: dict, path=None):
    """Buffers for this rank's part of every saved optimizer tensor, added to `targets`; the
    state dict they make and the function that hands it to the optimizer once read."""
    specs = tp.param_specs(opt)
    params = opt.original_params()
    state = saved["state"]
    if hasattr(opt, "own_parts"):  # ZeRO-1: the parts this rank wrote, else those it steps now
        parts = {}
        cuts = _written_parts(path, state, mesh)
        for pos, lo, n in (cuts if cuts is not None else opt.own_parts()):
            st, p = state.get(pos) or {}, params[pos]
            bufs = {}
            for key, v in st.items():
                if isinstance(v, torch.Tensor) and v.is_meta:
                    bufs[key] = torch.empty(n, dtype=v.dtype, device=p.device)
                    targets[f"optimizer/state/{pos}/{key}"] = Shards.of_flat_range(
                        p.shape, lo, bufs[key], specs[pos], mesh.tp_size, mesh.tp_rank)
            if bufs:
                parts[pos] = (lo, bufs)
        return parts, lambda parts: opt.load_own_state(parts, state, saved["param_groups"])
    sd_state = {}
    for pos, st in state.items():
        p, new = params[pos], {}
        for key, v in st.items():
            if isinstance(v, torch.Tensor) and v.is_meta:
                new[key] = torch.empty(p.shape, dtype=v.dtype, device=p.device)
                targets[f"optimizer/state/{pos}/{key}"] = Shards.of_param(new[key], specs[pos], mesh.tp_size,
                                                                          mesh.tp_rank)
            else:
                new[key] = v
        sd_state[pos] = new
    return {"state": sd_state, "param_groups": saved["param_groups"]}, opt.load_state_dict


def restore_schedule(opt, sched, lr_factor, position: int) -> None:
    """Only the position comes from the checkpoint; the schedule is this run's `lr_factor`
    (optim.* and max_steps: LambdaLR's saved state would bring back the old optim.lr)."""
    sched.last_epoch = position
    factor = lr_factor(position)
    for group, base in zip(opt.optim.param_groups, sched.base_lrs):
        group["lr"] = base * factor


def rng_state(device: torch.device) -> dict:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state, device: torch.device) -> None:
    if isinstance(state, torch.Tensor):  # checkpoints before CUDA states were saved
        state = {"cpu": state}
    torch.set_rng_state(state["cpu"].cpu())
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)
