"""DDP's options, held once: what the wrapper was built with (torch DDP's arguments and minddp's
own), frozen. The wrapper shows them under torch's attribute names (minddp.engine.ddp_api), the
reducer and its seams read them from here; nothing copies them.

torch's derived bucket attributes come from here too, with torch's rules: `bucket_bytes_cap`
(the cap in bytes: 25 MiB without one, the largest of `bucket_cap_mb_list` with a list),
`bucket_bytes_cap_list` and `bucket_bytes_cap_default` (True when no cap was given: then the
first bucket is 1 MiB).
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_BUCKET_CAP_MB = 25.0  # torch's _DEFAULT_BUCKET_CAP_MB: the one place minddp writes it
FIRST_BUCKET_CAP_MB = 1.0  # torch's dist._DEFAULT_FIRST_BUCKET_BYTES, in MiB
MiB = 1024 * 1024


@dataclass(frozen=True)
class Options:
    # how a bucket is reduced
    reduce_op: str = "avg"  # "avg": averaged over ranks (torch DDP), "sum"
    compress: str | None = None  # None, "fp16", "bf16": what travels
    algorithm: str = "native"  # the backend's all-reduce, or one of minddp.comm.collectives'
    ranks_per_node: int | None = None  # algorithm="hierarchical"
    shard_optimizer: bool = False  # ZeRO-1: buckets reduce-scattered (minddp.optim.zero)
    mixed_precision: object = None  # torch's _MixedPrecision (minddp.engine.mixed_precision)
    # the buckets
    bucket_cap_mb: float | None = None  # None: 25 MiB after a 1 MiB first bucket (torch's rule)
    bucket_cap_mb_list: tuple[float, ...] | None = None  # torch 2.13: a cap per bucket, the last repeats
    strict_bucket_cap: bool = False  # minddp's: a bucket never exceeds the cap
    # the iteration
    overlap: bool = True  # launch buckets during backward (False: all at its end)
    find_unused_parameters: bool = False
    skip_all_reduce_unused_params: bool = False  # as given (it acts with find_unused_parameters only)
    optimizer_overlap: bool = False  # step each bucket once reduced (minddp.optim.overlap)
    # torch's arguments that change nothing here, kept as given for scripts that read them back
    gradient_as_bucket_view: bool = False  # minddp's gradients are bucket views either way
    batched_grad_copy: bool = False  # each gradient is copied into its bucket once already
    dim: int = 0  # torch scatters inputs along it over device_ids; one device per process here
    device_ids: tuple[int, ...] | None = None  # the module's GPU index (torch_devices), None on the CPU
    output_device: int | None = None

    @property
    def skip_unused(self) -> bool:
        """skip_all_reduce_unused_params in effect: it needs find_unused_parameters (torch's rule)."""
        return self.skip_all_reduce_unused_params and self.find_unused_parameters

    @property
    def bucket_bytes_cap(self) -> int:
        """torch DDP's attribute: the cap in bytes (what dynamo splits a compiled graph at)."""
        cap = max(self.bucket_cap_mb_list) if self.bucket_cap_mb_list else self.bucket_cap_mb
        return int((DEFAULT_BUCKET_CAP_MB if cap is None else cap) * MiB)

    @property
    def bucket_bytes_cap_list(self) -> list[int]:
        """torch DDP's attribute: bucket_cap_mb_list in bytes, [] without one."""
        return [int(cap * MiB) for cap in self.bucket_cap_mb_list or ()]

    @property
    def bucket_bytes_cap_default(self) -> bool:
        """torch DDP's attribute: no cap was given, so the first bucket is the smaller 1 MiB."""
        return self.bucket_cap_mb is None and not self.bucket_cap_mb_list
