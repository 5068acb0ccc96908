"""AdamW with its moments in the host's memory, streamed through the device for each step.

AdamW keeps two fp32 moments per parameter: 8 bytes, twice the fp32 weights, and the largest
of a one-GPU run's states (60 GiB of Llama-3-8B's 120). ``StreamedAdamW`` keeps them in host
memory (pinned on CUDA hosts) and steps the parameters where they are: slices of at most
``OFFLOAD_SLICE_ELEMENTS`` (64M) moments are copied to a device buffer, torch's fused AdamW
kernel updates the parameters, gradients and moments of the slice there, and the moments go
back. Every copy
and kernel runs on the current stream, so the device's own ordering makes the update exactly
AdamW(fused=True)'s (the kernel is elementwise: a slice is updated as the whole tensor would
be), ``found_inf`` included. The host waits for the copies only when it reads the moments
(``state_dict``). The price is the moments' PCIe traffic, 8 bytes per parameter each way per
step, and two device buffers of that many fp32 values (256 MiB each).

Why not torchao's CPUOffloadOptimizer: it runs the update itself on the CPU, over the fp32
weights, gradients and moments (16 bytes per parameter read and written by the host's cores),
and keeps an fp32 copy of every weight in host memory beside the device's.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.optim.adamw import adamw

from ..plan.memory import OFFLOAD_SLICE_ELEMENTS
from .loaded import local_tensor as _local
from .optim import BETAS, EPS, AdamW, decay_groups

MOMENTS = ("exp_avg", "exp_avg_sq")
# Where a long tensor is cut: at multiples of this many values, so that every value takes the
# same path through the kernel as in the whole tensor (CPU kernels run vector lanes from each
# tensor's start and a scalar remainder at its end, whose rounding can differ: seen on torch
# 2.13's CPU AdamW with cuts at 100 values).
CUT_MULTIPLE = 1024


def host_like(p: torch.Tensor) -> torch.Tensor:
    """Zeros shaped like ``p``'s shard on this rank, in host memory (pinned where the shard is
    on a GPU, for asynchronous copies); for a DTensor, a DTensor of the same mesh and placements
    whose local tensor is the host one (what torch.distributed.checkpoint saves by its layout)."""
    local = _local(p)
    host = torch.zeros(local.shape, dtype=local.dtype, device="cpu", pin_memory=local.device.type == "cuda")
    if local is p:
        return host
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(host, p.device_mesh, p.placements, run_check=False, shape=p.shape,  # type: ignore[attr-defined]
                              stride=p.stride())


Piece = tuple[torch.Tensor, int, int]  # a parameter, and the [start, end) of its shard's values


def _pieces(params: list[torch.Tensor], size: int) -> Iterator[list[Piece]]:
    """The parameters' shards as runs of pieces of at most ``size`` values each, every run of
    one device and dtype (one buffer pair, one kernel call): small tensors together, a long one
    cut into contiguous slices (a shard that is not contiguous goes whole, in a run of its own)."""
    run: list[Piece] = []
    used, kind = 0, None
    for p in params:
        local = _local(p)
        n = local.numel()
        step = size if local.is_contiguous() else max(n, 1)
        for start in range(0, max(n, 1), step):
            end = min(n, start + step)
            if run and (used + end - start > size or (local.device, local.dtype) != kind):
                yield run
                run, used = [], 0
            run.append((p, start, end))
            used += end - start
            kind = (local.device, local.dtype)
    if run:
        yield run


def _view(t: torch.Tensor, start: int, end: int, whole: int) -> torch.Tensor:
    local = _local(t)
    return local if (start, end) == (0, whole) else local.view(-1)[start:end]


class StreamedAdamW(AdamW):
    """meshrun's fused AdamW (optim.build_optimizer's groups and settings) with the moments in
    host memory; the state dict and snapshots are AdamW's, the moments host tensors (DTensors
    for FSDP2's sharded parameters)."""

    def __init__(self, params: Any, slice_elements: int = OFFLOAD_SLICE_ELEMENTS, **kwargs: Any) -> None:
        if not kwargs.get("fused"):
            raise ValueError("StreamedAdamW runs torch's fused AdamW kernel (fused=True)")
        if slice_elements < CUT_MULTIPLE or slice_elements % CUT_MULTIPLE:
            raise ValueError(f"slice_elements={slice_elements}: a slice holds a multiple of {CUT_MULTIPLE} values")
        super().__init__(params, **kwargs)
        self.slice_elements = slice_elements
        self._buffers: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}
        self._pending: Any = None  # the last step's copies back to the host, on CUDA

    def _buffer(self, device: torch.device, dtype: torch.dtype, need: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The device's pair of buffers for ``dtype``: a slice's values, or a longer shard that is
        not contiguous (then grown to it)."""
        have = self._buffers.get((device, dtype))
        if have is None or have[0].numel() < need:
            size = max(self.slice_elements, need)
            self._buffers[device, dtype] = (torch.empty(size, dtype=dtype, device=device),
                                            torch.empty(size, dtype=dtype, device=device))
        return self._buffers[device, dtype]

    def _state(self, p: torch.Tensor) -> dict[str, Any]:
        st = self.state[p]
        if not st:  # what AdamW(fused=True) makes, the moments on the host
            st["step"] = torch.zeros((), dtype=torch.float32, device=_local(p).device)
            for k in MOMENTS:
                st[k] = host_like(p)
        return st

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        found_inf = getattr(self, "found_inf", None)
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            if group.get("amsgrad") or group.get("maximize"):
                raise ValueError("StreamedAdamW steps AdamW without amsgrad or maximize")
            beta1, beta2 = group["betas"]
            for run in _pieces(params, self.slice_elements):
                p0 = _local(run[0][0])
                buf_m, buf_v = self._buffer(p0.device, p0.dtype, sum(end - start for _, start, end in run))
                ps, gs, ms, vs, steps, back = [], [], [], [], [], []
                off = 0
                for p, start, end in run:
                    st = self._state(p)
                    whole = _local(p).numel()
                    dev = []
                    for k, buf in zip(MOMENTS, (buf_m, buf_v)):
                        host = _view(st[k], start, end, whole)
                        d = buf[off:off + end - start].view(host.shape)
                        d.copy_(host, non_blocking=True)
                        dev.append(d)
                        back.append((host, d))
                    ps.append(_view(p, start, end, whole))
                    gs.append(_view(p.grad, start, end, whole))
                    ms.append(dev[0])
                    vs.append(dev[1])
                    # the kernel counts the step on the tensor it is given: the shard's own
                    # step once, at its last piece (the one ending where it does); a copy before
                    steps.append(st["step"] if end == whole else st["step"].clone())
                    off += end - start
                adamw(ps, gs, ms, vs, [], steps, fused=True, grad_scale=None, found_inf=found_inf,
                      amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"],
                      weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)
                for host, d in back:
                    host.copy_(d, non_blocking=True)
        self._mark_pending()
        return loss

    def _mark_pending(self) -> None:
        devices = {b[0].device for b in self._buffers.values() if b[0].device.type == "cuda"}
        if devices:
            self._pending = [torch.cuda.Event() for _ in devices]
            for event, device in zip(self._pending, devices):
                with torch.cuda.device(device):
                    event.record()

    def wait(self) -> None:
        """The host waits for the last step's copies of the moments back into its memory."""
        for event in self._pending or ():
            event.synchronize()
        self._pending = None

    def state_dict(self) -> dict[str, Any]:
        self.wait()
        return super().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """AdamW's load for the steps and the groups; the moments into host memory, never
        through the device (torch's load casts every state tensor to its parameter's device)."""
        self.wait()
        moments = {i: {k: v for k, v in st.items() if k in MOMENTS} for i, st in state_dict["state"].items()}
        light = {**state_dict, "state": {i: {k: v for k, v in st.items() if k not in MOMENTS}
                                          for i, st in state_dict["state"].items()}}
        params = [p for g in self.param_groups for p in g["params"]]
        held = {p: {k: self.state[p][k] for k in MOMENTS if k in self.state.get(p, {})} for p in params}
        super().load_state_dict(light)
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        for i, p in zip(ids, params):
            for k, v in moments.get(i, {}).items():
                mine = held[p].get(k)
                if mine is None:
                    mine = host_like(p)
                # (torch.distributed.checkpoint loads into this optimizer's own moments: nothing to copy)
                if _local(v).data_ptr() != _local(mine).data_ptr():
                    _local(mine).copy_(_local(v))
                self.state[p][k] = mine


def build_offloaded(model: torch.nn.Module, lr: float, weight_decay: float) -> StreamedAdamW:
    """optim.build_optimizer's AdamW (its groups, betas and epsilon) with the moments on the
    host; it steps each rank's local shards, so DTensors of several meshes mix freely."""
    return StreamedAdamW(decay_groups(model, weight_decay), lr=lr, betas=BETAS, eps=EPS, fused=True)
