"""Where a stage's result is kept: ``<cache_dir>/cache/<stage>-<settings>-<code>.pt``.

``settings`` hashes the fields of the config the stage depends on (:func:`settings_key`), ``code``
the modules that train a network (:func:`code_version`: their code with docstrings and comments
left out, so a reworded docstring or a new layout keeps the cache). After a change to the training
code (a ``git pull``, an edit) a stage is computed again instead of loading a network that older
code trained, and the log line says why. Files are written atomically by rank 0 and read with
``weights_only=True`` (:mod:`mcd_helpers.experiments.files`); ``make clean`` leaves the cache alone.
"""

import ast
import functools
import hashlib
import json
from pathlib import Path
from typing import Callable

from ..data import cache_dir, data_dir
from . import ddp
from .config import PRETRAIN_FIELDS, RUN_FIELDS
from .files import load_state, save_state

PACKAGE = Path(__file__).resolve().parents[1]
# The modules whose code decides what a trained network is (the config's values enter the settings)
TRAINING_CODE = (
    *("models.py", "losses.py", "strategies.py", "norms.py", "data.py", "splits.py"),
    *("experiments/loop.py", "experiments/stages.py", "experiments/ddp.py"),
)


def _code_of(source: str) -> str:
    """``source``'s syntax tree without its docstrings, as text: comments and layout do not
    count."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            if isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
                node.body = body[1:] or [ast.Pass()]
    return ast.dump(tree)


@functools.lru_cache(maxsize=8)
def _hash_files(files: tuple[tuple[str, str, int, int], ...]) -> str:
    h = hashlib.sha256()
    for name, path, _, _ in files:  # (the modification time and size only key this memo)
        h.update(name.encode() + _code_of(Path(path).read_text()).encode())
    return h.hexdigest()[:16]


def code_version(root: Path | None = None, modules=TRAINING_CODE) -> str:
    """16 hex digits of a hash of ``modules`` (paths under ``root``), read as code.

    ``root=None`` is the package this process runs, hashed once, at the first call, and kept: a
    long run whose files are edited meanwhile keeps labelling its networks with the code it
    imported, not with the edited files (a run once did the latter, and its networks could no
    longer be found by their code). Another ``root`` is read again whenever its files change.

    Raises:
        FileNotFoundError: a module is missing. SyntaxError: one does not parse.
    """
    if root is None:
        return _running_version(PACKAGE, tuple(modules))
    files = []
    for name in modules:
        stat = (Path(root) / name).stat()
        files.append((name, str(Path(root) / name), stat.st_mtime_ns, stat.st_size))
    return _hash_files(tuple(files))


@functools.lru_cache(maxsize=None)
def _running_version(package: Path, modules: tuple[str, ...]) -> str:
    """:func:`code_version` of the running package: once per process."""
    return code_version(package, modules)


def settings_key(cfg, stage: str, **more) -> str:
    """16 hex digits of a hash of the settings ``stage``'s result depends on.

    Pre-training hashes :data:`~mcd_helpers.experiments.config.PRETRAIN_FIELDS` with the protocol
    reduced to what the labeled set is (every ID training image, or those left after
    ``n_holdout``: disjoint and unseen-ood share a network); the other stages every field but
    :data:`~mcd_helpers.experiments.config.RUN_FIELDS`; plus ``more`` (the OOD set, the strategy),
    ``channels_last`` when on, and, under torchrun, the world size and SyncBatchNorm.
    """
    fields = {k: v for k, v in cfg.to_dict().items() if k not in RUN_FIELDS}
    fields["amp"] = cfg.resolved_amp()  # what trains: "auto" is bf16 on one machine, not another
    if stage == "pretrain":  # the protocol reduced to what the labeled set is
        held = cfg.protocol != "transductive"
        skip = ("protocol",) if held else ("protocol", "n_holdout", "split_seed")
        fields = {k: fields[k] for k in PRETRAIN_FIELDS if k not in skip}
        fields["labeled"] = "holdout" if held else "all"
    # NHWC trains another network (docs/speed.md); off, keys stay as they were
    if cfg.channels_last:
        fields["channels_last"] = True
    if ddp.world()[1] > 1:
        fields.update(world_size=ddp.world()[1], sync_bn=cfg.sync_bn)
    blob = json.dumps({"stage": stage, **fields, **more}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def cache_key(cfg, stage: str, **more) -> str:
    """``<settings>-<code>``: :func:`settings_key` and :func:`code_version`."""
    return f"{settings_key(cfg, stage, **more)}-{code_version()}"


def _stale(stage: str, name: str, folders: list[Path]) -> str | None:
    """The log line when a file of the same settings but older training code is cached, else
    None."""
    settings, code = name[len(stage) + 1 : -3].split("-")
    older = sorted({p.name for f in folders for p in f.glob(f"{stage}-{settings}-*.pt")})
    if not older:
        return None
    other = older[0][len(stage) + len(settings) + 2 : -3]
    return (
        f"{stage}: training it again: the training code changed since {older[0]} was computed "
        f"with the same settings (code {other}, now {code})"
    )


def cached(
    cfg,
    stage: str,
    compute: Callable[[], dict],
    retrain: bool | set = False,
    log=print,
    checkpoint: Path | None = None,
    **more,
) -> dict:
    """``stage``'s result from the cache, else ``compute()`` (written by rank 0; the stage's
    ``checkpoint`` is deleted then). ``retrain``: False loads what is cached, True computes again,
    a set (one per run, ``--retrain``) computes each file the first time its name is met. An
    unreadable file is computed again. A loaded result carries ``"loaded_from"``.
    """
    name = f"{stage}-{cache_key(cfg, stage, **more)}.pt"
    log = log or (lambda msg: None)
    if isinstance(retrain, set):  # --retrain: each file computed again the first time it is met
        first = name not in retrain
        retrain.add(name)
        retrain = first
    folders = [data_dir() / "cache", cache_dir() / "cache"]
    found = None
    if not retrain:
        found = ddp.rank0_first(
            lambda: next((f / name for f in folders if (f / name).exists()), None)
        )
    state = None
    if found is not None:
        try:
            state = {**load_state(found), "loaded_from": str(found)}
            log(
                f"{stage}: loaded from the cache, {found} (computed earlier in this run or before; "
                "--retrain computes it again)"
            )
        except RuntimeError as err:  # unreadable (load_state's message names the file)
            log(f"{err} Computing it again.")
    if state is None:
        if not retrain and found is None and (why := _stale(stage, name, folders)):
            log(why)
        state = compute()
        if ddp.is_main():
            save_state(cache_dir() / "cache" / name, state)
    if checkpoint is not None and ddp.is_main():
        checkpoint.unlink(missing_ok=True)  # the cache holds the result now (also a leftover's)
    return state
