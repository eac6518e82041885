"""BatchNorm's running statistics under the two strategies: where they settle, what eval mode sees.

In train mode ``nn.BatchNorm`` normalises with the batch's mean and *biased* variance and updates its
buffers once per forward (PyTorch docs, ``torch.nn.BatchNorm2d``), with momentum ``m`` (0.1)::

    running_mean <- (1 - m) running_mean + m mean_batch
    running_var  <- (1 - m) running_var  + m var_batch_unbiased

(PyTorch's ``m`` weighs the *new* value, Keras' ``momentum=0.99`` the old one.) ``momentum=None`` is a
cumulative average, ``m = 1 / num_batches_tracked``. Fed the same batches every step, the buffers
reach a fixed point (:func:`ema_fixed_point`): one concatenated forward per step settles at the
pooled statistics; labeled-then-unlabeled forwards settle at ``(0.09 mean_sup + 0.1 mean_unsup) / 0.19``
(this schedule is Step B alone), and their running variance weighs the *within*-batch variances
0.47/0.53 without the between-batch term of :func:`pooled_variance`, so it can lie above or below
the pooled one.

Shapes: BatchNorm inputs ``h: (N, C, *spatial)``; statistics per channel ``(C,)``; counts ``n`` are
values per channel, ``N * prod(spatial)``.
"""
from __future__ import annotations

import numbers
from collections.abc import Sequence

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm


def _check_momentum(momentum) -> None:
    if momentum is not None and (isinstance(momentum, bool) or not isinstance(momentum, numbers.Real)
                                 or not 0.0 < momentum <= 1.0):
        raise ValueError(f"momentum must be a number in (0, 1] (the new batch's weight) or None, got {momentum!r}.")


def _check(h_sup: torch.Tensor, h_unsup: torch.Tensor | None = None, strategy: str = "concat",
           momentum: float | None = 0.1) -> None:
    if strategy not in ("concat", "separate"):
        raise ValueError(f"strategy must be 'concat' or 'separate', got {strategy!r}.")
    _check_momentum(momentum)
    for name, h in [("h_sup", h_sup)] + ([] if h_unsup is None else [("h_unsup", h_unsup)]):
        if not isinstance(h, torch.Tensor) or h.dim() < 2 or not h.is_floating_point() or h.shape[1] == 0:
            raise ValueError(f"{name} must be a floating BatchNorm input of shape (N, C, *spatial), got "
                             f"{getattr(h, 'dtype', type(h).__name__)} {tuple(getattr(h, 'shape', ()))}.")
        if h.numel() // h.shape[1] < 2:
            raise ValueError(f"{name} {tuple(h.shape)} has fewer than 2 values per channel: no unbiased variance.")
    if h_unsup is not None and h_sup.shape[1:] != h_unsup.shape[1:]:
        raise ValueError(f"h_sup {tuple(h_sup.shape)} and h_unsup {tuple(h_unsup.shape)} must agree but in batch size.")


def _count(n, name: str, low: int) -> None:
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {n!r}.")


def batch_stats(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Per-channel mean ``(C,)``, biased variance ``(C,)`` and count ``N * prod(spatial)`` of ``h``."""
    _check(h)
    dims = [0, *range(2, h.dim())]
    return h.mean(dim=dims), h.var(dim=dims, unbiased=False), h.numel() // h.shape[1]


def unbiased(var_biased: torch.Tensor, n: int) -> torch.Tensor:
    """Bessel's correction ``var * n / (n - 1)``, what BatchNorm stores in ``running_var``; ``n >= 2``."""
    _count(n, "n", 2)
    return var_biased * n / (n - 1)


def pooled_variance(mean_a, var_a, n_a: int, mean_b, var_b, n_b: int) -> torch.Tensor:
    """Biased variance of two groups pooled, with its between-group term (the law of total variance):
    ``(n_a var_a + n_b var_b) / n + n_a n_b / n^2 (mean_a - mean_b)^2``, ``n = n_a + n_b``.

    Raises:
        ValueError: a count that is not an integer >= 0, both counts 0, statistics of different shapes.
    """
    _count(n_a, "n_a", 0)
    _count(n_b, "n_b", 0)
    if n_a + n_b == 0 or len({tuple(torch.as_tensor(t).shape) for t in (mean_a, var_a, mean_b, var_b)}) > 1:
        raise ValueError("pooled_variance needs n_a + n_b > 0 and four statistics of one shape (a value per channel).")
    n = n_a + n_b
    return (n_a * var_a + n_b * var_b) / n + n_a * n_b / n**2 * (mean_a - mean_b) ** 2


def ema_fixed_point(values: Sequence[torch.Tensor], momentum: float) -> torch.Tensor:
    """Fixed point of the updates ``r <- (1 - m) r + m v_k``, k = 1..n, repeated every step:
    ``sum_k m (1 - m)^(n - k) v_k / (1 - (1 - m)^n)``, the value right after the step's last update.
    Two updates at m = 0.1: ``(0.09 v_1 + 0.1 v_2) / 0.19``.

    Raises:
        ValueError: no values, values of different shapes, a momentum outside (0, 1] or None.
    """
    if momentum is None:
        raise ValueError("momentum=None is a cumulative average, not an EMA: use steady_state(..., momentum=None).")
    _check_momentum(momentum)
    if not values or len({tuple(torch.as_tensor(v).shape) for v in values}) > 1:
        raise ValueError("values must hold at least one update per step, all of one shape (one statistic per channel).")
    n, keep = len(values), 1.0 - momentum
    return sum(momentum * keep ** (n - 1 - k) * v for k, v in enumerate(values)) / (1.0 - keep**n)


def steady_state(h_sup: torch.Tensor, h_unsup: torch.Tensor, strategy: str,
                 momentum: float | None = 0.1) -> dict[str, torch.Tensor]:
    """Where ``running_mean`` and ``running_var`` settle when the same two batches are fed every step.

    ``"concat"``: one update with the pooled statistics; ``"separate"``: two updates, labeled then
    unlabeled (:func:`ema_fixed_point`; with ``momentum=None`` the equal-weight average).

    Shapes: ``(N_sup, C, *)``, ``(N_unsup, C, *)`` -> ``{"mean": (C,), "var": (C,)}``.
    """
    _check(h_sup, h_unsup, strategy, momentum)
    if strategy == "concat":
        mean, var, n = batch_stats(torch.cat([h_sup, h_unsup]))
        return {"mean": mean, "var": unbiased(var, n)}
    (m_s, v_s, n_s), (m_u, v_u, n_u) = batch_stats(h_sup), batch_stats(h_unsup)
    stats = {"mean": [m_s, m_u], "var": [unbiased(v_s, n_s), unbiased(v_u, n_u)]}
    return {k: sum(v) / 2 if momentum is None else ema_fixed_point(v, momentum) for k, v in stats.items()}


def train_eval_mismatch(h_sup: torch.Tensor, h_unsup: torch.Tensor, strategy: str,
                        momentum: float | None = 0.1, eps: float = 1e-5) -> dict[str, torch.Tensor]:
    """Per part, the largest (over channels) ``|eval z - train z|`` of the part's mean, where ``z`` is the
    normalised value with the steady-state running statistics (eval) or the train-mode ones (the part's
    own batch's mean and biased variance under ``"separate"``, the pooled ones under ``"concat"``); in units
    of the normalised activation. Returns ``{"sup": scalar, "unsup": scalar}``.

    Raises:
        ValueError: as :func:`steady_state`, or an ``eps`` that is not a finite number >= 0.
    """
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not 0.0 <= eps < float("inf"):
        raise ValueError(f"eps must be a finite number >= 0 (BatchNorm's default is 1e-5), got {eps!r}.")
    run, out = steady_state(h_sup, h_unsup, strategy, momentum), {}
    for part, h in (("sup", h_sup), ("unsup", h_unsup)):
        own = h if strategy == "separate" else torch.cat([h_sup, h_unsup])  # what train mode normalises h with
        (mean_p, _, _), (t_mean, t_var, _) = batch_stats(h), batch_stats(own)
        eval_z = (mean_p - run["mean"]) / (run["var"] + eps).sqrt()
        out[part] = (eval_z - (mean_p - t_mean) / (t_var + eps).sqrt()).abs().max()
    return out


def run_bn_steps(bn: nn.Module, h_sup: torch.Tensor, h_unsup: torch.Tensor, strategy: str, steps: int) -> nn.Module:
    """Feed a train-mode BatchNorm ``bn`` the same two batches ``steps`` times, in place, under no_grad:
    one forward of the concatenation per step, or labeled then unlabeled. Returns ``bn``.

    Raises:
        ValueError: before running anything, for an unknown strategy, ``steps`` not an integer >= 1, a
            module that is not a BatchNorm layer with running statistics in train mode, or inputs that
            :func:`steady_state` refuses or whose channels differ from ``bn.num_features``.
    """
    _check(h_sup, h_unsup, strategy)
    _count(steps, "steps", 1)
    if not isinstance(bn, _BatchNorm) or bn.running_mean is None or not bn.training:
        raise ValueError("bn must be a BatchNorm layer with running statistics (track_running_stats=True) in "
                         f"train mode (call bn.train()), got {bn!r}.")
    if h_sup.shape[1] != bn.num_features:
        raise ValueError(f"bn has {bn.num_features} channels but the inputs have {h_sup.shape[1]}.")
    with torch.no_grad():
        for _ in range(steps):
            for h in ([torch.cat([h_sup, h_unsup])] if strategy == "concat" else [h_sup, h_unsup]):
                bn(h)
    return bn
