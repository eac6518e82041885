"""Experiments of notebooks 04-05: MCD against baselines on one pre-trained network, and the ablation.

* :func:`finetune_by_epoch` -- MCD fine-tuning one epoch at a time (one
  :func:`~mcd_helpers.train.finetune` call per epoch) with a callback after each, for live plots;
  the weights with the best validation AUROC are kept, as in the official code.
* :func:`compare_methods` -- on one transductive split: MSP, ODIN (tuned on the validation
  split) and energy on the pre-trained network, MCD after fine-tuning it; result rows and scores.
* :func:`cached_comparison` -- :func:`compare_methods` loaded from the cache root when it was
  computed before with the same settings (notebooks 04 and 05 share these files), else computed
  and written there.
* :func:`run_protocol` -- :func:`compare_methods` (or :func:`cached_comparison`) for every OOD set.
* :func:`strategy_ablation`, :func:`summarize_ablation`, :func:`strategy_difference` -- concat
  vs separate forwards in Step B over several seeds: mean, sample std, Welch's t-test.
* tables and figures of these results live in :mod:`mcd_helpers.tables` (imported here too).
* :func:`cached_rows` -- load result rows from a JSON file, or compute and write them.

Result rows are dicts with the keys of :func:`mcd_helpers.reproduce.run_reproduction`'s rows
(``id_dataset``, ``ood_dataset``, ``method``, ``strategy``, ``seed``, the metrics of
:func:`~mcd_helpers.metrics.ood_metrics` as fractions, ``id_accuracy``).
"""
from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch
from torch import nn

from .baselines import BASELINES, ODIN_EPSILONS, ODIN_TEMPERATURES, OdinParams, odin_score, tune_odin
from ..training.checkpoint import CorruptCheckpointError, atomic_write_json, load_checkpoint, save_checkpoint
from ..data.sets import FMNIST_STD, TransductiveSplit, cache_root, load_id, load_ood, transductive_split
from ..losses import discrepancy_score, energy_score, msp_score
from ..metrics import ood_metrics
from .tables import METHODS, ablation_markdown, config_markdown, methods_markdown, plot_ablation
from ..training.loop import FinetuneHistory, finetune, predict_logits, set_seed

__all__ = ["load_data", "ood_split", "pixel_std_of", "finetune_by_epoch", "MethodComparison", "compare_methods",
           "cached_comparison", "comparison_path", "run_protocol", "strategy_ablation", "summarize_ablation",
           "strategy_difference", "cached_rows", "config_hash", "config_markdown", "methods_markdown",
           "ablation_markdown", "plot_ablation", "METHODS"]

def pixel_std_of(id_dataset: str):
    """The std (pixel units) that normalises ``id_dataset``'s images: one number or one per channel."""
    if id_dataset == "fashion_mnist":
        return FMNIST_STD
    if id_dataset in ("cifar10", "cifar100"):
        from ..data.cifar import CIFAR_STD
        return CIFAR_STD
    raise ValueError(f"no pixel std known for ID data set {id_dataset!r}.")


def load_data(cfg) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x_train, y_train, x_test, y_test)`` of ``cfg.id_dataset``, cut to ``cfg.train_subset`` /
    ``cfg.test_subset`` images when those are > 0 (as :func:`~mcd_helpers.reproduce.run_reproduction` does).

    Raises:
        DataNotFoundError: when the ID set cannot be found (see :func:`mcd_helpers.data.load_id`).
    """
    x_train, y_train = load_id(cfg.id_dataset, train=True)
    x_test, y_test = load_id(cfg.id_dataset, train=False)
    n_train, n_test = getattr(cfg, "train_subset", 0), getattr(cfg, "test_subset", 0)
    if n_train > 0:
        x_train, y_train = x_train[:n_train], y_train[:n_train]
    if n_test > 0:
        x_test, y_test = x_test[:n_test], y_test[:n_test]
    return x_train, y_train, x_test, y_test


def _accuracy(logits: torch.Tensor, y: torch.Tensor) -> float:
    return float((logits.argmax(1) == y).float().mean())


def finetune_by_epoch(model: nn.Module, x_sup: torch.Tensor, y_sup: torch.Tensor, split: TransductiveSplit,
                      cfg, strategy: str, on_epoch: Callable[[int, FinetuneHistory], None] | None = None,
                      progress: bool = False) -> FinetuneHistory:
    """MCD fine-tuning for ``cfg.finetune_epochs`` epochs, one :func:`finetune` call per epoch.

    Epoch ``e`` runs ``finetune`` with ``finetune_epochs=1`` and ``seed=cfg.seed + 1000 e`` (new
    batches each epoch); ``on_epoch(e, history_so_far)`` is called after it. The weights with
    the best validation AUROC over all epochs are loaded into ``model`` at the end (official
    model selection). With one epoch this is exactly ``finetune(model, ..., cfg, strategy)``;
    with more, SGD's momentum buffer restarts at each epoch (a new optimizer per call).

    Returns:
        the merged history: per-step ``ce``, ``dis``, ``gap`` (nats), per-epoch ``val_auroc``
        (fraction), ``best_epoch``.
    """
    hist, best_state, best = FinetuneHistory(), None, -math.inf
    for epoch in range(cfg.finetune_epochs):
        cfg_e = dataclasses.replace(cfg, finetune_epochs=1, seed=cfg.seed + 1000 * epoch)
        h = finetune(model, x_sup, y_sup, split, cfg_e, strategy, progress=progress)
        for f in dataclasses.fields(h):  # every per-step / per-epoch list (ce, dis, gap, val_auroc, ...)
            if isinstance(getattr(h, f.name), list):
                getattr(hist, f.name).extend(getattr(h, f.name))
        if h.val_auroc[-1] > best:
            best, hist.best_epoch, best_state = h.val_auroc[-1], epoch, copy.deepcopy(model.state_dict())
        if on_epoch is not None:
            on_epoch(epoch, hist)
    model.load_state_dict(best_state)
    return hist


@dataclass
class MethodComparison:
    """Every method on one OOD set: result rows, test scores ``{method: (id_scores, ood_scores)}``
    (each ``(N,)``, higher = more OOD), the fine-tuned model, its history and ODIN's parameters.

    ``scores["mcd_before"]`` is the discrepancy score of the pre-trained network (before MCD)."""
    ood: str
    rows: list
    scores: dict
    model: nn.Module
    history: FinetuneHistory
    odin: OdinParams


def compare_methods(base: nn.Module, x_sup: torch.Tensor, y_sup: torch.Tensor, split: TransductiveSplit,
                    cfg, ood: str, strategy: str = "separate", tuned: nn.Module | None = None,
                    history: FinetuneHistory | None = None, on_epoch=None, progress: bool = False) -> MethodComparison:
    """MSP, ODIN, energy (on ``base``) and MCD (``base`` fine-tuned) on one transductive split.

    ODIN's T and epsilon are chosen on ``split.val_*`` (:func:`~mcd_helpers.baselines.tune_odin`,
    grid from ``cfg.extra["odin_temperatures"]`` and ``cfg.extra["odin_epsilons"]`` when set);
    MCD's epoch is chosen on the same split. The baselines use F1's logits. ``base``'s weights
    are not modified (it is moved to ``cfg.device``): MCD fine-tunes a copy with
    :func:`finetune_by_epoch` after ``set_seed(cfg.seed)``, unless a fine-tuned ``tuned`` model
    (and its ``history``) is passed.

    Returns:
        a :class:`MethodComparison`; its rows are in the order msp, odin, energy, mcd.
    """
    std, dev, bs = pixel_std_of(cfg.id_dataset), cfg.device, cfg.eval_batch_size
    base = base.to(dev)
    grid = {"temperatures": cfg.extra.get("odin_temperatures", ODIN_TEMPERATURES),
            "epsilons": cfg.extra.get("odin_epsilons", ODIN_EPSILONS)}
    odin = tune_odin(base, split.val_id_x, split.val_ood_x, **grid, pixel_std=std, batch_size=bs, device=dev)
    l1_id, l2_id = predict_logits(base, split.test_id_x, bs, dev)  # (N_id, K) each
    l1_ood, l2_ood = predict_logits(base, split.test_ood_x, bs, dev)  # (N_ood, K) each
    odin_kw = dict(temperature=odin.temperature, epsilon=odin.epsilon, pixel_std=std, batch_size=bs, device=dev)
    scores = {"msp": (msp_score(l1_id), msp_score(l1_ood)),
              "odin": (odin_score(base, split.test_id_x, **odin_kw), odin_score(base, split.test_ood_x, **odin_kw)),
              "energy": (energy_score(l1_id), energy_score(l1_ood)),
              "mcd_before": (discrepancy_score(l1_id, l2_id), discrepancy_score(l1_ood, l2_ood))}
    base_acc = _accuracy(l1_id, split.test_id_y)
    if tuned is None:
        set_seed(cfg.seed)
        tuned = copy.deepcopy(base)
        history = finetune_by_epoch(tuned, x_sup, y_sup, split, cfg, strategy, on_epoch, progress)
    t1_id, t2_id = predict_logits(tuned, split.test_id_x, bs, dev)
    t1_ood, t2_ood = predict_logits(tuned, split.test_ood_x, bs, dev)
    scores["mcd"] = (discrepancy_score(t1_id, t2_id), discrepancy_score(t1_ood, t2_ood))
    common = {"id_dataset": cfg.id_dataset, "ood_dataset": ood, "seed": cfg.seed}
    rows = [{**common, "method": m, "strategy": None, **ood_metrics(*scores[m]), "id_accuracy": base_acc}
            for m in BASELINES]
    rows[1].update(odin_temperature=odin.temperature, odin_epsilon=odin.epsilon)
    rows.append({**common, "method": "mcd", "strategy": strategy, **ood_metrics(*scores["mcd"]),
                 "id_accuracy": _accuracy(t1_id, split.test_id_y),
                 "best_val_auroc": max(history.val_auroc) if history and history.val_auroc else None})
    return MethodComparison(ood, rows, scores, tuned, history, odin)


def ood_split(cfg, ood: str, x_test: torch.Tensor, y_test: torch.Tensor) -> TransductiveSplit:
    """The transductive split of ``(x_test, y_test)`` and OOD set ``ood`` (generated with ``cfg.seed``)."""
    return transductive_split(x_test, y_test, load_ood(ood, cfg.ood_size, cfg.seed, cfg.id_dataset),
                              cfg.n_val, cfg.split_seed)


# Fields that say how to run or which OOD sets / strategies a run covers: left out of the key of
# one OOD set's comparison, so that runs over other lists of OOD sets share its cache file.
_NOT_IN_COMPARISON_KEY = ("ood_sets", "strategies", "device", "num_threads", "eval_batch_size",
                          "checkpoint_every")


def comparison_path(cfg, ood: str, strategy: str = "separate", folder: Path | None = None) -> Path:
    """Cache file of :func:`cached_comparison`: ``<folder>/compare-<ood>-<strategy>-<hash>.pt``.

    ``folder`` defaults to ``<cache root>/results``. The hash covers every config field that
    changes the result (:func:`config_hash` without the OOD and strategy lists and the run fields
    device, threads, evaluation batch size and checkpoint interval), plus ``ood`` and ``strategy``.
    """
    folder = Path(folder) if folder is not None else cache_root() / "results"
    key = config_hash(cfg, drop=_NOT_IN_COMPARISON_KEY, ood=ood, strategy=strategy)
    return folder / f"compare-{ood}-{strategy}-{key}.pt"


def _odin_to_state(odin: OdinParams) -> dict:
    """ODIN's parameters as checkpoint-safe plain data: the ``{(T, eps): AUROC}`` grid as ``[[T, eps, AUROC], ...]``
    (checkpoint keys must be strings or numbers)."""
    return {"temperature": odin.temperature, "epsilon": odin.epsilon,
            "val_auroc": [[t, e, a] for (t, e), a in odin.val_auroc.items()]}


def _odin_from_state(state: dict) -> OdinParams:
    """Inverse of :func:`_odin_to_state`."""
    return OdinParams(state["temperature"], state["epsilon"], {(t, e): a for t, e, a in state["val_auroc"]})


def cached_comparison(base: nn.Module, x_sup: torch.Tensor, y_sup: torch.Tensor, x_test: torch.Tensor,
                      y_test: torch.Tensor, cfg, ood: str, strategy: str = "separate", retrain: bool = False,
                      on_epoch: Callable[[int, FinetuneHistory], None] | None = None, progress: bool = False,
                      folder: Path | None = None, quiet: bool = False) -> tuple[MethodComparison, TransductiveSplit]:
    """:func:`compare_methods` on ``ood``'s transductive split, cached in :func:`comparison_path`.

    When the cache file exists (and ``retrain`` is False) the comparison is loaded from it: rows,
    test scores, history, ODIN's parameters and the fine-tuned weights (put into a copy of
    ``base``); ``on_epoch`` is then called once per cached epoch with the history up to it, so a
    live plot shows the same figures as during training. Otherwise it is computed and written
    atomically (:func:`~mcd_helpers.checkpoint.save_checkpoint`), only once complete. A cache
    file that cannot be read is computed again.

    Returns:
        ``(comparison, split)``: the :class:`MethodComparison` and the split it was computed on.
    """
    split = ood_split(cfg, ood, x_test, y_test)
    path = comparison_path(cfg, ood, strategy, folder)
    if path.exists() and not retrain:
        try:
            state = load_checkpoint(path, required=("rows", "scores", "history", "odin", "model"))
            model = copy.deepcopy(base).cpu()
            model.load_state_dict(state["model"])
            hist = FinetuneHistory(**state["history"])
            if on_epoch is not None:  # replay the cached run, epoch by epoch
                per_epoch = len(hist.ce) // max(1, len(hist.val_auroc))
                for e in range(len(hist.val_auroc)):
                    shown = {f.name: getattr(hist, f.name)[:(e + 1) * (per_epoch if f.name != "val_auroc" else 1)]
                             for f in dataclasses.fields(hist) if f.name != "best_epoch"}
                    best = max(range(e + 1), key=lambda i: (hist.val_auroc[i], -i))
                    on_epoch(e, FinetuneHistory(**shown, best_epoch=best))
            if not quiet:
                print(f"loaded the {ood} comparison from {path} (RETRAIN = True computes it again)")
            return MethodComparison(ood, state["rows"], state["scores"], model.to(cfg.device), hist,
                                    _odin_from_state(state["odin"])), split
        except (CorruptCheckpointError, TypeError, RuntimeError) as err:
            print(f"{path} cannot be used ({err}); computing again.")
    comp = compare_methods(base, x_sup, y_sup, split, cfg, ood, strategy, on_epoch=on_epoch, progress=progress)
    save_checkpoint(path, {"rows": comp.rows, "scores": comp.scores, "history": dataclasses.asdict(comp.history),
                           "odin": _odin_to_state(comp.odin), "model": comp.model.state_dict(),
                           "config": cfg.to_dict(), "ood": ood, "strategy": strategy})
    return comp, split


def run_protocol(base: nn.Module, x_sup: torch.Tensor, y_sup: torch.Tensor, x_test: torch.Tensor,
                 y_test: torch.Tensor, cfg, strategy: str = "separate", done: dict | None = None,
                 progress: bool = False, log: Callable[[str], None] | None = print,
                 partial: Path | None = None, cache: bool = False, retrain: bool = False) -> list[dict]:
    """:func:`compare_methods` for each OOD set in ``cfg.ood_sets``; returns all rows.

    Args:
        done: ``{ood: MethodComparison}`` already computed (e.g. a live walkthrough); reused as is.
        log: called with one line per OOD set (``None`` for silence).
        partial: a JSON file that gets each OOD set's rows as soon as they are computed; sets
            already in it are not computed again (an interrupted long run resumes there).
        cache: take each OOD set's comparison from :func:`cached_comparison` (loaded when it was
            computed before with the same settings, else computed and cached); ``retrain=True``
            computes them again.
    """
    finished = json.loads(Path(partial).read_text()) if partial and Path(partial).exists() else {}
    rows = []
    for ood in cfg.ood_sets:
        if ood in finished:
            set_rows = finished[ood]
        else:
            if done and ood in done:
                comp = done[ood]
            elif cache:
                comp = cached_comparison(base, x_sup, y_sup, x_test, y_test, cfg, ood, strategy, retrain,
                                         progress=progress, quiet=log is None)[0]
            else:
                comp = compare_methods(base, x_sup, y_sup, ood_split(cfg, ood, x_test, y_test), cfg, ood,
                                       strategy, progress=progress)
            set_rows = finished[ood] = comp.rows
            if partial:
                atomic_write_json(Path(partial), finished)
        rows += set_rows
        if log:
            log(f"{ood:>16}: " + ", ".join(f"{r['method']} {100 * r['auroc']:.2f}%" for r in set_rows) + " AUROC")
    return rows


def strategy_ablation(base: nn.Module, x_sup: torch.Tensor, y_sup: torch.Tensor, x_test: torch.Tensor,
                      y_test: torch.Tensor, cfg, seeds: Sequence[int], strategies: Sequence[str] = ("separate", "concat"),
                      progress: bool = False, log: Callable[[str], None] | None = print,
                      partial: Path | None = None, known: Sequence[dict] = ()) -> list[dict]:
    """MCD fine-tuned from the same pre-trained ``base`` once per (OOD set, strategy, seed).

    Only fine-tuning depends on the seed (initial weights are ``base``'s); the split and the
    generated OOD sets stay fixed (``cfg.seed`` and ``cfg.split_seed``), so the spread over seeds
    is the spread of fine-tuning alone. ``partial``: a JSON file that gets each run's row as soon
    as it exists; runs already in it are not repeated. ``known``: ``mcd`` rows of runs done
    elsewhere with the same settings (e.g. :func:`compare_methods`' row, which is the run with
    ``seed = cfg.seed``); a run whose (OOD set, strategy, seed) is among them is not repeated.

    Returns:
        one ``mcd`` row per run, with its ``seed`` and ``strategy``.

    Raises:
        ValueError: if fewer than 2 seeds are given (no spread to measure).
    """
    if len(set(seeds)) < 2:
        raise ValueError(f"an ablation needs at least 2 distinct seeds for a std, got {list(seeds)}.")
    finished = json.loads(Path(partial).read_text()) if partial and Path(partial).exists() else {}
    for r in known:
        if r.get("method") == "mcd":
            finished.setdefault(f"{r['ood_dataset']}/{r['strategy']}/{r['seed']}", r)
    rows = []
    for ood in cfg.ood_sets:
        split = None
        for strategy in strategies:
            for seed in seeds:
                key = f"{ood}/{strategy}/{seed}"
                if key not in finished:
                    split = split or ood_split(cfg, ood, x_test, y_test)
                    set_seed(seed)
                    model = copy.deepcopy(base).to(cfg.device)
                    hist = finetune_by_epoch(model, x_sup, y_sup, split, dataclasses.replace(cfg, seed=seed),
                                             strategy, progress=progress)
                    l1_id, l2_id = predict_logits(model, split.test_id_x, cfg.eval_batch_size, cfg.device)
                    l1_ood, l2_ood = predict_logits(model, split.test_ood_x, cfg.eval_batch_size, cfg.device)
                    m = ood_metrics(discrepancy_score(l1_id, l2_id), discrepancy_score(l1_ood, l2_ood))
                    finished[key] = {"id_dataset": cfg.id_dataset, "ood_dataset": ood, "method": "mcd",
                                     "strategy": strategy, "seed": seed, **m,
                                     "id_accuracy": _accuracy(l1_id, split.test_id_y),
                                     "best_val_auroc": max(hist.val_auroc)}
                    if partial:
                        atomic_write_json(Path(partial), finished)
                rows.append(finished[key])
                if log:
                    log(f"{ood:>12} | {strategy:>8} | seed {seed} | AUROC {100 * rows[-1]['auroc']:.2f}% | "
                        f"ID acc. {100 * rows[-1]['id_accuracy']:.2f}%")
    return rows


def summarize_ablation(rows: Sequence[dict], metrics: Sequence[str] = ("auroc", "fpr95", "id_accuracy")) -> list[dict]:
    """Mean and sample std (ddof=1) of each metric per (OOD set, strategy), in input order.

    Returns:
        rows ``{"ood_dataset", "strategy", "n", "<metric>_mean", "<metric>_std", ...}`` (fractions).

    Raises:
        ValueError: if a group has fewer than 2 runs (a sample std needs 2).
    """
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["ood_dataset"], r["strategy"]), []).append(r)
    out = []
    for (ood, strategy), rs in groups.items():
        if len(rs) < 2:
            raise ValueError(f"{ood}/{strategy} has {len(rs)} run(s); a sample std needs at least 2.")
        s = {"ood_dataset": ood, "strategy": strategy, "n": len(rs)}
        for k in metrics:
            v = np.array([r[k] for r in rs], dtype=np.float64)
            s[f"{k}_mean"], s[f"{k}_std"] = float(v.mean()), float(v.std(ddof=1))
        out.append(s)
    return out


def strategy_difference(rows: Sequence[dict], ood: str, metric: str = "auroc", a: str = "concat",
                        b: str = "separate") -> dict:
    """Difference of means ``a - b`` of ``metric`` on ``ood`` over seeds, with Welch's t-test.

    Returns:
        ``{"diff", "se", "t", "p", "n_a", "n_b"}``: the difference of the means (fraction), its
        standard error sqrt(s_a^2/n_a + s_b^2/n_b), Welch's t and two-sided p-value
        (``scipy.stats.ttest_ind(equal_var=False)``). With 3 seeds a side only large effects show.

    Raises:
        ValueError: if a side has fewer than 2 runs.
    """
    from scipy.stats import ttest_ind

    va = np.array([r[metric] for r in rows if r["ood_dataset"] == ood and r["strategy"] == a])
    vb = np.array([r[metric] for r in rows if r["ood_dataset"] == ood and r["strategy"] == b])
    if min(len(va), len(vb)) < 2:
        raise ValueError(f"need at least 2 runs of each strategy on {ood}, got {len(va)} ({a}) and {len(vb)} ({b}).")
    se = math.sqrt(va.var(ddof=1) / len(va) + vb.var(ddof=1) / len(vb))
    test = ttest_ind(va, vb, equal_var=False)
    return {"diff": float(va.mean() - vb.mean()), "se": se, "t": float(test.statistic), "p": float(test.pvalue),
            "n_a": len(va), "n_b": len(vb)}


def config_hash(cfg, drop: Sequence[str] = (), **more) -> str:
    """Short hash of a config's fields (less those named in ``drop``) plus ``more`` (a cache key)."""
    fields = {k: v for k, v in cfg.to_dict().items() if k not in drop}
    blob = json.dumps({**fields, **more}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def cached_rows(path: Path, compute: Callable[[], list[dict]], retrain: bool = False) -> list[dict]:
    """Rows from ``path`` (JSON) when it exists and ``retrain`` is False; else ``compute()``, written atomically."""
    path = Path(path)
    if path.exists() and not retrain:
        try:
            rows = json.loads(path.read_text())
            print(f"loaded {len(rows)} result rows from {path} (set RETRAIN = True to recompute)")
            return rows
        except json.JSONDecodeError:
            print(f"{path} is not valid JSON; computing again.")
    rows = compute()
    atomic_write_json(path, rows)
    return rows
