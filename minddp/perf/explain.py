"""The cost model in words: each case `minddp costmodel` explains, its terms with their numbers
(the formulas are minddp/perf/costmodel.py's, memory per rank minddp/perf/memory.py's)."""

from __future__ import annotations

from .costmodel import (
    DTYPE_BYTES,
    Calibration,
    Fabric,
    best_bucket_mb,
    ddp_comm_time,
    exposed_comm,
    inter_node_bytes,
    tree_beats_ring_below,
    zero1_comm_time,
)
from .memory import memory_per_rank


def explain_ddp(params: float, dtype: str, bucket_mb: float, world: int, fab: Fabric,
                compute_ms: float | None = None, calibration: str | None = None) -> str:
    """A DDP step's gradient all-reduces; with the measured forward + backward time, how much is
    exposed and the bucket cap that adds the least (with a calibration file: its fits)."""
    out = []
    bpp = DTYPE_BYTES[dtype]
    c = ddp_comm_time(params, bpp, bucket_mb, world, fab.alpha, fab.beta)
    out.append(f"DDP gradients: {params / 1e6:g}M params x {bpp} B = {c['bytes'] / 1e6:.1f} MB in "
          f"{c['buckets']} buckets (cap {bucket_mb:g} MB) over {world} ranks")
    out.append(f"  latency {c['latency_s'] * 1e3:.3f} ms + bandwidth {c['bandwidth_s'] * 1e3:.3f} ms "
          f"= {c['total_s'] * 1e3:.3f} ms per step")
    if compute_ms is not None:
        bwd = compute_ms * 1e-3 * 2 / 3  # backward is about 2/3 of forward+backward
        exp = exposed_comm(c, bwd)
        bound = "communication" if c["total_s"] > bwd else "compute"
        cal = Calibration.load(calibration) if calibration else None
        cap, best = best_bucket_mb(params, bpp, world, fab.alpha, fab.beta, bwd, calibration=cal)
        out.append(f"  backward ~{bwd * 1e3:.1f} ms: {bound}-bound; exposed communication "
                   f"{exp * 1e3:.3f} ms with overlap "
                   f"({exp / (compute_ms * 1e-3 + exp):.1%} of the step)")
        out.append(f"  bucket size that adds the least to the step: {cap:g} MB "
                   f"({best * 1e3:.3f} ms exposed or taken from backward)")
    return "\n".join(out)


def explain_all_reduce(nbytes: float, n: int, alpha: float, beta: float) -> str:
    lat = 2 * (n - 1) * alpha
    bw = 2 * (n - 1) / n * nbytes / beta
    dom = "bandwidth" if bw >= lat else "latency"
    return (f"ring all-reduce of {nbytes / 1e6:g} MB over {n} ranks at alpha={alpha * 1e6:g} us, "
            f"beta={beta / 1e9:g} GB/s:\n"
            f"  latency term   2(n-1)*alpha     = {lat * 1e3:.4f} ms\n"
            f"  bandwidth term 2(n-1)/n*M/beta  = {bw * 1e3:.4f} ms\n"
            f"  total                           = {(lat + bw) * 1e3:.4f} ms  ({dom}-dominated)\n"
            f"  busbw {nbytes / (lat + bw) * 2 * (n - 1) / n / 1e9:.2f} GB/s; the latency term equals the "
            f"bandwidth term at M = {alpha * beta * n / 1e6:.3f} MB")


def explain_hierarchical(nbytes: float, nodes: int, per_node: int) -> str:
    v = inter_node_bytes(nbytes, nodes, per_node)
    n = nodes * per_node
    return (f"all-reduce of M = {nbytes / 1e6:g} MB over {nodes} nodes x {per_node} ranks:\n"
            f"  flat ring of {n}: each inter-node link carries 2(n-1)/n M = {v['flat_ring'] / 1e6:g} MB "
            f"per direction\n"
            f"  hierarchical: reduce in the node, ring among {nodes} leaders, broadcast in the node: "
            f"{v['hierarchical'] / 1e6:g} MB per leader link per direction "
            f"({v['flat_ring'] / v['hierarchical']:.2f}x less)")


def explain_tree(n: int, fab: Fabric) -> str:
    piped = tree_beats_ring_below(n, fab.alpha, fab.beta, pipelined=True)
    whole = tree_beats_ring_below(n, fab.alpha, fab.beta, pipelined=False)
    return (f"{n} ranks, alpha {fab.alpha * 1e6:g} us, beta {fab.beta / 1e9:g} GB/s: latency 2(n-1)a for "
            f"the ring against 2 ceil(log2 n) a for a tree.\n"
            f"  a pipelined tree beats the ring below {piped / 1e6:.3f} MB\n"
            f"  a whole-message tree (minddp.comm.collectives.tree_all_reduce) beats it below "
            f"{whole / 1e6:.3f} MB")


def explain_zero(n_params: float, bpp: int, bucket_mb: float, world: int, fab: Fabric) -> str:
    d = ddp_comm_time(n_params, bpp, bucket_mb, world, fab.alpha, fab.beta)
    z = zero1_comm_time(n_params, bpp, bucket_mb, world, fab.alpha, fab.beta)
    m_ddp = memory_per_rank(n_params, world, bpp, bpp)
    m_zero = memory_per_rank(n_params, world, bpp, bpp, sharded=True)
    gb = lambda b: f"{b / 1e9:.2f} GB"  # noqa: E731
    return (f"{n_params / 1e6:g}M parameters over {world} data-parallel ranks, AdamW (8 B of state per "
            f"parameter):\n"
            f"  DDP    all-reduce {d['total_s'] * 1e3:.3f} ms; memory per rank {gb(m_ddp['total'])} = "
            f"weights {gb(m_ddp['weights'])} + gradients {gb(m_ddp['gradients'])} + states "
            f"{gb(m_ddp['optimizer_states'])}\n"
            f"  ZeRO-1 reduce-scatter {z['reduce_scatter_s'] * 1e3:.3f} ms + all-gather "
            f"{z['all_gather_s'] * 1e3:.3f} ms (the same bytes); memory per rank {gb(m_zero['total'])} = "
            f"weights + gradients + states/{world} ({gb(m_zero['optimizer_states'])})")
