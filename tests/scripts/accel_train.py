"""Accelerate on CPU: prepare a model, take a few steps, and check every rank ended with the
same weights and that the process count is the global one accelerate launch was given."""
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
