"""BatchNorm's running statistics under the two strategies: where they settle, what eval mode sees.

In train mode ``nn.BatchNorm`` normalises with the batch's mean and *biased* variance and updates
its buffers once per forward (PyTorch docs, ``torch.nn.BatchNorm2d``), with momentum ``m`` (0.1)::

    running_mean <- (1 - m) running_mean + m mean_batch
    running_var  <- (1 - m) running_var  + m var_batch_unbiased

(PyTorch's ``m`` weighs the *new* value, Keras' ``momentum=0.99`` the old one.) ``momentum=None`` is
a cumulative average, ``m = 1 / num_batches_tracked``. Fed the same batches every iteration, the
buffers reach a fixed point (:func:`ema_fixed_point`) that depends on the forwards of one iteration
(``schedule``, as ``MCDConfig.schedule``):

* ``"official"`` (the authors' code, :func:`mcd_helpers.strategies.mcd_step`'s default): Step A
  forwards the labeled batch, then Step B. ``separate``: labeled, labeled, unlabeled, so the running
  mean settles at ``(0.171 mean_sup + 0.1 mean_unsup) / 0.271`` = 0.631 / 0.369, towards the labeled
  batch. ``concat``: labeled, then pooled, ``(0.09 mean_sup + 0.1 mean_cat) / 0.19``, 0.737 / 0.263
  with equal batch sizes.
* ``"step_b"`` (Step B alone, the blog's and the unofficial reproduction's loop): ``concat`` settles
  at the pooled statistics, ``separate`` at ``(0.09 mean_sup + 0.1 mean_unsup) / 0.19`` = 0.474 /
  0.526.

A blend of separate updates weighs the *within*-batch variances by the order of the updates, without
the between-batch term of :func:`pooled_variance`, so it can lie above or below the pooled variance.
These weights hold for a BatchNorm whose inputs are the same in every forward of an iteration: the
first one, or any under ``separate``. Under official ``concat`` a deeper layer sees the labeled
batch normalised differently upstream in Step A (its own statistics) and Step B (pooled), so it has
no such fixed weights.

Shapes: BatchNorm inputs ``h: (N, C, *spatial)``; statistics per channel ``(C,)``; counts ``n`` are
values per channel, ``N * prod(spatial)``.
"""

import numbers
from collections.abc import Sequence

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from .strategies import SCHEDULES


def _check_momentum(momentum) -> None:
    if momentum is not None and (
        isinstance(momentum, bool)
        or not isinstance(momentum, numbers.Real)
        or not 0.0 < momentum <= 1.0
    ):
        raise ValueError(
            "momentum must be a number in (0, 1] (the new batch's weight) or None, got "
            f"{momentum!r}."
        )


def _check(
    h_sup: torch.Tensor,
    h_unsup: torch.Tensor | None = None,
    strategy: str = "concat",
    momentum: float | None = 0.1,
    schedule: str = "official",
) -> None:
    if strategy not in ("concat", "separate") or schedule not in SCHEDULES:
        raise ValueError(
            "strategy must be 'concat' or 'separate' and schedule 'official' (Step A, "
            f"then Step B) or 'step_b', got {strategy!r} and {schedule!r}."
        )
    _check_momentum(momentum)
    for name, h in [("h_sup", h_sup)] + ([] if h_unsup is None else [("h_unsup", h_unsup)]):
        if (
            not isinstance(h, torch.Tensor)
            or h.dim() < 2
            or not h.is_floating_point()
            or h.shape[1] == 0
            or not torch.isfinite(h).all()
        ):
            raise ValueError(
                f"{name} must be a finite (no NaN or inf) floating BatchNorm input of shape "
                f"(N, C, *spatial), got {getattr(h, 'dtype', type(h).__name__)} "
                f"{tuple(getattr(h, 'shape', ()))}."
            )
        if h.numel() // h.shape[1] < 2:
            raise ValueError(
                f"{name} {tuple(h.shape)} has fewer than 2 values per channel: no unbiased "
                "variance."
            )
    if h_unsup is not None and (
        h_sup.shape[1:] != h_unsup.shape[1:] or h_sup.dtype != h_unsup.dtype
    ):
        raise ValueError(
            f"h_sup {tuple(h_sup.shape)} and h_unsup {tuple(h_unsup.shape)} must agree but "
            f"in batch size, and in dtype ({h_sup.dtype}, {h_unsup.dtype})."
        )


def _count(n, name: str, low: int) -> None:
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {n!r}.")


def batch_stats(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Per-channel mean ``(C,)``, biased variance ``(C,)`` and count ``N * prod(spatial)`` of
    ``h``."""
    _check(h)
    dims = [0, *range(2, h.dim())]
    return h.mean(dim=dims), h.var(dim=dims, unbiased=False), h.numel() // h.shape[1]


def unbiased(var_biased: torch.Tensor, n: int) -> torch.Tensor:
    """Bessel's correction ``var * n / (n - 1)``, what BatchNorm stores in ``running_var``;
    ``n >= 2``."""
    _count(n, "n", 2)
    return var_biased * n / (n - 1)


def pooled_variance(mean_a, var_a, n_a: int, mean_b, var_b, n_b: int) -> torch.Tensor:
    """Biased variance of two groups pooled, with its between-group term (the law of total
    variance): ``(n_a var_a + n_b var_b) / n + n_a n_b / n^2 (mean_a - mean_b)^2``,
    ``n = n_a + n_b``.

    Raises:
        ValueError: a count that is not an integer >= 0, both counts 0, statistics of different
        shapes.
    """
    _count(n_a, "n_a", 0)
    _count(n_b, "n_b", 0)
    if (n := n_a + n_b) == 0 or len(
        {tuple(torch.as_tensor(t).shape) for t in (mean_a, var_a, mean_b, var_b)}
    ) > 1:
        raise ValueError(
            "pooled_variance needs n_a + n_b > 0 and four statistics of one shape (a value "
            "per channel)."
        )
    return (n_a * var_a + n_b * var_b) / n + n_a * n_b / n**2 * (mean_a - mean_b) ** 2


def ema_fixed_point(values: Sequence[torch.Tensor], momentum: float) -> torch.Tensor:
    """Fixed point of the updates ``r <- (1 - m) r + m v_k``, k = 1..n, repeated every step:
    ``sum_k m (1 - m)^(n - k) v_k / (1 - (1 - m)^n)``, the value right after the step's last update.
    Two updates at m = 0.1: ``(0.09 v_1 + 0.1 v_2) / 0.19``.

    Raises:
        ValueError: no values, values of different shapes, a momentum outside (0, 1] or None.
    """
    if momentum is None:
        raise ValueError(
            "momentum=None is a cumulative average, not an EMA: use steady_state(..., "
            "momentum=None)."
        )
    _check_momentum(momentum)
    if len(values) == 0 or len({tuple(torch.as_tensor(v).shape) for v in values}) > 1:
        raise ValueError(
            "values must hold at least one update per step, all of one shape (one "
            "statistic per channel)."
        )
    n, keep = len(values), 1.0 - momentum
    return sum(momentum * keep ** (n - 1 - k) * v for k, v in enumerate(values)) / (1.0 - keep**n)


def _forwards(
    h_sup: torch.Tensor, h_unsup: torch.Tensor, strategy: str, schedule: str
) -> list[torch.Tensor]:
    step_b = [torch.cat([h_sup, h_unsup])] if strategy == "concat" else [h_sup, h_unsup]
    return [h_sup] * (schedule == "official") + step_b  # Step A forwards the labeled batch alone


def steady_state(
    h_sup: torch.Tensor,
    h_unsup: torch.Tensor,
    strategy: str,
    momentum: float | None = 0.1,
    schedule: str = "official",
) -> dict[str, torch.Tensor]:
    """Where ``running_mean`` and ``running_var`` settle when the same two batches are fed every
    iteration: :func:`ema_fixed_point` of the iteration's forwards (module docstring), with
    ``momentum=None`` their equal-weight average (the cumulative average of every forward, from
    ``num_batches_tracked = 0``: forwards counted before, e.g. pre-training's, keep their share).

    Shapes: ``(N_sup, C, *)``, ``(N_unsup, C, *)`` -> ``{"mean": (C,), "var": (C,)}`` (``var``
    unbiased).

    Raises:
        ValueError: an unknown strategy or schedule, a bad momentum, inputs that are not BatchNorm
        inputs.
    """
    _check(h_sup, h_unsup, strategy, momentum, schedule)
    stats = [batch_stats(h) for h in _forwards(h_sup, h_unsup, strategy, schedule)]
    parts = {"mean": [m for m, _, _ in stats], "var": [unbiased(v, n) for _, v, n in stats]}
    return {
        k: sum(v) / len(v) if momentum is None else ema_fixed_point(v, momentum)
        for k, v in parts.items()
    }


def train_eval_mismatch(
    h_sup: torch.Tensor,
    h_unsup: torch.Tensor,
    strategy: str,
    momentum: float | None = 0.1,
    eps: float = 1e-5,
    schedule: str = "official",
) -> dict[str, torch.Tensor]:
    """Per part, the largest (over channels) ``|eval z - train z|`` of the part's mean, where ``z``
    is the normalised value with the steady-state running statistics (eval) or with Step B's
    train-mode ones (the part's own batch's mean and biased variance under ``"separate"``, the
    pooled ones under ``"concat"``); in units of the normalised activation. Returns
    ``{"sup": scalar, "unsup": scalar}``.

    Raises:
        ValueError: as :func:`steady_state`, or an ``eps`` that is not a finite number >= 0.
    """
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not 0.0 <= eps < float("inf"):
        raise ValueError(
            f"eps must be a finite number >= 0 (BatchNorm's default is 1e-5), got {eps!r}."
        )
    run, out = steady_state(h_sup, h_unsup, strategy, momentum, schedule), {}
    for part, h in (("sup", h_sup), ("unsup", h_unsup)):
        # what train mode normalises h with
        own = h if strategy == "separate" else torch.cat([h_sup, h_unsup])
        (mean_p, _, _), (t_mean, t_var, _) = batch_stats(h), batch_stats(own)
        eval_z = (mean_p - run["mean"]) / (run["var"] + eps).sqrt()
        out[part] = (eval_z - (mean_p - t_mean) / (t_var + eps).sqrt()).abs().max()
    return out


def run_bn_steps(
    bn: nn.Module,
    h_sup: torch.Tensor,
    h_unsup: torch.Tensor,
    strategy: str,
    steps: int,
    schedule: str = "official",
) -> nn.Module:
    """Feed a train-mode BatchNorm ``bn`` the forwards of ``steps`` iterations (module docstring),
    the same two batches each time, in place, under no_grad. Returns ``bn``.

    Raises:
        ValueError: before running anything, for an unknown strategy or schedule, ``steps`` not an
            integer >= 1, a module that is not a BatchNorm layer with running statistics in train
            mode, or inputs that :func:`steady_state` refuses or whose channels differ from
            ``bn.num_features``.
    """
    _check(h_sup, h_unsup, strategy, schedule=schedule)
    _count(steps, "steps", 1)
    if not isinstance(bn, _BatchNorm) or bn.running_mean is None or not bn.training:
        raise ValueError(
            "bn must be a BatchNorm layer with running statistics (track_running_stats=True) in "
            f"train mode (call bn.train()), got {bn!r}."
        )
    if h_sup.shape[1] != bn.num_features or h_sup.dtype != bn.running_mean.dtype:
        raise ValueError(
            f"bn has {bn.num_features} channels of {bn.running_mean.dtype} but the inputs have "
            f"{h_sup.shape[1]} of {h_sup.dtype}: match them (bn.double(), or h.float())."
        )
    with torch.no_grad():
        # one iteration's forwards, steps times
        for h in _forwards(h_sup, h_unsup, strategy, schedule) * steps:
            bn(h)
    return bn
