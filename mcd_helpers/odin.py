"""ODIN on a pre-trained network (the pure scores MSP and energy are in :mod:`mcd_helpers.losses`).

ODIN (Liang, Li & Srikant, ICLR 2018, arXiv 1706.02690, Eq. 2; github.com/facebookresearch/odin
``code/calData.py``): temperature scaling and a small input perturbation
``x~ = x - eps * sign(-grad_x log S_yhat(x; T))`` that raises the predicted class's softmax score,
more for ID than for OOD images. Score ``1 - max_k softmax(f(x~) / T)_k``, higher = more OOD. A
two-head network is scored by ``F1``.
"""

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .losses import msp_score
from .metrics import ood_metrics


def odin_scores(
    model: nn.Module,
    x: torch.Tensor,
    temperature: float,
    epsilons: Sequence[float],
    pixel_std=1.0,
    batch_size: int = 500,
    device="cpu",
) -> list[torch.Tensor]:
    """ODIN's scores of ``x`` ``(N, C, H, W)`` (normalised) for each epsilon at one temperature T,
    ``(N,)`` each.

    Per batch: ``yhat = argmax F1(x)``; ``g = grad_x CE(F1(x) / T, yhat)``;
    ``x~ = x - eps * sign(g) / pixel_std`` (ODIN's code: sign ``g >= 0 -> +1`` divided by the
    normalisation's std, so ``eps`` is a step in pixel units of [0, 1] images); one gradient serves
    every epsilon. Eval mode, restored afterwards; the parameters get no gradient.

    Raises:
        ValueError: ``temperature <= 0``, an epsilon below 0, a ``pixel_std`` that is not one
            positive number or one per channel.
    """
    std = torch.as_tensor(pixel_std, dtype=x.dtype, device=device).flatten()
    if (
        temperature <= 0
        or any(eps < 0 for eps in epsilons)
        or std.numel() not in (1, x.shape[1])
        or (std <= 0).any()
    ):
        raise ValueError(
            "ODIN needs T > 0 (1000), epsilons >= 0 (in pixels, e.g. 0.0014) and one positive "
            f"pixel_std or one per channel; got T={temperature}, epsilons={list(epsilons)}, "
            f"pixel_std={pixel_std!r}"
        )
    was_training = model.training
    scores = [[] for _ in epsilons]
    model.eval()
    try:
        for xb in x.split(batch_size):
            xb = xb.to(device).requires_grad_(True)
            with torch.enable_grad():
                logits = model(xb)[0]  # (B, K), F1
                # sum, not mean: in eval mode each sample's gradient is its own term's
                loss = F.cross_entropy(logits / temperature, logits.argmax(1), reduction="sum")
                (grad,) = torch.autograd.grad(loss, xb)
            step = torch.where(grad >= 0, 1.0, -1.0) / std.view(1, -1, 1, 1)
            with torch.no_grad():
                for out, eps in zip(scores, epsilons):
                    out.append(msp_score(model(xb.detach() - eps * step)[0], temperature).cpu())
    finally:
        model.train(was_training)
    return [torch.cat(s) for s in scores]


def tune_odin(
    model: nn.Module,
    val_id_x: torch.Tensor,
    val_ood_x: torch.Tensor,
    temperatures: Sequence[float],
    epsilons: Sequence[float],
    pixel_std=1.0,
    batch_size: int = 500,
    device="cpu",
) -> tuple[float, float, dict]:
    """ODIN's ``(T, epsilon)`` with the best AUROC on a validation split of ID and OOD images (ties:
    the first pair in grid order), as ODIN's authors tune it.

    Returns:
        ``(T, epsilon, {(T, epsilon): AUROC})``.

    Raises:
        ValueError: as :func:`odin_scores`.
    """
    grid = {}
    for t in temperatures:  # one input gradient per temperature, shared by every epsilon
        kw = dict(pixel_std=pixel_std, batch_size=batch_size, device=device)
        s_id = odin_scores(model, val_id_x, t, epsilons, **kw)
        s_ood = odin_scores(model, val_ood_x, t, epsilons, **kw)
        for eps, a, b in zip(epsilons, s_id, s_ood):
            grid[(t, eps)] = ood_metrics(a, b)["auroc"]
    return (*max(grid, key=grid.get), grid)  # max returns the first maximal key
