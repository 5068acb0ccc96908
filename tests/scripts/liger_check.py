"""Liger Kernel on a GPU (meshrun.kernels.liger): a small Llama with Liger's kernels
against the same weights without them, loss and gradients in bf16; then meshrun's Trainer
names them in its first line and trains. Run by `bash bench/gpu_session.sh checks OUT`; prints
one line per check and ALL OK, or stops at the first failure. Needs CUDA and liger-kernel."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from meshrun.kernels.liger import apply_liger, liger_available

if not torch.cuda.is_available() or not liger_available():
    raise SystemExit("liger_check: needs a GPU and liger-kernel")
dev = torch.device("cuda")
cfg = LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512)
torch.manual_seed(0)
plain = LlamaForCausalLM(cfg).to(dev)
fused = LlamaForCausalLM(cfg).to(dev)
fused.load_state_dict(plain.state_dict())
applied = apply_liger(fused, dev, tp=1, pp=1)
print("applied:", applied, flush=True)
if not applied:
    raise SystemExit("liger_check: nothing applied to a Llama")
x = torch.randint(0, 4096, (4, 256), device=dev)
losses = []
for model in (plain, fused):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(input_ids=x, labels=x, use_cache=False).loss
    loss.backward()
    losses.append(loss.item())
worst = max(((p.grad - q.grad).norm() / p.grad.norm().clamp_min(1e-12)).item()
            for p, q in zip(plain.parameters(), fused.parameters()))
print(f"loss plain {losses[0]:.5f}, Liger {losses[1]:.5f}; worst relative gradient difference {worst:.1e}", flush=True)
if abs(losses[0] - losses[1]) > 2e-2 * abs(losses[0]) or worst > 5e-2:
    raise SystemExit("liger_check: Liger's loss or gradients differ from the plain model's")
print("ALL OK")
