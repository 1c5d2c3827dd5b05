"""ZeRO stage 1: optimizer states sharded over the data-parallel ranks (`ShardedOptimizer`).

It keeps minddp.optim's protocol (step, zero_grad, grad_norm, clip_grad_norm_, wait_params,
state_dict/load_state_dict, `.optim` for schedulers) and plugs into the engine through its
declared callbacks (`ddp.on_rebuild`), never by setting its attributes.

    ddp = minddp.DDP(model, shard_optimizer=True)
    opt = minddp.ShardedOptimizer(ddp, torch.optim.AdamW, param_groups, lr=1e-3, fused=True)
    loss.backward()        # each bucket is reduce-scattered from the backward hooks (overlap)
    opt.clip_grad_norm_(1.0)
    opt.step()             # the inner optimizer steps this rank's shard; then all-gather
    opt.zero_grad()

All-Reduce = Reduce-Scatter + All-Gather, with the optimizer in between: every rank
receives only its 1/n slice of each averaged gradient bucket, runs the optimizer on that
slice alone (so its states are 1/n of DDP's, and so is its time), then the updated
parameter slices are all-gathered. The traffic is one all-reduce's.

Parameters live in flat buffers laid out like the gradient buckets (the engine sets it up),
so a shard is a contiguous slice. The inner optimizer sees one tensor per (parameter, shard)
overlap, which keeps each parameter's options (weight decay groups) and makes any
element-wise optimizer (AdamW, SGD with momentum, ...) exact. The all-gather of a bucket is
launched right after the step and waited for just before the first module that uses it runs
its next forward, so it overlaps the earlier layers' forward.

`state_dict()` is the unsharded optimizer's (full per-parameter tensors, torch's indices),
so checkpoints load with or without sharding and at any number of ranks (minddp.optim.zero_state).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ..comm import collectives
from ..parallel import gradnorm
from . import zero_state
from .overlap import OverlappedOptimizer  # noqa: F401 - its old home (minddp.optim.zero.OverlappedOptimizer)
from .replicated import BucketSteps


@dataclass
class Segment:
    """The part of one parameter that lies in this rank's shard of one bucket."""

    param: int  # index into the engine's parameter list
    bucket: int
    lo: int  # [lo, hi) in the parameter's flattened elements
    hi: int
    tensor: torch.Tensor  # view of the flat parameter buffer, stepped by the inner optimizer
    grad: torch.Tensor  # view of the bucket's gradient buffer (averaged after reduce-scatter)


class ShardedOptimizer:
    """The optimizer steps this rank's 1/n shard of every bucket, then all-gathers the parameters
    (see the module's docstring); `tp_group`/`tp_size` make its norms tensor-parallel aware."""

    def __init__(self, ddp, optimizer_class, params=None, tp_group=None, tp_size: int = 1, **defaults):
        if not getattr(ddp, "shard_optimizer", False):
            raise ValueError("ShardedOptimizer needs the engine built with DDP(..., shard_optimizer=True)")
        self.ddp, self.tp_group, self.tp_size = ddp, tp_group, tp_size
        groups = list(params if params is not None else ddp.module.parameters())
        if not groups or not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        index = {id(p): i for i, p in enumerate(ddp.params)}
        self._group_params = []  # per group: engine parameter indices, in the user's order
        for g in groups:
            missing = [tuple(p.shape) for p in g["params"] if id(p) not in index]
            if missing:
                raise ValueError(f"parameters of shapes {missing} are not trainable parameters of the "
                                 "wrapped module (frozen, or another model)")
            self._group_params.append([index[id(p)] for p in g["params"]])
        self._segments: list[Segment] = []
        self._version = None
        self._steps: tuple[int, BucketSteps] | None = None  # (layout version, its per-bucket steps)
        self.gather_per_bucket = ddp.device.type == "cuda"  # step a shard, gather it, next (see step)
        self._pending_state: dict | None = None  # loaded, applied once the bucket layout is final
        self._pending_parts: tuple | None = None  # (own parts, saved state): load_own_state
        inner = [{**{k: v for k, v in g.items() if k != "params"}, "params": []} for g in groups]
        self._slice_shards(inner)
        self.optim = optimizer_class(inner, **defaults)
        self._gathers: dict[int, object] = {}
        # the forward's waits for all-gathers, since they were launched (_waits) and before the
        # last step() (_last_waits): host seconds on CPU, a pair of CUDA events around the wait
        # on CUDA (there the host does not wait, the compute stream does)
        self._waits, self._last_waits = [], []
        self._seen_done: set[int] = set()  # gathers a traced forward saw finished
        ddp.on_rebuild(self._release)  # called before the engine rebuilds its buckets
        self._hooks = [m.register_forward_pre_hook(self._make_wait(m)) for m in ddp.module.modules()
                       if any(True for _ in m.parameters(recurse=False))]

    # -------------------------------------------------------------- layout
    def _slice_shards(self, groups=None) -> None:
        """(Re)cut this rank's segments: at start and once after the engine rebuilds its buckets."""
        layout = self.ddp.layout
        if self._version == layout.version:
            return
        if self._version is not None and any(self.optim.state.values()):
            raise RuntimeError("the engine's bucket layout changed after the optimizer had state")
        groups = groups if groups is not None else self.optim.param_groups
        group_of = {i: g for g, ids in enumerate(self._group_params) for i in ids}
        self._segments = []
        for g in groups:
            g["params"] = []
        for b, bucket in enumerate(layout.buckets):
            lo, hi = layout.shard_range(b)
            for k, i in enumerate(bucket.param_ids):
                off, n = bucket.offsets[k], bucket.numels[k]
                a, z = max(off, lo), min(off + n, hi)
                if a < z:
                    seg = Segment(i, b, a - off, z - off, layout.flat_params[b][a:z], bucket.buffer[a:z])
                    self._segments.append(seg)
                    groups[group_of[i]]["params"].append(seg.tensor)
        self._version = layout.version

    def _release(self, layout=None) -> None:
        """Before the engine's one rebuild of `layout`: let go of the views of its buffers, so each is
        freed as soon as its parameters have moved (no second copy of parameters or gradients)."""
        if any(self.optim.state.values()):
            raise RuntimeError("the engine's bucket layout changed after the optimizer had state")
        self._segments, self._steps = [], None
        for g in self.optim.param_groups:
            g["params"] = []

    # ---------------------------------------------------------------- step
    @property
    def param_groups(self):
        return self.optim.param_groups

    def original_params(self) -> list[torch.Tensor]:
        """The model's parameters in the order of the unsharded optimizer's state dict."""
        return [self.ddp.params[i] for ids in self._group_params for i in ids]

    @torch.no_grad()
    def step(self) -> None:
        self._slice_shards()
        if self._pending_state is not None:  # the engine rebuilt its buckets after the load
            self._apply_state(self._pending_state)
            self._pending_state = None
        if self._pending_parts is not None:
            self._apply_parts()
        self.wait_params()
        self._last_waits, self._waits = self._waits, []
        for s in self._segments:
            s.tensor.grad = s.grad
        # On a GPU bucket by bucket, each all-gather launched as soon as its shard is stepped (it
        # travels while the next shard's kernels run); on the CPU, where each step call costs host
        # time and the host is what runs both, one step over every shard first. Waited for by the
        # next forward: the last bucket first, since it holds the first layers (buckets follow
        # backward's order), which the forward needs first.
        steps = self._bucket_steps() if self.gather_per_bucket else None
        if steps is None:
            self.optim.step()
        layout = self.ddp.layout
        for b in reversed(range(len(layout.buckets))):  # in place: each rank's slice to every rank
            if steps is not None:
                steps.step(b)
            self._gathers[b] = collectives.all_gather_in_place(layout.flat_params[b], self.ddp.process_group)
            self._note("gather_launch", b)

    def _bucket_steps(self) -> BucketSteps:
        """This rank's segments per bucket, per param group, cut once per bucket layout."""
        if self._steps is None or self._steps[0] != self._version:
            bucket_of = {id(s.tensor): s.bucket for s in self._segments}
            cuts = [[[t for t in g["params"] if bucket_of[id(t)] == b] for g in self.optim.param_groups]
                    for b in range(len(self.ddp.layout.buckets))]
            self._steps = (self._version, BucketSteps(self.optim, cuts))
        return self._steps[1]

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.ddp.module.zero_grad(set_to_none=set_to_none)
        for s in self._segments:
            s.tensor.grad = None

    def wait_params(self) -> None:
        """Wait for every pending all-gather (before reading parameters outside a forward)."""
        for b in list(self._gathers):
            self._wait(b)

    @property
    def gather_wait_s(self) -> float:
        """Seconds the forward waited for the all-gathers launched by the last step()."""
        return sum(map(_seconds, self._waits))

    @property
    def exposed_gather_s(self) -> float:
        """... and for those of the step before (read after step(): comm/exposed_gather_s)."""
        return sum(map(_seconds, self._last_waits))

    def _wait(self, b: int) -> None:
        t = time.perf_counter()
        if self.ddp.device.type == "cuda":  # the compute stream's stall, between two events
            events = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            events[0].record()
            self._gathers.pop(b).wait()
            events[1].record()
            self._waits.append(events)
        else:
            self._gathers.pop(b).wait()
            self._waits.append(time.perf_counter() - t)
        if self.ddp.trace is not None and b not in self._seen_done:  # (_poll marked the others)
            self._note("gather_wait", b, t)  # the forward waited from t until now
            self._note("gather_done", b)
        self._seen_done.discard(b)

    def _poll(self) -> None:
        """Mark the all-gathers that have finished (only while a trace is recorded)."""
        for b, work in self._gathers.items():
            if b not in self._seen_done and work.done():
                self._seen_done.add(b)
                self._note("gather_done", b)

    def _note(self, event: str, b: int, t: float | None = None) -> None:
        """Into the engine's trace (minddp timeline, train.trace_step), when one is recorded."""
        if self.ddp.trace is not None:
            self.ddp.trace.append((event, b, time.perf_counter() if t is None else t))

    def _make_wait(self, module):
        mine = {id(p) for p in module.parameters(recurse=False)}
        cache = {}  # layout version -> the buckets holding this module's parameters

        def wait(mod, args):
            if not self._gathers:
                return
            if self.ddp.trace is not None:
                self._poll()
            layout = self.ddp.layout
            if layout.version not in cache:
                cache.clear()
                cache[layout.version] = sorted({layout.bucket_of(i) for i, p in enumerate(self.ddp.params)
                                                if id(p) in mine})
            for b in cache[layout.version]:
                if b in self._gathers:
                    self._wait(b)
        return wait

    # ------------------------------------------------------- gradient norm
    def grad_norm(self, tp_group=None, tp_size: int | None = None) -> torch.Tensor:
        """Global L2 norm from the shards (minddp.parallel.gradnorm: squares summed over dp, and over tp
        for tensor-parallel-sharded parameters); no host sync."""
        return gradnorm.grad_norm(**self._norm_args(tp_group, tp_size))

    def clip_grad_norm_(self, max_norm: float, tp_group=None, tp_size: int | None = None) -> torch.Tensor:
        return gradnorm.clip_grad_norm_(max_norm=max_norm, **self._norm_args(tp_group, tp_size))

    def _norm_args(self, tp_group, tp_size: int | None) -> dict:
        if tp_size is None:  # the constructor's
            tp_group, tp_size = self.tp_group, self.tp_size
        self._slice_shards()
        params, tp = self.ddp.params, tp_group if tp_size > 1 else None
        sharded = [tp is not None and bool(getattr(params[s.param], "tp_shard", None))
                   for s in self._segments]
        return {"grads": [s.grad for s in self._segments], "dp_group": self.ddp.process_group,
                "tp_group": tp, "tp_sharded": sharded, "device": self.ddp.device}

    # ---------------------------------------------------------- checkpoints
    def state_bytes(self) -> int:
        """Bytes of optimizer state held on this rank."""
        return sum(v.numel() * v.element_size() for st in self.optim.state.values()
                   for v in st.values() if isinstance(v, torch.Tensor))

    def state_dict(self) -> dict:
        """The unsharded optimizer's state dict (full tensors): a collective on every rank."""
        if self._pending_state is not None:
            return self._pending_state
        self._slice_shards()
        self.wait_params()
        with self._parts_held():
            return zero_state.unsharded(self.ddp, self.optim, self._segments, self._group_params)

    def sharded_state_dict(self) -> dict:
        """`state_dict()` with this rank's own parts (`zero_state.Piece`) in place of full tensors:
        nothing gathered (a checkpoint whose ranks each write their own). A collective."""
        if self._pending_state is not None:  # loaded, not yet cut into shards: it is whole already
            return self._pending_state
        self._slice_shards()
        self.wait_params()
        with self._parts_held():
            return zero_state.pieces(self.ddp, self.optim, self._segments, self._group_params)

    def own_parts(self) -> list[tuple[int, int, int]]:
        """(position in the unsharded state dict, lo, numel) of each parameter part this rank
        steps in the current bucket layout: what a checkpoint reads into (load_own_state)."""
        self._slice_shards()
        self.wait_params()
        pos_of = zero_state.positions(self._group_params)
        return [(pos_of[s.param], s.lo, s.hi - s.lo) for s in self._segments]

    def load_own_state(self, parts: dict, saved_state: dict, param_groups: list) -> None:
        """This rank's parts of a checkpoint's optimizer state, cut in any way
        ({position: (lo, {key: flat part})}, together over the ranks each element once: as this
        rank wrote them, or as own_parts() cuts them; the scalars, `step`, from `saved_state`,
        the unsharded state dict's with any stand-in for the tensors). Taken at the first step,
        once the engine has rebuilt its buckets: where the parts are not the segments every
        rank steps then, each moves to its rank (zero_state.moved), bit for bit."""
        for g, saved in zip(self.optim.param_groups, param_groups):
            g.update({k: v for k, v in saved.items() if k != "params"})
        self._pending_state = None
        self._pending_parts = (parts, saved_state)

    def _cut_as_segments(self) -> tuple[dict, dict]:
        """The pending parts, moved where they are not this layout's segments on every rank (an
        agreed check: a collective)."""
        parts, saved = self._pending_parts
        if not zero_state.fit_everywhere(parts, saved, self._segments, self._group_params,
                                         self.ddp.process_group):
            parts = zero_state.moved(self.ddp, parts, saved, self._segments, self._group_params)
        return parts, saved

    def _apply_parts(self) -> None:
        parts, saved = self._cut_as_segments()
        self._pending_parts = None
        zero_state.install(self.optim, parts, saved, self._segments, self._group_params)

    @contextmanager
    def _parts_held(self):
        """A save before the first step after a load: the loaded parts stand as the state."""
        if self._pending_parts is None:
            yield
            return
        parts, saved = self._pending_parts = self._cut_as_segments()
        zero_state.install(self.optim, parts, saved, self._segments, self._group_params)
        try:
            yield
        finally:
            self.optim.state.clear()

    def load_state_dict(self, sd: dict) -> None:
        """Load an unsharded optimizer state dict (from any layout): this rank keeps its slices,
        cut at the first step (the engine settles its bucket layout in the first backward)."""
        for g, saved in zip(self.optim.param_groups, sd["param_groups"]):
            g.update({k: v for k, v in saved.items() if k != "params"})
        self._pending_state = sd

    def _apply_state(self, sd: dict) -> None:
        zero_state.load_shards(self.optim, sd, self._segments, self._group_params)


def _seconds(wait) -> float:
    if isinstance(wait, float):
        return wait
    start, end = wait
    end.synchronize()  # recorded in a forward that has long been queued: about free
    return start.elapsed_time(end) / 1e3
