"""Several sources in one training step: batch layouts and a small measured training (notebook 08).

Semi-supervised and multi-domain code forwards several batches per step (labeled, weak and strong
augmentations, several domains). How they are laid out into BatchNorm batches decides which
statistics normalise each sample:

* ``"concat"``: one forward of all sources (every BatchNorm batch is the mixture);
* ``"separate"``: one forward per source (each BatchNorm batch holds one source);
* ``"mixed"``: all sources shuffled together, then split into ``k`` forwards (each BatchNorm batch
  is a random mixture);
* ``"interleave"``: :func:`interleave`, then ``k`` forwards of contiguous chunks, then
  :func:`de_interleave`: what MixMatch (YU1ut/MixMatch-pytorch) does on one device, and what
  FixMatch's single forward becomes when ``k`` data-parallel devices each normalise a chunk (each
  chunk holds an equal share of every source when the sizes divide evenly);
* ``"chunks"``: the same ``k`` contiguous chunks without interleaving (each chunk holds one
  source when the sources have equal sizes: what data parallelism does to an un-interleaved batch).

:func:`train_sources` trains a small MLP on synthetic domains whose features differ by a shift,
with any layout and any normalisation, and measures accuracy in train and eval mode.
"""
from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..norms import per_source_batchnorm, recalibrate_bn, use_source, freeze_bn

__all__ = ["interleave", "de_interleave", "make_domains", "source_net", "layout_forward", "train_sources",
           "SourcesResult", "LAYOUTS", "NORMS"]

LAYOUTS = ("concat", "separate", "mixed", "interleave", "chunks")
NORMS = ("batch", "group", "layer", "frozen", "no_running_stats", "per_source", "recalibrate", "none")


def interleave(x: torch.Tensor, size: int) -> torch.Tensor:
    """FixMatch's interleave: row ``j * size + i`` goes to position ``i * (N / size) + j``.

    With ``x = cat([x_1, ..., x_size])`` of ``size`` equal-length parts of ``n`` rows, and ``n``
    divisible by ``size``, the result's ``size`` contiguous chunks each hold ``n / size`` rows of
    every part (otherwise the shares differ by one row between chunks). (kekmodel/FixMatch-pytorch
    ``train.py``; YU1ut/MixMatch-pytorch interleaves before forwarding its chunks one by one.)

    Shapes:
        x: ``(N, ...)`` with ``N`` divisible by ``size`` -> ``(N, ...)``.

    Raises:
        ValueError: if ``size < 1`` or ``N`` is not divisible by ``size``.
    """
    if size < 1 or len(x) % size:
        raise ValueError(f"interleave needs N = {len(x)} divisible by size = {size} (size >= 1).")
    return x.reshape(-1, size, *x.shape[1:]).transpose(0, 1).reshape(-1, *x.shape[1:])


def de_interleave(x: torch.Tensor, size: int) -> torch.Tensor:
    """The inverse of :func:`interleave` (``de_interleave(interleave(x, s), s) == x``).

    Raises:
        ValueError: if ``size < 1`` or ``N`` is not divisible by ``size``.
    """
    if size < 1 or len(x) % size:
        raise ValueError(f"de_interleave needs N = {len(x)} divisible by size = {size} (size >= 1).")
    return x.reshape(size, -1, *x.shape[1:]).transpose(0, 1).reshape(-1, *x.shape[1:])


def make_domains(n: int, num_domains: int = 2, dim: int = 8, shift: float = 3.0, seed: int = 0
                 ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``num_domains`` synthetic two-class domains that differ by a shift of their features.

    Domain ``d``: ``x = z + d * shift`` (every coordinate), ``z ~ N(0, I)``; label
    ``y = [w . z > 0]`` with one fixed ``w`` for all domains and seeds (``seed`` draws the samples only). A network that normalises each
    domain with its own statistics sees the same task in every domain; one that normalises with
    the wrong statistics sees it shifted.

    Shapes:
        returns ``[(x_d, y_d)]``: ``x_d (n, dim)`` float32, ``y_d (n,)`` int64 in {0, 1}.
    """
    w = torch.randn(dim, generator=torch.Generator().manual_seed(12345))  # one task for every seed
    g = torch.Generator().manual_seed(seed)
    out = []
    for d in range(num_domains):
        z = torch.randn(n, dim, generator=g)
        out.append((z + d * shift, (z @ w > 0).long()))
    return out


def source_net(norm: str = "batch", dim: int = 8, hidden: int = 32, num_sources: int = 2) -> nn.Module:
    """``Linear -> norm -> ReLU -> Linear -> norm -> ReLU -> Linear(2)``, the ``norm`` of :data:`NORMS`.

    ``"frozen"`` and ``"recalibrate"`` build plain BatchNorm (the fix is applied by
    :func:`train_sources`); ``"per_source"`` gives :class:`~mcd_helpers.norms.PerSourceBatchNorm`.

    Raises:
        ValueError: on an unknown ``norm``.
    """
    if norm not in NORMS:
        raise ValueError(f"norm must be one of {NORMS}, got {norm!r}.")

    def layer() -> nn.Module:
        if norm == "group":
            return nn.GroupNorm(4, hidden)
        if norm == "layer":
            return nn.LayerNorm(hidden)
        if norm == "none":
            return nn.Identity()
        return nn.BatchNorm1d(hidden, track_running_stats=(norm != "no_running_stats"))

    net = nn.Sequential(nn.Linear(dim, hidden), layer(), nn.ReLU(), nn.Linear(hidden, hidden), layer(), nn.ReLU(),
                        nn.Linear(hidden, 2))
    return per_source_batchnorm(net, num_sources) if norm == "per_source" else net


def layout_forward(model: nn.Module, xs: list[torch.Tensor], layout: str, generator: torch.Generator | None = None
                   ) -> list[torch.Tensor]:
    """The model's output for each source batch ``xs[i]`` under one of :data:`LAYOUTS`.

    ``"mixed"`` draws its permutation from ``generator``; ``"interleave"`` and ``"chunks"`` need
    sources of equal size. A model with per-source BatchNorm takes ``"separate"`` only (source
    ``i`` with statistics ``i``).

    Shapes:
        xs: ``k`` batches ``(n_i, ...)`` -> ``k`` outputs ``(n_i, ...)``.

    Raises:
        ValueError: on an unknown layout, unequal sizes where they must be equal, or a
            per-source model with another layout.
    """
    k, sizes = len(xs), [len(x) for x in xs]
    per_source = any(hasattr(m, "num_sources") for m in model.modules())
    if per_source and layout != "separate":
        raise ValueError(f"per-source BatchNorm needs the 'separate' layout (one source per forward), got {layout!r}.")
    if layout == "separate":
        if per_source:
            outs = []
            for i, x in enumerate(xs):
                with use_source(model, i):
                    outs.append(model(x))
            return outs
        return [model(x) for x in xs]
    x = torch.cat(xs)  # (sum n_i, ...)
    if layout == "concat":
        return list(model(x).split(sizes))
    if layout == "mixed":
        perm = torch.randperm(len(x), generator=generator)
        out = torch.cat([model(chunk) for chunk in x[perm].chunk(k)])
        return list(out[torch.argsort(perm)].split(sizes))  # rows back in source order
    if layout in ("interleave", "chunks"):
        if len(set(sizes)) != 1:
            raise ValueError(f"{layout!r} needs sources of equal size, got {sizes}.")
        if layout == "interleave":
            x = interleave(x, k)
        out = torch.cat([model(chunk) for chunk in x.chunk(k)])  # k "devices", each its own statistics
        return list((de_interleave(out, k) if layout == "interleave" else out).split(sizes))
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}.")


@dataclass
class SourcesResult:
    """Outcome of :func:`train_sources`. Accuracies are fractions in [0, 1], per source.

    ``eval_acc``: eval mode (running statistics), the whole test set of each source in one batch;
    ``train_acc``: train-mode statistics of a pure batch of that source (what the loss saw during
    ``separate`` training); ``losses``: the training loss per step (nats).
    """
    layout: str
    norm: str
    eval_acc: list[float]
    train_acc: list[float]
    losses: list[float] = field(repr=False)


def _accuracy(logits: torch.Tensor, y: torch.Tensor) -> float:
    return float((logits.argmax(1) == y).float().mean())


def _accuracies(model: nn.Module, test: list, per_source: bool) -> list[float]:
    """Accuracy on each source's test set, each in one batch (with its own statistics if per-source)."""
    out = []
    for i, (x, y) in enumerate(test):
        with use_source(model, i) if per_source else contextlib.nullcontext():
            out.append(_accuracy(model(x), y))
    return out


def train_sources(layout: str = "separate", norm: str = "batch", steps: int = 200, batch: int = 32,
                  num_sources: int = 2, shift: float = 3.0, lr: float = 0.05, seed: int = 0) -> SourcesResult:
    """Train :func:`source_net` on :func:`make_domains` with one batch per source per step.

    Loss: the mean over sources of each source's cross-entropy (nats). SGD with momentum 0.9.
    ``norm="frozen"`` keeps every BatchNorm in eval mode during training; ``"recalibrate"``
    trains with plain BatchNorm, then recomputes the running statistics on source 0's training
    data (:func:`~mcd_helpers.norms.recalibrate_bn`). Everything is seeded by ``seed``.

    Raises:
        ValueError: on an unknown layout or norm, or ``steps``/``batch`` < 1 (2 for BatchNorm).
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}.")
    if steps < 1 or batch < 2:
        raise ValueError(f"steps must be >= 1 and batch >= 2, got {steps} and {batch}.")
    torch.manual_seed(seed)
    model = source_net(norm, num_sources=num_sources)
    train = make_domains(steps * batch if steps * batch <= 8192 else 8192, num_sources, shift=shift, seed=seed)
    test = make_domains(1000, num_sources, shift=shift, seed=seed + 10_000)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    g = torch.Generator().manual_seed(seed)
    losses = []
    for step in range(steps):
        model.train()
        if norm == "frozen":
            freeze_bn(model)
        idx = [torch.randint(len(x), (batch,), generator=g) for x, _ in train]
        xs = [x[i] for (x, _), i in zip(train, idx)]
        ys = [y[i] for (_, y), i in zip(train, idx)]
        outs = layout_forward(model, xs, layout, g)
        loss = sum(F.cross_entropy(o, y) for o, y in zip(outs, ys)) / num_sources
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    if norm == "recalibrate":
        recalibrate_bn(model, train[0][0], batch_size=batch)
    with torch.no_grad():
        eval_acc = _accuracies(model.eval(), test, norm == "per_source")
        probe = copy.deepcopy(model).train()  # train-mode statistics of a pure batch of each source
        if norm == "frozen":
            freeze_bn(probe)
        train_acc = _accuracies(probe, test, norm == "per_source")
    return SourcesResult(layout, norm, eval_acc, train_acc, losses)
