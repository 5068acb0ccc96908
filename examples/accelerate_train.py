"""HuggingFace Accelerate with the GLOBAL process count (the Saturn Cloud document's warning).

    meshrun launch -f accelerate examples/accelerate_train.py              # 2 CPU processes here
    meshrun launch -f accelerate --nnodes 2 --node-rank 0 --master-addr HEAD examples/accelerate_train.py

meshrun passes ``--num_processes`` = nodes x processes per node. The script uses only the
Accelerator API (no deepspeed.initialize, no FSDP wrapping: accelerate does those when
launched with --deepspeed-config or --use-fsdp). Every rank prints its weight checksum,
which must agree, and the process count it sees.
"""
import gc
import sys

import torch
from accelerate import Accelerator

accelerator = Accelerator(cpu=not torch.cuda.is_available())
torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
model, opt = accelerator.prepare(model, opt)
g = torch.Generator().manual_seed(accelerator.process_index)
for _ in range(5):
    x = torch.randn(4, 8, generator=g).to(accelerator.device)
    loss = (model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
    accelerator.backward(loss)
    opt.step()
    opt.zero_grad()
checksum = sum(float(p.detach().double().sum()) for p in model.parameters())
total = accelerator.reduce(torch.tensor([1.0], device=accelerator.device), reduction="sum").item()
sys.stdout.write(f"ACCEL index={accelerator.process_index} num={accelerator.num_processes} "
                 f"type={accelerator.distributed_type} counted={total:.0f} checksum={checksum:.6f}\n")
sys.stdout.flush()
# The order of meshrun's own teardown (training/runtime.py): the DDP wrapper's reducer holds the
# process group, so free it (Accelerate keeps references too) before the group is destroyed;
# else gloo can abort a finished rank at exit ("terminate called without an active exception",
# seen once in CI with end_training alone).
del model, opt
accelerator.free_memory()
gc.collect()
accelerator.wait_for_everyone()
accelerator.end_training()  # destroys the process group before interpreter exit
