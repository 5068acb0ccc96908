"""DeepSpeed ZeRO on the torchrun path (the Saturn Cloud document) or DeepSpeed's own launcher.

    meshrun launch -f deepspeed --deepspeed-config examples/ds_config.json examples/deepspeed_train.py
    meshrun launch -f deepspeed --deepspeed-launcher native --deepspeed-config examples/ds_config.json \
        examples/deepspeed_train.py --save_dir /tmp/ds-ckpt

meshrun appends ``--deepspeed --deepspeed_config FILE``, which ``deepspeed.add_config_arguments``
parses. NCCL on GPU, gloo on CPU. Every rank prints its loss and a parameter checksum: the
checksums must agree (ZeRO keeps the replicas in sync). With ``--save_dir``, the engine's
own sharded checkpoint is written (each rank its optimizer shard), as the Saturn Cloud
document advises.
"""
import argparse
import gc
import sys

import deepspeed
import torch

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=-1)  # the native launcher passes it
parser.add_argument("--save_dir", default=None, help="write a DeepSpeed checkpoint here at the end")
parser = deepspeed.add_config_arguments(parser)
args = parser.parse_args()

deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
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
if args.save_dir:
    engine.save_checkpoint(args.save_dir, tag="final")
sys.stdout.write(f"DSTRAIN rank={rank} world={torch.distributed.get_world_size()} stage={stage} "
                 f"first={losses[0]:.5f} last={losses[-1]:.5f} checksum={checksum:.6f}\n")
sys.stdout.flush()
# End the process group explicitly, after the engine has let go of it: left to interpreter
# exit, or destroyed while the engine still holds the group's work objects, gloo's threads
# can abort a finished process ("terminate called without an active exception"; seen in CI
# with the barrier and destroy alone). The order of meshrun's own teardown (training/runtime.py).
engine.destroy()
del engine, model
gc.collect()
torch.distributed.barrier()
torch.distributed.destroy_process_group()
