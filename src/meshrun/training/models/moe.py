"""A mixture-of-experts MLP for meshrun's GPT, and expert parallelism over a process group.

Routing: a linear router, softmax over experts, the top-k (default 2) renormalised as gates.
Dropless: every token reaches its k experts (no capacity limit, so nothing is dropped and
results do not depend on batch composition). Load balancing (Switch Transformer's loss,
E · Σ_e f_e · P_e with f_e the share of assignments to expert e and P_e its mean router
probability) is computed over the whole global batch: f and P are averaged over all ranks,
so any layout trains exactly like one process.

Expert parallelism: the ``ep`` ranks of a group hold E/ep experts each; tokens travel to
their experts' rank and back with two all-to-alls (variable sizes), differentiable."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> torch.Tensor:
        ctx.splits, ctx.group = (in_splits, out_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        back_out, back_in = ctx.splits  # the way back: what was received goes home
        out = grad.new_empty((sum(back_out), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), back_out, back_in, group=ctx.group)
        return out, None, None, None


def _global_mean(local: torch.Tensor, group: Any) -> torch.Tensor:
    """The mean over ranks as the value; the gradient flows through this rank's part as if
    it were the whole (the trainer averages gradients over the ranks afterwards)."""
    total = local.detach().clone()
    dist.all_reduce(total, group=group)
    return local + (total / dist.get_world_size(group) - local.detach())


class MoE(nn.Module):
    def __init__(self, d: int, n_experts: int, top_k: int = 2, ffn: int | None = None) -> None:
        super().__init__()
        f = ffn or 4 * d
        self.n_experts, self.top_k = n_experts, top_k
        self.router = nn.Linear(d, n_experts, bias=False)
        self.w_up = nn.Parameter(torch.randn(n_experts, d, f) * 0.02)
        self.b_up = nn.Parameter(torch.zeros(n_experts, f))
        self.w_down = nn.Parameter(torch.randn(n_experts, f, d) * 0.02)
        self.b_down = nn.Parameter(torch.zeros(n_experts, d))
        self.first_expert = 0  # experts held here: first_expert .. first_expert + len(w_up) - 1
        self.ep_group: Any = None
        self.stats_group: Any = None  # where load-balancing statistics are averaged (the data-parallel world)
        self.aux = torch.zeros(())

    def shard_experts(self, group: Any) -> None:
        """Keep only this rank's E/ep experts (expert parallelism over ``group``)."""
        ep, rank = dist.get_world_size(group), dist.get_rank(group)
        if self.n_experts % ep:
            from ...errors import MeshrunError

            raise MeshrunError(f"--ep={ep}: {self.n_experts} experts do not split over {ep} ranks "
                               f"(hint: an --ep that divides {self.n_experts})")
        per = self.n_experts // ep
        lo = rank * per
        for name in ("w_up", "b_up", "w_down", "b_down"):
            setattr(self, name, nn.Parameter(getattr(self, name).detach()[lo:lo + per].clone()))
        self.first_expert, self.ep_group = lo, group

    def _experts(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        out = x.new_zeros(x.shape[0], self.w_down.shape[-1])
        for j in range(self.w_up.shape[0]):
            sel = (ids == self.first_expert + j).nonzero(as_tuple=True)[0]
            if sel.numel():
                # the experts stay fp32 under FSDP2's bf16 (it leaves them alone): compute in x's dtype
                w_up, b_up, w_down, b_down = (t[j].to(x.dtype)
                                              for t in (self.w_up, self.b_up, self.w_down, self.b_down))
                h = F.gelu(x[sel] @ w_up + b_up, approximate="tanh")
                out = out.index_add(0, sel, h @ w_down + b_down)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        xs = x.reshape(-1, shape[-1])
        probs = F.softmax(self.router(xs).float(), dim=-1)
        gate, idx = probs.topk(self.top_k, dim=-1)
        gate = (gate / gate.sum(-1, keepdim=True)).to(x.dtype)
        share = F.one_hot(idx, self.n_experts).sum(1).float().mean(0) / self.top_k
        mean_p = probs.mean(0)
        if self.stats_group is not None:
            share, mean_p = _global_mean(share, self.stats_group), _global_mean(mean_p, self.stats_group)
        self.aux = self.n_experts * (share.detach() * mean_p).sum()
        flat_e = idx.reshape(-1)
        order = torch.argsort(flat_e, stable=True)
        tok = torch.arange(xs.shape[0], device=x.device).repeat_interleave(self.top_k)[order]
        e_sorted = flat_e[order]
        inputs = xs[tok]
        if self.ep_group is None:
            out = self._experts(inputs, e_sorted)
        else:
            ep = dist.get_world_size(self.ep_group)
            per = self.w_up.shape[0]
            send = torch.bincount(e_sorted // per, minlength=ep)
            recv = torch.empty_like(send)
            dist.all_to_all_single(recv, send, group=self.ep_group)
            send_l, recv_l = send.tolist(), recv.tolist()
            got = _AllToAll.apply(inputs, recv_l, send_l, self.ep_group)
            got_ids = e_sorted.new_empty(sum(recv_l))
            dist.all_to_all_single(got_ids, e_sorted, recv_l, send_l, group=self.ep_group)
            out = _AllToAll.apply(self._experts(got, got_ids), send_l, recv_l, self.ep_group)
        y = xs.new_zeros(xs.shape).index_add(0, tok, out * gate.reshape(-1)[order][:, None])
        return y.view(shape)
