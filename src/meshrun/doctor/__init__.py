"""meshrun doctor and meshrun bench: check a node (or every rank) before a job wastes the
cluster, and measure communication, matmul and a training step against the card's limits."""
