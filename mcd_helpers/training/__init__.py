"""Training: the loop (``loop``: pre-training, MCD fine-tuning), the seeded batch order (``batches``),
signals and loss checks (``engine``), checkpoints (``checkpoint``) and DDP (``distributed``).

Nothing in the core (models, losses, metrics) imports this package.
"""
