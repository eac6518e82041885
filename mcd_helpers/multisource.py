"""Several sources in one training step: batch layouts and a small measured training (notebook 08).

How a step's source batches (labeled, weak and strong augmentations, domains) are laid out into
BatchNorm batches decides which statistics normalise each sample (:data:`LAYOUTS`):

* ``"concat"``: one forward of all sources; ``"separate"``: one forward per source;
* ``"mixed"``: all sources shuffled together, then ``k`` forwards (random mixtures);
* ``"interleave"``: :func:`interleave`, ``k`` forwards of contiguous chunks, :func:`de_interleave`:
  MixMatch on one device, and FixMatch's single forward split over ``k`` data-parallel devices;
* ``"chunks"``: the same ``k`` chunks without interleaving (each chunk one source, for equal sizes).

:func:`train_sources` trains a small MLP on synthetic domains that differ by a shift, with any
layout and any normalisation (:data:`SOURCE_NORMS`), and measures accuracy in eval and train mode.
"""

import copy
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from .forwards import forward_outputs
from .norms import freeze_bn, has_sources, per_source_batchnorm, recalibrate_bn

LAYOUTS = ("concat", "separate", "mixed", "interleave", "chunks")
SOURCE_NORMS = ("batch", "group", "layer", "frozen", "no_running_stats", "per_source", "recalibrate", "none")


def interleave(x: torch.Tensor, size: int) -> torch.Tensor:
    """FixMatch's interleave (kekmodel/FixMatch-pytorch ``train.py``): row ``j * size + i`` goes to
    position ``i * (N / size) + j``; for ``x = cat`` of ``size`` equal parts whose length ``size``
    divides, each contiguous chunk of the result holds an equal share of every part.

    Shapes: ``(N, ...)`` with ``N`` divisible by ``size`` -> ``(N, ...)``. Raises ``ValueError`` otherwise.
    """
    if size < 1 or len(x) % size:
        raise ValueError(f"interleave needs N = {len(x)} divisible by size = {size} (size >= 1).")
    return x.reshape(-1, size, *x.shape[1:]).transpose(0, 1).reshape(-1, *x.shape[1:])


def de_interleave(x: torch.Tensor, size: int) -> torch.Tensor:
    """The inverse of :func:`interleave`; raises ``ValueError`` when ``N`` is not divisible by ``size``."""
    if size < 1 or len(x) % size:
        raise ValueError(f"de_interleave needs N = {len(x)} divisible by size = {size} (size >= 1).")
    return x.reshape(size, -1, *x.shape[1:]).transpose(0, 1).reshape(-1, *x.shape[1:])


def make_domains(n: int, num_domains: int = 2, dim: int = 8, shift: float = 3.0, seed: int = 0) -> list:
    """``num_domains`` two-class domains: ``x = z + d * shift``, ``z ~ N(0, I)``, ``y = [w . z > 0]`` with
    one fixed ``w`` for every domain and seed. Returns ``[(x_d (n, dim) float32, y_d (n,) int64)]``."""
    w = torch.randn(dim, generator=torch.Generator().manual_seed(12345))  # one task for every seed
    g = torch.Generator().manual_seed(seed)
    zs = [torch.randn(n, dim, generator=g) for _ in range(num_domains)]
    return [(z + d * shift, (z @ w > 0).long()) for d, z in enumerate(zs)]


def source_net(norm: str = "batch", dim: int = 8, hidden: int = 32, num_sources: int = 2) -> nn.Module:
    """``Linear -> norm -> ReLU -> Linear -> norm -> ReLU -> Linear(2)`` with a norm of :data:`SOURCE_NORMS`
    (``"frozen"`` and ``"recalibrate"`` build plain BatchNorm; :func:`train_sources` applies the fix).

    Raises:
        ValueError: on an unknown ``norm``.
    """
    if norm not in SOURCE_NORMS:
        raise ValueError(f"norm must be one of {SOURCE_NORMS}, got {norm!r}.")
    layer = {"group": lambda: nn.GroupNorm(4, hidden), "layer": lambda: nn.LayerNorm(hidden), "none": nn.Identity}.get(
        norm, lambda: nn.BatchNorm1d(hidden, track_running_stats=norm != "no_running_stats"))
    net = nn.Sequential(nn.Linear(dim, hidden), layer(), nn.ReLU(), nn.Linear(hidden, hidden), layer(), nn.ReLU(),
                        nn.Linear(hidden, 2))
    return per_source_batchnorm(net, num_sources) if norm == "per_source" else net


def layout_forward(model: nn.Module, xs: list[torch.Tensor], layout: str, generator: torch.Generator | None = None) -> list:
    """The model's output for each source batch ``xs[i]`` ``(n_i, ...)`` under a layout of :data:`LAYOUTS`.

    ``"mixed"`` draws its permutation from ``generator``; ``"interleave"`` and ``"chunks"`` need
    sources of equal size; a per-source model takes ``"separate"`` only (source ``i`` with statistics ``i``).

    Raises:
        ValueError: an unknown layout, unequal sizes where they must be equal, a per-source model with another layout.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}.")
    if has_sources(model) and layout != "separate":
        raise ValueError(f"per-source BatchNorm needs the 'separate' layout (one source per forward), got {layout!r}.")
    if layout in ("concat", "separate"):
        return forward_outputs(model, xs, layout)
    k, sizes, x = len(xs), [len(t) for t in xs], torch.cat(xs)  # (sum n_i, ...)
    if layout == "mixed":
        perm = torch.randperm(len(x), generator=generator)
        out = torch.cat([model(chunk) for chunk in x[perm].chunk(k)])
        return list(out[torch.argsort(perm)].split(sizes))  # rows back in source order
    if len(set(sizes)) != 1:
        raise ValueError(f"{layout!r} needs sources of equal size, got {sizes}.")
    out = torch.cat([model(chunk) for chunk in (interleave(x, k) if layout == "interleave" else x).chunk(k)])
    return list((de_interleave(out, k) if layout == "interleave" else out).split(sizes))  # k "devices"


@dataclass
class SourcesResult:
    """Per-source accuracies (fractions): ``eval_acc`` in eval mode (each test set in one batch),
    ``train_acc`` with train-mode statistics of a pure batch of that source; ``losses`` per step (nats)."""
    layout: str
    norm: str
    eval_acc: list[float]
    train_acc: list[float]
    losses: list[float] = field(repr=False)


def _train_mode(model: nn.Module, norm: str) -> nn.Module:
    """``model.train()``; with the ``"frozen"`` norm its BatchNorm stays in eval mode."""
    return freeze_bn(model.train()) if norm == "frozen" else model.train()


def _accuracies(model: nn.Module, test: list) -> list[float]:
    outs = layout_forward(model, [x for x, _ in test], "separate")  # each source alone (its own statistics)
    return [float((o.argmax(1) == y).float().mean()) for o, (_, y) in zip(outs, test)]


def train_sources(layout: str = "separate", norm: str = "batch", steps: int = 200, batch: int = 32,
                  num_sources: int = 2, shift: float = 3.0, lr: float = 0.05, seed: int = 0) -> SourcesResult:
    """Train :func:`source_net` on :func:`make_domains`, one batch per source per step, loss the mean of
    the sources' cross-entropies (nats), SGD with momentum 0.9, all seeded by ``seed``. ``"frozen"``
    keeps BatchNorm in eval mode while training; ``"recalibrate"`` recomputes the statistics on source 0.

    Raises:
        ValueError: an unknown layout or norm, ``steps < 1`` or ``batch < 2``.
    """
    if layout not in LAYOUTS or steps < 1 or batch < 2:
        raise ValueError(f"layout must be one of {LAYOUTS}, steps >= 1, batch >= 2; got {layout!r}, {steps}, {batch}.")
    torch.manual_seed(seed)
    model = source_net(norm, num_sources=num_sources)
    train = make_domains(min(steps * batch, 8192), num_sources, shift=shift, seed=seed)
    test = make_domains(1000, num_sources, shift=shift, seed=seed + 10_000)
    opt, g, losses = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9), torch.Generator().manual_seed(seed), []
    for _ in range(steps):
        _train_mode(model, norm)
        idx = [torch.randint(len(x), (batch,), generator=g) for x, _ in train]
        outs = layout_forward(model, [x[i] for (x, _), i in zip(train, idx)], layout, g)
        loss = sum(F.cross_entropy(o, y[i]) for o, (_, y), i in zip(outs, train, idx)) / num_sources
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    if norm == "recalibrate":
        recalibrate_bn(model, train[0][0], batch_size=batch)
    with torch.no_grad():  # train_acc: with the train-mode statistics of a pure batch
        return SourcesResult(layout, norm, _accuracies(model.eval(), test),
                             _accuracies(_train_mode(copy.deepcopy(model), norm), test), losses)
