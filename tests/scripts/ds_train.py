"""DeepSpeed ZeRO on CPU (gloo): a few steps of a small MLP; every rank prints the loss and a
parameter checksum, which must agree across ranks (ZeRO keeps replicas in sync)."""
import argparse
import sys

import deepspeed
import torch

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=-1)  # the native launcher passes it
parser = deepspeed.add_config_arguments(parser)
args = parser.parse_args()

deepspeed.init_distributed(dist_backend="gloo")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
engine, _, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
rank = torch.distributed.get_rank()
g = torch.Generator().manual_seed(100 + rank)
losses = []
for _ in range(5):
    x = torch.randn(engine.train_micro_batch_size_per_gpu(), 16, generator=g)
    loss = (engine(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
    engine.backward(loss)
    engine.step()
    losses.append(loss.item())
stage = engine.zero_optimization_stage()
with torch.no_grad():
    if stage == 3:
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
            checksum = sum(float(p.double().sum()) for p in engine.module.parameters())
    else:
        checksum = sum(float(p.double().sum()) for p in engine.module.parameters())
sys.stdout.write(f"DSTRAIN rank={rank} world={torch.distributed.get_world_size()} stage={stage} "
                 f"first={losses[0]:.5f} last={losses[-1]:.5f} checksum={checksum:.6f}\n")
sys.stdout.flush()
