"""What each rank runs: the Trainer (trainer.py) and what it lays out, feeds, saves and reports,
started as ``python -m meshrun.training.worker`` by `meshrun train` (meshrun.job)."""
