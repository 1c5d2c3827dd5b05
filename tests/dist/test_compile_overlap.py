"""Overlap under whole-model torch.compile: minddp hands dynamo torch DDP's handshake, so dynamo's
DDPOptimizer splits the compiled graph at bucket boundaries as it does for torch DDP.

Compared on real gloo ranks with torch DDP compiled with the same counting backend (aot_eager, as
torch's test/distributed/test_dynamo_distributed.py counts subgraphs): the number of subgraphs,
the buckets launched before each subgraph's backward starts, the rebuilt bucket sizes, and the
gradients (bitwise, also against eager minddp), for `DDP(compile(m))` and `compile(DDP(m))`.
"""

import copy
import warnings

import pytest
import torch
import torch._dynamo
import torch.distributed as dist
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend
from torch.utils.checkpoint import checkpoint

import minddp
from minddp.model.gpt import GPT, GPTConfig
from tests import launch

pytestmark = pytest.mark.slow  # compiles on forked ranks: ~10 s a case on 2 idle cores

WIDTH = 256  # a Linear(256, 256) holds 263,168 bytes: four fill dynamo's 1 MiB first bucket


class Deep(nn.Module):
    def __init__(self, depth=12, ckpt=False):
        super().__init__()
        self.ckpt = ckpt
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(checkpoint(layer, x, use_reentrant=False) if self.ckpt else layer(x))
        return x


def _compiled_backward_nodes(out):
    """The compiled subgraphs' backward nodes of `out`'s autograd graph, last subgraph first."""
    seen, stack, found = set(), [out.grad_fn], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if "CompiledFunctionBackward" in node.name():
            found.append(node)
        stack.extend(fn for fn, _ in node.next_functions)
    return found


def _counting_hook(launched):
    """Count bucket launches; average in rank order, element by element, so the result does not
    depend on where a gradient sits in its bucket (gloo's all-reduce on 3 ranks sums each element
    in an order set by its position, and torch 2.13's first iteration has one bucket)."""
    def hook(state, bucket):
        launched.append(bucket.index())
        buffer = bucket.buffer()
        parts = [torch.empty_like(buffer) for _ in range(dist.get_world_size())]

        def average(_):
            total = parts[0].clone()
            for part in parts[1:]:
                total.add_(part)
            return total.div_(len(parts))
        return dist.all_gather(parts, buffer, async_op=True).get_future().then(average)
    return hook


def _run(kind, base, outer, cap_mb, rank, world_size, steps=3):
    """Train `base` 3 steps as `kind`; return subgraphs compiled, buckets launched before each
    compiled backward node (last step), the layout's bucket sizes and the gradients."""
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    cls = {"minddp": minddp.DDP, "torch": nn.parallel.DistributedDataParallel}[kind]
    module = copy.deepcopy(base)
    if outer:
        ddp = cls(module, bucket_cap_mb=cap_mb)
        model = torch.compile(ddp, backend=counter)
    else:
        model = ddp = cls(torch.compile(module, backend=counter), bucket_cap_mb=cap_mb)
    launched = []
    ddp.register_comm_hook(None, _counting_hook(launched))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    before_node = []  # buckets launched when each compiled backward node starts (last step)
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(world_size * 8, WIDTH, generator=g)[rank * 8:(rank + 1) * 8]
        out = model(x)
        launched.clear()
        before_node.clear()
        for node in _compiled_backward_nodes(out):
            node.register_prehook(lambda grads, seen=before_node: seen.append(len(launched)))
        out.square().mean().backward()
        grads = [p.grad.clone() for p in ddp.parameters()]
        opt.step()
        opt.zero_grad()
    if kind == "torch":
        sizes = [int(s) for s in ddp._get_ddp_logging_data()["rebuilt_bucket_sizes"].split(",")]
    else:
        sizes = [b.grad_nbytes for b in ddp.layout.buckets]
    return counter.frame_count, before_node, sizes, grads


def _against_torch(rank, world_size, outer, cap_mb, ckpt):
    torch.manual_seed(0)
    base = Deep(ckpt=ckpt)
    ours = _run("minddp", base, outer, cap_mb, rank, world_size)
    theirs = _run("torch", base, outer, cap_mb, rank, world_size)
    eager = _run_eager(base, rank, world_size, cap_mb)
    return ours, theirs, eager


def _run_eager(base, rank, world_size, cap_mb):
    ddp = minddp.DDP(copy.deepcopy(base), bucket_cap_mb=cap_mb)
    ddp.register_comm_hook(None, _counting_hook([]))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(world_size * 8, WIDTH, generator=g)[rank * 8:(rank + 1) * 8]
        ddp(x).square().mean().backward()
        grads = [p.grad.clone() for p in ddp.parameters()]
        opt.step()
        opt.zero_grad()
    return grads


@pytest.mark.parametrize("world_size, outer, cap_mb, ckpt", [
    (2, False, None, False),  # nanoGPT's DDP(compile(model)), torch's default cap: 1 MiB, then 25
    (2, True, 1, False),  # compile(DDP(model)), 1 MiB buckets: three subgraphs
    (3, False, 1, False),
    (2, False, 1, True),  # activation checkpointing: torch 2.13's dynamo splits it too
])
def test_whole_model_compile_splits_and_overlaps_like_torch_ddp(world_size, outer, cap_mb, ckpt):
    for (subgraphs, before, sizes, grads), (t_subgraphs, t_before, t_sizes, t_grads), eager in \
            launch.ranks(_against_torch, world_size, outer, cap_mb, ckpt, timeout=300):
        assert subgraphs > 1 and subgraphs == t_subgraphs
        # one backward node per subgraph; the later subgraphs' buckets went out before the
        # first subgraph's backward ran (overlap), exactly as torch DDP's did
        assert len(before) == subgraphs and before[-1] > 0
        assert before == t_before
        assert sizes == t_sizes
        for a, b, c in zip(grads, t_grads, eager):
            assert torch.equal(a, b), "minddp compiled vs torch DDP compiled"
            assert torch.equal(a, c), "minddp compiled vs minddp eager"


def _small_cap(rank, world_size):
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    model = minddp.DDP(torch.compile(Deep(depth=6), backend=counter), bucket_cap_mb=0.5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            model(torch.randn(8, WIDTH)).sum().backward()
    return counter.frame_count, [str(w.message) for w in caught if "minddp" in str(w.message)]


def test_a_cap_below_dynamos_first_bucket_keeps_one_graph_and_says_so_once():
    # torch DDP's compiled forward raises here ("First bucket should be smaller/equal ...")
    for subgraphs, messages in launch.ranks(_small_cap, 2, timeout=120):
        assert subgraphs == 1
        assert len(messages) == 1 and "bucket_cap_mb >= 1" in messages[0]


# ------------------------------------------------ the real clients' loops, compiled whole
class WithLoss(nn.Module):
    """nanoGPT / build-nanogpt / llm.c: the model returns (logits, loss), loss inside the graph."""

    def __init__(self):
        super().__init__()
        self.gpt = GPT(GPTConfig(n_layer=3, n_head=4, n_embd=128, block_size=32, vocab_size=256))

    def forward(self, idx, targets):
        logits = self.gpt(idx)
        return logits, nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


CLIENTS = {  # what each script does around the step that can change the gradients
    "nanoGPT": dict(accum=2, clip=1.0, zero_grad_to_none=True, all_reduce_loss=False),
    "llm.c": dict(accum=2, clip=1.0, zero_grad_to_none=True, all_reduce_loss=True),
    "build-nanogpt": dict(accum=2, clip=1.0, zero_grad_to_none=True, all_reduce_loss=True),
}


def _client(rank, world_size, client):
    """`model = torch.compile(model); model = DDP(model)`, then the script's accumulation loop:
    `model.require_backward_grad_sync = (micro_step == accum - 1)`, clip, AdamW."""
    knobs = CLIENTS[client]
    torch.manual_seed(0)
    base = WithLoss()
    result, subgraphs = {}, {}
    for kind, cls in (("minddp", minddp.DDP), ("torch", nn.parallel.DistributedDataParallel)):
        torch._dynamo.reset()
        counter = CompileCounterWithBackend("aot_eager")
        model = cls(torch.compile(copy.deepcopy(base), backend=counter), bucket_cap_mb=1)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
        for step in range(3):
            for micro in range(knobs["accum"]):
                g = torch.Generator().manual_seed(100 * step + micro)
                batch = torch.randint(0, 256, (world_size * 2, 33), generator=g)[rank * 2:(rank + 1) * 2]
                model.require_backward_grad_sync = micro == knobs["accum"] - 1
                _, loss = model(batch[:, :-1], batch[:, 1:])
                (loss / knobs["accum"]).backward()
            if knobs["all_reduce_loss"]:
                dist.all_reduce(loss.detach().clone(), op=dist.ReduceOp.AVG)
            torch.nn.utils.clip_grad_norm_(model.parameters(), knobs["clip"])
            opt.step()
            opt.zero_grad(set_to_none=knobs["zero_grad_to_none"])
        result[kind] = [p.detach().clone() for p in model.parameters()]
        subgraphs[kind] = counter.frame_count
    return result, subgraphs


@pytest.mark.parametrize("client", list(CLIENTS))
def test_real_clients_compiled_whole_stay_bitwise_with_torch_ddp(client):
    for result, subgraphs in launch.ranks(_client, 2, client, timeout=300):
        assert subgraphs["minddp"] > 1 and subgraphs["minddp"] == subgraphs["torch"]
        for a, b in zip(result["minddp"], result["torch"]):
            assert torch.equal(a, b)
