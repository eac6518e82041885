"""What the pipeline's tests share: the toy config, a metric computation by brute force and a
history by hand. Real Fashion-MNIST (Debian's dataset-fashion-mnist) at toy size (``TINY``)."""

import dataclasses

import numpy as np

from mcd_helpers.experiments.config import MCDConfig
from mcd_helpers.experiments.loop import History

TINY = MCDConfig(
    train_subset=600,
    test_subset=400,
    n_val=40,
    ood_size=200,
    pretrain_epochs=1,
    pretrain_milestones=(),
    steps_per_epoch=3,
    finetune_epochs=2,
    batch_size_sup=32,
    batch_size_unsup=32,
    eval_batch_size=500,
    odin_temperatures=(1000.0,),
    odin_epsilons=(0.0, 0.002),
    ood_sets=("gaussian",),
    strategies=("separate", "concat"),
)
LAST = dataclasses.replace(TINY, selection="last-epoch")


def brute_metrics(s_id, s_ood) -> dict:
    """The five metrics of mcd_helpers.metrics by brute force: ID positive, accepted as ID when
    score <= t, every unique score a threshold; AUROC over every (ID, OOD) pair, ties 1/2; AUPRs as
    step sums."""
    s_id, s_ood = np.asarray(s_id, dtype=np.float64), np.asarray(s_ood, dtype=np.float64)
    t = np.unique(np.r_[s_id, s_ood])  # ascending
    n_id_acc, n_ood_acc = (s_id[None] <= t[:, None]).sum(1), (s_ood[None] <= t[:, None]).sum(1)
    tpr, fpr = n_id_acc / len(s_id), n_ood_acc / len(s_ood)
    first = np.argmax(n_id_acc >= 0.95 * len(s_id) - 1e-9)
    tpr0 = np.r_[0.0, tpr]
    n_ood_flag, n_flag = (
        (s_ood[None] >= t[:, None]).sum(1),
        (np.r_[s_id, s_ood][None] >= t[:, None]).sum(1),
    )
    rec_out = n_ood_flag / len(s_ood)
    pairs = (s_ood[:, None] > s_id[None]) + 0.5 * (s_ood[:, None] == s_id[None])
    return {
        "fpr95": fpr[first],
        "detection_error": min(0.5, np.min(0.5 * (1 - tpr) + 0.5 * fpr)),
        "auroc": pairs.mean(),
        "aupr_in": np.sum(np.diff(tpr0) * n_id_acc / (n_id_acc + n_ood_acc)),
        "aupr_out": np.sum((rec_out - np.r_[rec_out[1:], 0.0]) * n_ood_flag / n_flag),
    }


def history_of(val_auroc, steps: int = 2) -> History:
    """A fine-tuning history of ``steps`` steps an epoch with these validation AUROCs."""
    n = steps * len(val_auroc)
    return History(
        ce=list(range(n)), dis=[0.5] * n, gap=[0.1] * n, step_a=[1.0] * n, val_auroc=list(val_auroc)
    )
