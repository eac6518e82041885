"""BatchNorm running statistics under the two strategies: where they settle, and what eval mode sees.

In training mode ``nn.BatchNorm`` normalises with the batch's mean and *biased* variance and updates
its buffers once per forward (PyTorch docs, ``torch.nn.BatchNorm2d``)::

    running_mean <- (1 - m) running_mean + m mean_batch
    running_var  <- (1 - m) running_var  + m var_batch_unbiased

with momentum ``m = 0.1`` by default. (PyTorch's ``m`` is the weight of the *new* value; Keras'
``BatchNormalization(momentum=0.99)`` is the weight of the *old* one: PyTorch ``m`` = Keras ``1 - m``.)
With ``momentum=None`` the update is a cumulative average, ``m = 1 / num_batches_tracked``.

With fixed inputs the buffers converge to a fixed point. One concatenated forward per step settles
at the pooled statistics; two separate forwards per step (labeled, then unlabeled) settle at a blend
weighted towards the batch forwarded last, e.g. ``(0.09 mean_sup + 0.1 mean_unsup) / 0.19`` at
``m = 0.1``, and their running variance averages the *within*-batch variances with the same
weights (0.09/0.19 ≈ 0.47 and 0.1/0.19 ≈ 0.53, whatever the batch sizes): it lacks the
between-batch term of :func:`pooled_variance`, and since its weights are not the batch-size
weights of the pooled variance either, it can be larger or smaller than the pooled value.
Eval mode normalises with these buffers, so a labeled sample that was normalised with
labeled-only statistics in training is normalised with statistics that include the unlabeled
(ID + OOD) stream at evaluation.

Shapes: BatchNorm inputs ``h: (N, C, *spatial)``; statistics are per channel, ``(C,)``.
Counts (``n``) are the number of elements per channel, ``N * prod(spatial)``.
"""
from __future__ import annotations

import numbers
from collections.abc import Sequence

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

STRATEGIES = ("concat", "separate")


def _check_momentum(momentum: float | None) -> None:
    if momentum is None:
        return
    if isinstance(momentum, bool) or not isinstance(momentum, numbers.Real):
        raise ValueError(f"momentum must be a number in (0, 1] (PyTorch's weight of the new batch; default 0.1) "
                         f"or None for a cumulative average, got {type(momentum).__name__} {momentum!r}.")
    if not (0.0 < momentum <= 1.0):
        raise ValueError(f"momentum must be in (0, 1] (PyTorch's weight of the new batch; default 0.1) "
                         f"or None for a cumulative average, got {momentum}.")


def _check_input(h: torch.Tensor, name: str) -> None:
    if not isinstance(h, torch.Tensor) or h.dim() < 2:
        raise ValueError(f"{name} must be a BatchNorm input of shape (N, C, *spatial), "
                         f"got {tuple(getattr(h, 'shape', ())) or type(h).__name__}.")
    if not h.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor (BatchNorm's inputs are activations), "
                         f"got dtype {h.dtype}: convert it with {name}.float() or {name}.double().")
    if h.shape[1] == 0:
        raise ValueError(f"{name} has no channels (shape {tuple(h.shape)}): dimension 1 is BatchNorm's channel axis.")
    if h.numel() // h.shape[1] < 2:
        raise ValueError(f"{name} has fewer than 2 values per channel: its unbiased variance is undefined "
                         f"(shape {tuple(h.shape)}; an empty batch has none).")


def _check_pair(h_sup: torch.Tensor, h_unsup: torch.Tensor) -> None:
    _check_input(h_sup, "h_sup")
    _check_input(h_unsup, "h_unsup")
    if h_sup.shape[1:] != h_unsup.shape[1:]:
        raise ValueError(f"h_sup and h_unsup must agree except in the batch size, got {tuple(h_sup.shape)} "
                         f"and {tuple(h_unsup.shape)}.")


def _check_strategy(strategy: str) -> None:
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}.")


def _check_count(n, name: str, minimum: int) -> None:
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < minimum:
        raise ValueError(f"{name} must be an integer count of values per channel, at least {minimum}, got {n!r}.")


def batch_stats(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Per-channel mean, biased variance and element count of a BatchNorm input.

    Shapes:
        h: ``(N, C, *spatial)`` -> mean ``(C,)``, biased variance ``(C,)``, count ``N * prod(spatial)``.

    Raises:
        ValueError: if ``h`` is not a floating-point tensor of at least 2 dimensions, has no
            channels, or has fewer than 2 values per channel (an empty batch, for instance).
    """
    _check_input(h, "h")
    dims = [0, *range(2, h.dim())]
    n = h.numel() // h.shape[1]
    return h.mean(dim=dims), h.var(dim=dims, unbiased=False), n


def unbiased(var_biased: torch.Tensor, n: int) -> torch.Tensor:
    """Bessel's correction, ``var * n / (n - 1)``: what BatchNorm stores in ``running_var``.

    Raises:
        ValueError: if ``n`` is not an integer >= 2 (with one value the unbiased variance is undefined).
    """
    _check_count(n, "n", 2)
    return var_biased * n / (n - 1)


def pooled_variance(mean_a: torch.Tensor, var_a: torch.Tensor, n_a: int,
                    mean_b: torch.Tensor, var_b: torch.Tensor, n_b: int) -> torch.Tensor:
    """Biased variance of two groups pooled, with its between-group term.

    sigma2_cat = (n_a var_a + n_b var_b) / n + n_a n_b / n^2 (mean_a - mean_b)^2, n = n_a + n_b,
    for biased (population) variances ``var_a``, ``var_b``: the law of total variance.

    Shapes: all statistics ``(C,)`` (or any matching shape) -> ``(C,)``.

    Raises:
        ValueError: if a count is not an integer >= 0, both counts are 0, or the four statistics
            do not all have the same shape.
    """
    _check_count(n_a, "n_a", 0)
    _check_count(n_b, "n_b", 0)
    if n_a + n_b == 0:
        raise ValueError("n_a and n_b are both 0: there is nothing to pool.")
    shapes = [tuple(torch.as_tensor(t).shape) for t in (mean_a, var_a, mean_b, var_b)]
    if len(set(shapes)) > 1:
        raise ValueError(f"mean_a, var_a, mean_b and var_b must have the same shape (one value per channel), "
                         f"got {shapes}.")
    n = n_a + n_b
    return (n_a * var_a + n_b * var_b) / n + n_a * n_b / n**2 * (mean_a - mean_b) ** 2


def ema_fixed_point(values: Sequence[torch.Tensor], momentum: float) -> torch.Tensor:
    """Fixed point of the cycle of updates r <- (1 - m) r + m v_k, k = 1..n, repeated every step.

    r* = sum_k m (1 - m)^(n - k) v_k / (1 - (1 - m)^n): the value right after the step's last update.
    For two updates (labeled, then unlabeled) at m = 0.1: (0.09 v_sup + 0.1 v_unsup) / 0.19.

    Raises:
        ValueError: on an empty ``values``, values of different shapes (they would broadcast), or a
            momentum outside (0, 1].
    """
    if momentum is None:
        raise ValueError("momentum=None is a cumulative average, not an EMA: use steady_state(..., momentum=None).")
    _check_momentum(momentum)
    if len(values) == 0:
        raise ValueError("values must hold at least one update per step.")
    shapes = [tuple(torch.as_tensor(v).shape) for v in values]
    if len(set(shapes)) > 1:
        raise ValueError(f"values must all have the same shape (one statistic per channel), got {shapes}.")
    n, keep = len(values), 1.0 - momentum
    total = sum(momentum * keep ** (n - 1 - k) * v for k, v in enumerate(values))
    return total / (1.0 - keep**n)


def steady_state(h_sup: torch.Tensor, h_unsup: torch.Tensor, strategy: str,
                 momentum: float | None = 0.1) -> dict[str, torch.Tensor]:
    """Where ``running_mean`` and ``running_var`` settle when the same two batches are fed every step.

    ``"concat"``: one update per step with the pooled statistics (mean and unbiased variance of
    the concatenation, so the variance includes the between-batch term). ``"separate"``: two
    updates per step, labeled then unlabeled, each with its own batch's statistics; at momentum m
    the fixed point is :func:`ema_fixed_point`; with ``momentum=None`` (cumulative average) it is
    the equal-weight average of the two batches' statistics. Either way the separate variance is a
    blend of within-batch variances only, weighted by the update order rather than the batch sizes,
    so it can lie above or below the concatenated (pooled) variance.

    Shapes:
        h_sup: ``(N_sup, C, *spatial)``, h_unsup: ``(N_unsup, C, *spatial)`` -> ``{"mean": (C,), "var": (C,)}``.

    Raises:
        ValueError: on an unknown strategy, a bad momentum, inputs that :func:`batch_stats` refuses
            or inputs that differ in anything but the batch size.
    """
    _check_strategy(strategy)
    _check_momentum(momentum)
    _check_pair(h_sup, h_unsup)
    if strategy == "concat":
        mean, var, n = batch_stats(torch.cat([h_sup, h_unsup]))
        return {"mean": mean, "var": unbiased(var, n)}
    (m_s, v_s, n_s), (m_u, v_u, n_u) = batch_stats(h_sup), batch_stats(h_unsup)
    means, variances = [m_s, m_u], [unbiased(v_s, n_s), unbiased(v_u, n_u)]
    if momentum is None:
        return {"mean": sum(means) / 2, "var": sum(variances) / 2}
    return {"mean": ema_fixed_point(means, momentum), "var": ema_fixed_point(variances, momentum)}


def train_statistics(h_sup: torch.Tensor, h_unsup: torch.Tensor, strategy: str) -> dict[str, tuple]:
    """The (mean, biased variance) each part is normalised with in training mode.

    ``"separate"``: each part its own batch's; ``"concat"``: both parts the pooled ones.

    Shapes: as :func:`steady_state` -> ``{"sup": (mean (C,), var (C,)), "unsup": (...)}``.

    Raises:
        ValueError: as :func:`steady_state` (unknown strategy, bad inputs).
    """
    _check_strategy(strategy)
    _check_pair(h_sup, h_unsup)
    if strategy == "concat":
        mean, var, _ = batch_stats(torch.cat([h_sup, h_unsup]))
        return {"sup": (mean, var), "unsup": (mean, var)}
    return {"sup": batch_stats(h_sup)[:2], "unsup": batch_stats(h_unsup)[:2]}


def train_eval_mismatch(h_sup: torch.Tensor, h_unsup: torch.Tensor, strategy: str,
                        momentum: float | None = 0.1, eps: float = 1e-5) -> dict[str, torch.Tensor]:
    """How far eval-mode normalisation (steady-state running statistics) is from train mode, per part.

    For each part the returned value is the largest, over channels, absolute difference between
    the normalised value of the part's per-channel mean in eval mode and in train mode,
    ``|(mean_p - running_mean) / sqrt(running_var + eps) - (mean_p - train_mean) / sqrt(train_var + eps)|``,
    in units of the normalised activation (0 means eval mode reproduces train mode for that part's
    average sample).

    Returns:
        ``{"sup": scalar tensor, "unsup": scalar tensor}``.

    Raises:
        ValueError: as :func:`steady_state`, or on an ``eps`` that is not a finite number >= 0.
    """
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not (0.0 <= eps < float("inf")):
        raise ValueError(f"eps must be a finite number >= 0 (BatchNorm's default is 1e-5), got {eps!r}.")
    run = steady_state(h_sup, h_unsup, strategy, momentum)
    train = train_statistics(h_sup, h_unsup, strategy)
    out = {}
    for part, h in (("sup", h_sup), ("unsup", h_unsup)):
        mean_p = batch_stats(h)[0]
        t_mean, t_var = train[part]
        eval_z = (mean_p - run["mean"]) / (run["var"] + eps).sqrt()
        train_z = (mean_p - t_mean) / (t_var + eps).sqrt()
        out[part] = (eval_z - train_z).abs().max()
    return out


def run_bn_steps(bn: nn.Module, h_sup: torch.Tensor, h_unsup: torch.Tensor, strategy: str,
                 steps: int) -> nn.Module:
    """Feed ``bn`` (a train-mode BatchNorm) the same two batches for ``steps`` steps, in place.

    ``"concat"``: one forward of the concatenation per step; ``"separate"``: labeled then unlabeled.
    Returns ``bn`` with its updated buffers. Runs under ``torch.no_grad``.

    Raises:
        ValueError: on an unknown strategy, a ``steps`` that is not an integer >= 1, a module that is
            not a BatchNorm layer, one built with ``track_running_stats=False`` (it has no running
            statistics), one in eval mode, inputs that :func:`steady_state` refuses, or inputs whose
            channel count differs from ``bn.num_features``. Nothing is run before these checks.
    """
    _check_strategy(strategy)
    if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < 1:
        raise ValueError(f"steps must be an integer >= 1, got {steps!r}.")
    if not isinstance(bn, _BatchNorm):
        raise ValueError(f"bn must be a BatchNorm layer (nn.BatchNorm1d/2d/3d), got {type(bn).__name__}.")
    if not bn.track_running_stats or bn.running_mean is None:
        raise ValueError("bn was built with track_running_stats=False: it keeps no running statistics. "
                         "Build it with track_running_stats=True (the default).")
    if not bn.training:
        raise ValueError("bn is in eval mode, so its running statistics would not change: call bn.train().")
    _check_pair(h_sup, h_unsup)
    if h_sup.shape[1] != bn.num_features:
        raise ValueError(f"bn has {bn.num_features} channels (num_features) but the inputs have "
                         f"{h_sup.shape[1]} (shape {tuple(h_sup.shape)}).")
    with torch.no_grad():
        for _ in range(steps):
            if strategy == "concat":
                bn(torch.cat([h_sup, h_unsup]))
            else:
                bn(h_sup)
                bn(h_unsup)
    return bn
