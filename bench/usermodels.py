"""Models as a user writes them, for benchmarks of models meshrun has never seen: plain torch
modules, no meshrun hooks, handed to `meshrun train --model usermodels:FACTORY` (with bench/ on
PYTHONPATH). Their forward takes token ids and returns logits; meshrun scores the loss.

  gpt_124m, gpt_1b3   a plain GPT-2-style decoder (LayerNorm, GELU MLP, learned positions,
                      tied embedding), 124M and 1.3B
  llama_1b            a Llama-style decoder written from scratch: RMSNorm, rotary positions,
                      grouped-query attention, SwiGLU, untied head; about 1.1B, vocabulary 50304
  *_tiny              the same code at a size the CPU runs in seconds
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class GPTBlock(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.fc, self.out = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class PlainGPT(nn.Module):
    def __init__(self, vocab: int, width: int, layers: int, heads: int, context: int) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(context, width)
        self.blocks = nn.ModuleList(GPTBlock(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(width)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + self.eps)).type_as(x) * self.weight


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).type_as(x)


class LlamaBlock(nn.Module):
    def __init__(self, width: int, heads: int, kv_heads: int, ffn: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.dim = heads, kv_heads, width // heads
        self.attn_norm, self.ffn_norm = RMSNorm(width), RMSNorm(width)
        self.q = nn.Linear(width, width, bias=False)
        self.kv = nn.Linear(width, 2 * kv_heads * self.dim, bias=False)
        self.o = nn.Linear(width, width, bias=False)
        self.gate, self.up = nn.Linear(width, ffn, bias=False), nn.Linear(width, ffn, bias=False)
        self.down = nn.Linear(ffn, width, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        h = self.attn_norm(x)
        q = self.q(h).view(b, t, self.heads, self.dim).transpose(1, 2)
        k, v = self.kv(h).view(b, t, 2, self.kv_heads, self.dim).permute(2, 0, 3, 1, 4)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o(y.transpose(1, 2).reshape(b, t, c))
        h = self.ffn_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class ScratchLlama(nn.Module):
    def __init__(self, vocab: int, width: int, layers: int, heads: int, kv_heads: int, ffn: int,
                 context: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(LlamaBlock(width, heads, kv_heads, ffn) for _ in range(layers))
        self.norm = RMSNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        dim = width // heads
        inv = 1.0 / (10000.0 ** (torch.arange(0, dim, 2).float() / dim))
        angles = torch.outer(torch.arange(context).float(), inv)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02 / math.sqrt(2))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        cos, sin = self.cos[:t], self.sin[:t]
        x = self.embed(idx)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.head(self.norm(x))


def gpt_124m() -> nn.Module:
    return PlainGPT(50304, 768, 12, 12, 1024)


def gpt_1b3() -> nn.Module:
    return PlainGPT(50304, 2048, 24, 16, 1024)


def llama_1b() -> nn.Module:
    return ScratchLlama(50304, 2048, 16, 32, 8, 5632, 4096)


def gpt_tiny() -> nn.Module:
    return PlainGPT(256, 64, 2, 4, 128)


def llama_tiny() -> nn.Module:
    return ScratchLlama(256, 64, 2, 4, 2, 128, 128)
