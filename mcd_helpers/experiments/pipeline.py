"""One OOD set end to end: the one driver of ``reproduce``, the benchmark and the notebooks' rerun
widget. :func:`run_ood_set` takes a split (:func:`~mcd_helpers.experiments.stages.make_split`)::

    base = pretrained(cfg, split)                            # stages: cached
    model, hist, seconds = finetuned(cfg, base, split, ood, strategy)    # per strategy, cached
    rows, scores = evaluate(cfg, base, {strategy: model}, split, ood)    # per model selection
"""

import copy
import dataclasses
from typing import Callable, Sequence

from ..splits import Split
from ..strategies import STRATEGIES
from .evaluation import METHODS, evaluate, timed
from .stages import RECALIBRATION_SOURCES, RunOptions, finetuned, pretrained, recalibrated


@dataclasses.dataclass
class Result:
    """What :func:`run_ood_set` gives: ``rows`` of every selection (MCD rows also carry the selected
    epoch's ``val_auroc``, ``selected_epoch`` and ``finetune_seconds``) and each row's
    ``(id_scores, ood_scores)`` in ``row_scores``; of the last selection the ``scores`` by name, the
    ``models`` (``"base"`` and each strategy) and ``histories``; the ``split``; and the wall-clock
    ``seconds`` of each stage (a stage loaded from the cache counts its loading; "evaluation"
    without ODIN's search)."""

    rows: list
    row_scores: list
    scores: dict
    models: dict
    histories: dict
    split: Split
    seconds: dict = dataclasses.field(default_factory=dict)


def _mcd_fields(row: dict, hist, seconds: float) -> None:
    """An MCD row's selected epoch, its validation AUROC, the steps up to it and the training
    time."""
    steps = len(hist.ce) // len(hist.val_auroc) * (hist.best_epoch + 1)
    row.update(val_auroc=hist.val_auroc[hist.best_epoch], selected_epoch=hist.best_epoch)
    row.update(finetune_seconds=seconds, finetune_steps=steps)


def run_ood_set(
    cfg,
    split: Split,
    ood: str,
    selections: Sequence[str] | None = None,
    methods: Sequence[str] = METHODS,
    how: RunOptions = RunOptions(),
    on_epoch: Callable | None = None,
    recalibrated_rows: Sequence[str] = (),
) -> Result:
    """The pre-trained network, a fine-tuning per strategy of ``cfg.strategies``, evaluated under
    each selection (default ``cfg.selection``; all from the same runs).
    ``on_epoch(strategy, epoch, history)`` when given.

    Every row carries ``model`` and ``eval_stats``, the BatchNorm statistics it was evaluated with
    (the strategy's ``eval_stats``: ``"running"``, ``"per-source"`` or ``"recalibrated"``); for
    each source of ``recalibrated_rows`` (:data:`~.stages.RECALIBRATION_SOURCES`) one more MCD row
    per strategy evaluated with running statistics on a BatchNorm network: a copy with the
    statistics recomputed on that source (:func:`recalibrated`), timed as stage "recalibration".
    MCD rows carry ``finetune_steps``, the steps up to the selected epoch.
    """
    # once each
    how = dataclasses.replace(how, retrain=set() if how.retrain is True else how.retrain)
    rows, row_scores, seconds = [], [], {}
    with timed(seconds, "pre-training"):
        base = pretrained(cfg, split, how)
    for i, selection in enumerate(selections or (cfg.selection,)):
        c = dataclasses.replace(cfg, selection=selection)
        tuned, hists, secs = {}, {}, {}  # by strategy: network, history, training seconds
        # later selections load the same runs
        quiet = dataclasses.replace(how, log=None) if i else how
        for s in cfg.strategies if "mcd" in methods else ():
            shown = None if on_epoch is None or i else (lambda e, h, s=s: on_epoch(s, e, h))
            with timed(seconds, f"fine-tuning {s}"):
                tuned[s], hists[s], secs[s] = finetuned(c, base, split, ood, s, quiet, shown)
        with timed(seconds, "evaluation"):
            found, scores = evaluate(c, base, tuned, split, ood, methods, seconds)
        for r in found:
            stats = "running" if r["method"] != "mcd" else STRATEGIES[r["strategy"]].eval_stats
            r.update(model=cfg.model, eval_stats=stats)
        row_scores += [
            scores[f"mcd:{r['strategy']}" if r["method"] == "mcd" else r["method"]] for r in found
        ]
        running = [s for s in tuned if STRATEGIES[s].eval_stats == "running"]
        for source in recalibrated_rows if cfg.norm == "batch" and running else ():
            with timed(seconds, "recalibration"):
                again = {
                    s: recalibrated(c, copy.deepcopy(tuned[s]), split, source) for s in running
                }
            more, more_scores = evaluate(c, base, again, split, ood, ("mcd",))
            stats = RECALIBRATION_SOURCES[source]
            found += [{**r, "model": cfg.model, "eval_stats": stats} for r in more]
            row_scores += [more_scores[f"mcd:{r['strategy']}"] for r in more]
        for r in (r for r in found if r["method"] == "mcd"):
            _mcd_fields(r, hists[r["strategy"]], secs[r["strategy"]])
        rows += found
    seconds["evaluation"] = round(seconds["evaluation"] - seconds.get("odin search", 0.0), 2)
    return Result(rows, row_scores, scores, {"base": base, **tuned}, hists, split, seconds)
