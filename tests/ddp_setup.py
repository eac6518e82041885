"""The tiny float64 setting of tests/test_ddp.py, shared by the test process and the torchrun
ranks."""

import torch

from mcd_helpers import small_cnn
from mcd_helpers.experiments.config import MCDConfig
from mcd_helpers.splits import transductive_split


def tiny_model(norm: str):
    """``small_cnn`` of width 4 on (N, 1, 8, 8) images, K = 3, float64, the same weights on every
    rank."""
    torch.manual_seed(0)
    return small_cnn(1, 3, norm=norm, width=4).double()


def engine_split():
    """48 labeled images, 6 + 6 validation, 24 + 24 test; batches of 8 (4 per rank), 2 epochs, no
    BatchNorm."""
    g = torch.Generator().manual_seed(2)
    x = lambda n, s=1.0: s * torch.randn(n, 1, 8, 8, generator=g, dtype=torch.float64)  # noqa: E731
    x_sup, y_sup = x(48), torch.randint(0, 3, (48,), generator=g)
    id_x, id_y, ood_x = x(30), torch.randint(0, 3, (30,), generator=g), x(30, 2.0)
    cfg = MCDConfig(
        norm="none",
        finetune_epochs=2,
        batch_size_sup=8,
        batch_size_unsup=8,
        finetune_lr=0.1,
        margin=1.2,
        checkpoint_every=0,
        eval_batch_size=16,
    )
    return transductive_split(x_sup, y_sup, id_x, id_y, ood_x, n_val=6, seed=3), cfg
