"""The one cache: load-or-compute, keyed by one hash of the settings that change the result.

Every stage of every run goes through :func:`load_or_compute`: the command line, the notebooks,
torchrun and the benchmark. A stage's file is ``<cache root>/cache/<stage>-<key>.pt`` where
``key = cache_key(cfg, stage, **more)``: a hash of the config fields that change the stage's
result (pre-training: :data:`~mcd_helpers.experiments.config.PRETRAIN_FIELDS`; later stages: every
field but :data:`~mcd_helpers.experiments.config.RUN_FIELDS`), of ``more`` (the OOD set, the
strategy), and of the world size and SyncBatchNorm under torchrun (W ranks compute other numbers).
Files are written atomically by rank 0 once complete and read with ``torch.load(weights_only=True)``.

The cache root is ``$MCD_DATA_DIR``, else ``~/.cache/mcd_helpers``; when it is read-only the
files go to ``$MCD_CACHE_DIR`` (see :func:`mcd_helpers.data.files.writable_cache_root`).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Callable

from ..data.files import data_roots, writable_cache_root
from ..errors import CorruptCheckpointError
from ..training.checkpoint import load_checkpoint, save_checkpoint
from ..training.distributed import is_main_process, on_rank0_first, world
from .config import PRETRAIN_FIELDS, RUN_FIELDS

__all__ = ["cache_key", "cache_path", "load_or_compute"]


def cache_key(cfg, stage: str, **more) -> str:
    """A 16-hex-digit hash of what ``stage``'s result depends on (see the module docstring).

    ``stage == "pretrain"`` hashes :data:`PRETRAIN_FIELDS` only, with the protocol reduced to
    what the labeled set depends on: every ID training image (transductive; the split settings are
    left out) or those left after ``n_holdout`` were held out (disjoint and unseen-ood share one
    network); any other stage hashes every field but :data:`RUN_FIELDS`.
    """
    fields = cfg.to_dict()
    if stage == "pretrain":
        # the labeled set is all ID training images (transductive) or those left after n_holdout
        # went to the unlabeled pool (disjoint and unseen-ood alike: one network for both)
        holdout = cfg.protocol != "transductive"
        fields = {k: fields[k] for k in PRETRAIN_FIELDS
                  if k != "protocol" and (holdout or k not in ("n_holdout", "split_seed"))}
        fields["labeled"] = "holdout" if holdout else "all"
    else:
        fields = {k: v for k, v in fields.items() if k not in RUN_FIELDS}
    w = world()[1]
    if w > 1:
        fields.update(world_size=w, sync_bn=cfg.sync_bn)
    blob = json.dumps({"stage": stage, **fields, **more}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def cache_path(cfg, stage: str, **more) -> Path:
    """Where ``stage``'s result is written: ``<writable cache root>/cache/<stage>-<key>.pt``."""
    return writable_cache_root()[0] / "cache" / f"{stage}-{cache_key(cfg, stage, **more)}.pt"


def load_or_compute(cfg, stage: str, compute: Callable[[], dict], retrain: bool | set = False,
                    log: Callable[[str], None] | None = print, **more) -> dict:
    """``stage``'s result: loaded from the cache when there (and ``retrain`` is False), else ``compute()``.

    ``retrain``: ``False`` loads what is cached; ``True`` computes again; a set (one per run, e.g.
    ``python -m mcd_helpers reproduce --retrain``) computes each cache file again once: the first
    time its name is met it is computed and added to the set, later calls load it.

    ``compute`` returns a checkpoint-safe dict (tensors, numbers, strings, lists, dicts), written
    atomically by rank 0. Under torchrun rank 0 decides whether the cache is used, so all ranks
    compute or none does. A file that cannot be read is computed again (and replaced). A loaded
    result carries ``"loaded_from"`` (the file's path); a computed one does not.

    Raises:
        whatever ``compute`` raises; NotWritableError when no cache folder can be written.
    """
    path = cache_path(cfg, stage, **more)
    name = path.name
    if isinstance(retrain, set):
        again, _ = name not in retrain, retrain.add(name)
        retrain = again
    found = None if retrain else on_rank0_first(
        lambda: next((p for p in [r / "cache" / name for r in data_roots()] + [path] if p.exists()), None))
    if found is not None:
        try:
            state = load_checkpoint(found)
        except CorruptCheckpointError as err:
            if log:
                log(f"{err} Computing it again.")
        else:
            if log:
                log(f"{stage}: loaded from the cache, {found} (retrain=True / --retrain computes it again)")
            return {**state, "loaded_from": str(found)}
    state = compute()
    if is_main_process():
        save_checkpoint(path, {**state, "stage": stage, "key": cache_key(cfg, stage, **more)})
    return state
