"""The torchrun Trainer of pytorch/examples' DDP tutorial series (multigpu_torchrun.py) with
snapshots, made runnable anywhere and fixed.

Run it (2 CPU processes here, one per GPU on a GPU machine):

    meshrun launch examples/ddp_snapshot.py 10 2          # 10 epochs, snapshot every 2
    meshrun launch --nproc 4 examples/ddp_snapshot.py 10 2 --batch_size 64

Stop it and run the same line again: it resumes from the last snapshot.

What changed from the tutorial, and why:
- NCCL on GPU, gloo on CPU, so the same script runs on a laptop and a cluster.
- The snapshot holds the optimizer state too (the tutorial saved only the model, so momentum
  restarted from zero on resume), and it is written to a temporary file then renamed, so a
  crash mid-write never leaves a truncated snapshot in place of a good one.
- The tutorial saved when ``epoch % save_every == 0`` and stored EPOCHS_RUN = epoch, so a
  resume redid the saved epoch; here the snapshot records the next epoch to run.
- ``torch.load(weights_only=True)``: loading a snapshot cannot execute code.
- The tutorial's "datautils" module is replaced by a small synthetic dataset.
"""

import argparse
import gc
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class MyTrainDataset(Dataset):
    """Random regression pairs, the same on every rank (seeded), like the tutorial's dataset."""

    def __init__(self, size: int) -> None:
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(size, 20, generator=g)
        self.y = self.x @ torch.randn(20, 1, generator=g) + 0.1 * torch.randn(size, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


class Trainer:
    def __init__(self, model: torch.nn.Module, train_data: DataLoader, optimizer: torch.optim.Optimizer,
                 save_every: int, snapshot_path: str) -> None:
        self.local_rank = int(os.environ["LOCAL_RANK"])
        self.global_rank = int(os.environ["RANK"])
        self.device = torch.device("cuda", self.local_rank) if torch.cuda.is_available() else torch.device("cpu")
        self.model = model.to(self.device)
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.epochs_run = 0
        self.snapshot_path = snapshot_path
        if os.path.exists(snapshot_path):
            self._load_snapshot(snapshot_path)
        self.model = DDP(self.model, device_ids=[self.local_rank] if self.device.type == "cuda" else None)

    def _load_snapshot(self, path: str) -> None:
        snapshot = torch.load(path, map_location=self.device, weights_only=True)
        self.model.load_state_dict(snapshot["MODEL_STATE"])
        self.optimizer.load_state_dict(snapshot["OPTIMIZER_STATE"])
        self.epochs_run = snapshot["EPOCHS_RUN"]
        if self.global_rank == 0:
            print(f"Resuming training from snapshot at epoch {self.epochs_run}", flush=True)

    def _run_batch(self, source: torch.Tensor, targets: torch.Tensor) -> float:
        self.optimizer.zero_grad()
        loss = F.mse_loss(self.model(source), targets)
        loss.backward()
        self.optimizer.step()
        return loss.item()

    def _run_epoch(self, epoch: int) -> float:
        self.train_data.sampler.set_epoch(epoch)  # a different shuffle each epoch, same on all ranks
        total = 0.0
        for source, targets in self.train_data:
            source = source.to(self.device, non_blocking=True)
            targets = targets.to(self.device, non_blocking=True)
            total += self._run_batch(source, targets)
        mean = torch.tensor([total / len(self.train_data)], device=self.device)
        dist.all_reduce(mean)
        return mean.item() / dist.get_world_size()

    def _save_snapshot(self, epoch: int) -> None:
        snapshot = {
            "MODEL_STATE": self.model.module.state_dict(),
            "OPTIMIZER_STATE": self.optimizer.state_dict(),
            "EPOCHS_RUN": epoch + 1,  # the next epoch to run on resume
        }
        tmp = self.snapshot_path + ".tmp"
        torch.save(snapshot, tmp)
        os.replace(tmp, self.snapshot_path)  # atomic: readers see the old or the new file
        print(f"Epoch {epoch} | Training snapshot saved at {self.snapshot_path}", flush=True)

    def train(self, max_epochs: int) -> None:
        for epoch in range(self.epochs_run, max_epochs):
            loss = self._run_epoch(epoch)
            if self.global_rank == 0:
                print(f"Epoch {epoch} | loss {loss:.4f} | steps {len(self.train_data)} "
                      f"| world {dist.get_world_size()}", flush=True)
                if (epoch + 1) % self.save_every == 0 or epoch + 1 == max_epochs:
                    self._save_snapshot(epoch)


def main(save_every: int, total_epochs: int, batch_size: int, snapshot_path: str) -> None:
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend)
    torch.manual_seed(0)  # identical initial weights on every rank
    dataset = MyTrainDataset(2048)
    model = torch.nn.Linear(20, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=False, sampler=DistributedSampler(dataset),
                        pin_memory=torch.cuda.is_available())
    trainer = Trainer(model, loader, optimizer, save_every, snapshot_path)
    trainer.train(total_epochs)
    # Wait for rank 0's last snapshot, and drop DDP (whose reducer holds the process group)
    # before tearing down: with gloo, destroying the group under a live DDP or while a peer
    # is still inside a collective can abort a finished job ("terminate called ...").
    del trainer
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="simple distributed training job")
    parser.add_argument("total_epochs", type=int, help="total epochs to train the model")
    parser.add_argument("save_every", type=int, help="save a snapshot every this many epochs")
    parser.add_argument("--batch_size", default=32, type=int, help="input batch size on each process (default 32)")
    parser.add_argument("--snapshot_path", default="snapshot.pt", help="where the snapshot lives (default snapshot.pt)")
    args = parser.parse_args()
    main(args.save_every, args.total_epochs, args.batch_size, args.snapshot_path)
