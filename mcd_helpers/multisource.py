"""Several sources in one training step: a small measured training over batch layouts (notebook 09).

How a step's source batches (labeled, weak and strong augmentations, domains) are laid out into
BatchNorm batches decides which statistics normalise each sample: the layouts of
:func:`mcd_helpers.strategies.forward_batches` (``concat``, ``separate``, ``interleave``,
``mixed``, ``chunks``). :func:`train_sources` trains a small MLP on synthetic domains that differ
by a shift, with any layout and any normalisation (:data:`SOURCE_NORMS`: a layer, or one of the
strategy table's BatchNorm treatments ``split-bn``, ``eval-bn``, ``recalibrate``), and measures
accuracy in eval and in train mode.
"""

import copy
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from .norms import per_source_batchnorm, recalibrate_bn
from .strategies import LAYOUTS, STRATEGIES, forward_batches, train_mode

# normalisation layers, then the strategy table's BatchNorm treatments (on plain BatchNorm layers)
SOURCE_NORMS = (
    "batch",
    "group",
    "layer",
    "none",
    "no_running_stats",
    "split-bn",
    "eval-bn",
    "recalibrate",
)


def make_domains(
    n: int, num_domains: int = 2, dim: int = 8, shift: float = 3.0, seed: int = 0
) -> list:
    """``num_domains`` two-class domains: ``x = z + d * shift``, ``z ~ N(0, I)``,
    ``y = [w . z > 0]`` with one fixed ``w`` for every domain and seed. Returns
    ``[(x_d (n, dim) float32, y_d (n,) int64)]``."""
    w = torch.randn(dim, generator=torch.Generator().manual_seed(12345))  # one task for every seed
    g = torch.Generator().manual_seed(seed)
    zs = [torch.randn(n, dim, generator=g) for _ in range(num_domains)]
    return [(z + d * shift, (z @ w > 0).long()) for d, z in enumerate(zs)]


def source_net(
    norm: str = "batch", dim: int = 8, hidden: int = 32, num_sources: int = 2
) -> nn.Module:
    """``Linear -> norm -> ReLU -> Linear -> norm -> ReLU -> Linear(2)`` with a norm of
    :data:`SOURCE_NORMS` (``"eval-bn"`` and ``"recalibrate"`` build plain BatchNorm;
    :func:`train_sources` applies the treatment).

    Raises:
        ValueError: on an unknown ``norm``.
    """
    if norm not in SOURCE_NORMS:
        raise ValueError(f"norm must be one of {SOURCE_NORMS}, got {norm!r}.")
    layer = {
        "group": lambda: nn.GroupNorm(4, hidden),
        "layer": lambda: nn.LayerNorm(hidden),
        "none": nn.Identity,
    }.get(norm, lambda: nn.BatchNorm1d(hidden, track_running_stats=norm != "no_running_stats"))
    net = nn.Sequential(
        nn.Linear(dim, hidden),
        layer(),
        nn.ReLU(),
        nn.Linear(hidden, hidden),
        layer(),
        nn.ReLU(),
        nn.Linear(hidden, 2),
    )
    return per_source_batchnorm(net, num_sources) if norm == "split-bn" else net


@dataclass
class SourcesResult:
    """Per-source accuracies (fractions): ``eval_acc`` in eval mode (each test set in one batch),
    ``train_acc`` with train-mode statistics of a pure batch of that source; ``losses`` per step
    (nats)."""

    layout: str
    norm: str
    eval_acc: list[float]
    train_acc: list[float]
    losses: list[float] = field(repr=False)


def _train_mode(model: nn.Module, norm: str) -> nn.Module:
    """``model.train()``, BatchNorm as the strategy ``norm`` fine-tunes it (eval mode for
    eval-bn)."""
    return train_mode(model, norm) if norm in STRATEGIES else model.train()


def _accuracies(model: nn.Module, test: list) -> list[float]:
    # each source alone, with its own statistics
    outs = forward_batches(model, [x for x, _ in test], "separate")
    return [float((o.argmax(1) == y).float().mean()) for o, (_, y) in zip(outs, test)]


def train_sources(
    layout: str = "separate",
    norm: str = "batch",
    steps: int = 200,
    batch: int = 32,
    num_sources: int = 2,
    shift: float = 3.0,
    lr: float = 0.05,
    seed: int = 0,
) -> SourcesResult:
    """Train :func:`source_net` on :func:`make_domains`, one batch per source per step, loss the
    mean of the sources' cross-entropies (nats), SGD with momentum 0.9, all seeded by ``seed``.
    ``"eval-bn"`` keeps BatchNorm in eval mode while training; ``"recalibrate"`` recomputes the
    statistics on source 0 after it; ``"split-bn"`` keeps running statistics per source.

    Raises:
        ValueError: an unknown layout or norm, ``"split-bn"`` with another layout than
            ``"separate"``, ``steps < 1`` or ``batch < 2``.
    """
    if layout not in LAYOUTS or steps < 1 or batch < 2:
        raise ValueError(
            f"layout must be one of {LAYOUTS}, steps >= 1, batch >= 2; got {layout!r}, "
            f"{steps}, {batch}."
        )
    if norm == "split-bn" and layout != "separate":
        raise ValueError(
            f"norm 'split-bn' needs layout 'separate' (one source a forward), got {layout!r}."
        )
    torch.manual_seed(seed)
    model = source_net(norm, num_sources=num_sources)
    train = make_domains(min(steps * batch, 8192), num_sources, shift=shift, seed=seed)
    test = make_domains(1000, num_sources, shift=shift, seed=seed + 10_000)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    g = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        _train_mode(model, norm)
        idx = [torch.randint(len(x), (batch,), generator=g) for x, _ in train]
        outs = forward_batches(model, [x[i] for (x, _), i in zip(train, idx)], layout, g)
        loss = sum(F.cross_entropy(o, y[i]) for o, (_, y), i in zip(outs, train, idx)) / num_sources
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    if norm == "recalibrate":
        recalibrate_bn(model, train[0][0], batch_size=batch)
    with torch.no_grad():  # train_acc: with the train-mode statistics of a pure batch
        return SourcesResult(
            layout,
            norm,
            _accuracies(model.eval(), test),
            _accuracies(_train_mode(copy.deepcopy(model), norm), test),
            losses,
        )
