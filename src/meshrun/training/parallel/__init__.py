"""How a model is laid out over the ranks: the dimensions and their meshes (dims), the choice
of strategy and batch (auto), the parallelisms applied in order (apply: tensor parallel,
context parallel, activation checkpointing, compile, FSDP2/DDP; pipeline, expert, DeepSpeed),
and the layouts the training loop calls (layouts)."""
