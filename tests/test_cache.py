"""mcd_helpers.experiments.cache: which settings change which key, the code's version in the key, a
stage computed once and then loaded, and a stale network trained again, saying why."""

import copy
import dataclasses
import functools
import re
import shutil
from pathlib import Path

import pytest
import torch
from pipeline_setup import TINY

from mcd_helpers.data import DEBIAN_FMNIST_DIR, cache_dir
from mcd_helpers.experiments import cache, stages
from mcd_helpers.experiments.cache import cache_key, cached, code_version, settings_key
from mcd_helpers.experiments.config import MCDConfig
from mcd_helpers.experiments.files import save_state
from mcd_helpers.experiments.stages import (
    RunOptions,
    make_split,
    pretrained,
)
from mcd_helpers.models import small_cnn

needs_fmnist = pytest.mark.skipif(
    not DEBIAN_FMNIST_DIR.exists(), reason="dataset-fashion-mnist not installed"
)
QUIET = RunOptions(progress=False, log=None)


def _other(value):
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1
    return value + ("x",) if isinstance(value, tuple) else value + "x"


class ReadRecorder:
    """A config that notes every field read through it; its methods read through it too."""

    def __init__(self, cfg: MCDConfig):
        object.__setattr__(self, "_cfg", cfg)
        object.__setattr__(self, "read", set())

    def __getattr__(self, name):
        method = getattr(MCDConfig, name, None)
        if callable(method):
            return functools.partial(method, self)
        self.read.add(name)
        return getattr(self._cfg, name)


# How to run, not what: read while training, never in a key (rounding at most). Not channels_last:
# TINY has it off, and turning it on trains another network (docs/speed.md), so it is keyed when on.
HOW_TO_RUN = {"device", "num_threads", "eval_batch_size", "checkpoint_every", "compile"}
HOW_TO_RUN |= {"data_on_device", "sync_bn"}
# What the labeled set is made of (read by load_data and make_split, before pre-training)
LABELED_SET = {"id_dataset", "train_subset", "class_split", "protocol"}


def _keyed(stage: str, **more) -> set[str]:
    """The fields whose change changes ``stage``'s key for TINY (a transductive run)."""
    keyed = set()
    for f in dataclasses.fields(MCDConfig):
        changed = copy.copy(TINY)
        setattr(changed, f.name, _other(getattr(TINY, f.name)))
        if cache_key(changed, stage, **more) != cache_key(TINY, stage, **more):
            keyed.add(f.name)
    return keyed


@needs_fmnist
def test_every_field_training_reads_is_in_its_key_and_pretraining_keys_no_other(data, monkeypatch):
    # train for real with a config that records what it is asked; the cache is bypassed
    monkeypatch.setattr(stages, "cached", lambda cfg, stage, compute, *a, **k: compute())
    monkeypatch.setattr(stages, "cache_key", lambda *a, **k: "not read")
    split = make_split(TINY, data, "gaussian")
    pre, fine = ReadRecorder(TINY), ReadRecorder(TINY)
    base = pretrained(pre, split, QUIET)
    stages.finetuned(fine, base, split, "gaussian", "separate", QUIET)
    keyed_pre = _keyed("pretrain")
    keyed_fine = _keyed("finetune", ood="gaussian", strategy="separate")
    assert keyed_pre == (pre.read - HOW_TO_RUN) | LABELED_SET
    # selection picks one of the two weights a fine-tuning keeps: one training, one key
    assert fine.read - HOW_TO_RUN - {"selection"} <= keyed_fine
    assert keyed_pre <= keyed_fine and keyed_fine.isdisjoint(HOW_TO_RUN | {"selection"})


def test_the_pretraining_key_follows_the_labeled_set_not_the_protocols_name():
    a = dataclasses.replace(TINY, class_split="a", n_holdout=100)
    key = {
        p: cache_key(dataclasses.replace(a, protocol=p), "pretrain")
        for p in ("transductive", "disjoint", "unseen-ood")
    }
    # the same labeled set: all but n_holdout
    assert key["disjoint"] == key["unseen-ood"] != key["transductive"]
    disjoint = dataclasses.replace(a, protocol="disjoint")
    for field in ("n_holdout", "split_seed"):  # they choose which images are held out
        assert cache_key(dataclasses.replace(disjoint, **{field: 7}), "pretrain") != key["disjoint"]
    fine = {
        cache_key(TINY, "finetune", ood=o, strategy=s)
        for o in ("gaussian", "digits")
        for s in ("separate", "concat")
    }
    assert len(fine) == 4 and cache_key(TINY, "pretrain") not in fine


def test_under_torchrun_the_world_size_and_sync_bn_enter_the_keys(monkeypatch):
    one = {stage: cache_key(TINY, stage) for stage in ("pretrain", "finetune")}
    synced = copy.copy(TINY)
    synced.sync_bn = True  # a run field: no key in one process
    assert {stage: cache_key(synced, stage) for stage in one} == one
    monkeypatch.setattr("mcd_helpers.experiments.cache.ddp.world", lambda: (0, 2))
    two = {stage: cache_key(TINY, stage) for stage in one}
    assert all(two[s] != one[s] and cache_key(synced, s) not in (one[s], two[s]) for s in one)


# ---- the cache -----------------------------------------------------------------------------------


def _counting():
    calls = []
    return calls, lambda: calls.append(1) or {"value": torch.tensor([float(len(calls))])}


def test_cached_computes_once_then_loads(tmp_data_dir, tmp_path):
    calls, compute = _counting()
    ckpt = tmp_path / "stage.pt"
    ckpt.write_bytes(b"a leftover checkpoint")
    first = cached(TINY, "demo", compute, log=None, checkpoint=ckpt, ood="x")
    path = tmp_data_dir / "cache" / f"demo-{cache_key(TINY, 'demo', ood='x')}.pt"
    assert calls == [1] and "loaded_from" not in first and path.exists() and not ckpt.exists()
    logs = []
    ckpt.write_bytes(b"a leftover of an interrupted run of the cached stage")
    second = cached(TINY, "demo", compute, log=logs.append, checkpoint=ckpt, ood="x")
    assert (
        calls == [1]
        and second["loaded_from"] == str(path)
        and torch.equal(second["value"], first["value"])
    )
    assert not ckpt.exists()  # the cache holds the result: the leftover checkpoint goes too
    assert logs == [
        f"demo: loaded from the cache, {path} (computed earlier in this run or before; --retrain "
        "computes it again)"
    ]
    cached(TINY, "demo", compute, log=None, ood="y")  # another key: computed
    assert calls == [1, 1]


def test_retrain_true_computes_every_time_and_a_set_once_per_file(tmp_data_dir):
    calls, compute = _counting()
    cached(TINY, "demo", compute, log=None)
    assert (
        "loaded_from" not in cached(TINY, "demo", compute, retrain=True, log=None)
        and len(calls) == 2
    )
    seen = set()
    cached(TINY, "demo", compute, retrain=seen, log=None)  # first met in this run: computed again
    again = cached(TINY, "demo", compute, retrain=seen, log=None)  # second time: loaded
    assert len(calls) == 3 and torch.equal(again["value"], torch.tensor([3.0]))
    assert seen == {f"demo-{cache_key(TINY, 'demo')}.pt"}


def test_an_unreadable_cache_file_is_computed_again(tmp_data_dir):
    path = cache_dir() / "cache" / f"demo-{cache_key(TINY, 'demo')}.pt"
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not a checkpoint")
    calls, compute, logs = *_counting(), []
    out = cached(TINY, "demo", compute, log=logs.append)
    assert calls == [1] and "loaded_from" not in out
    assert (
        len(logs) == 1
        and "cannot be read as a checkpoint" in logs[0]
        and logs[0].endswith("Computing it again.")
    )
    # the good file now
    assert torch.equal(cached(TINY, "demo", compute, log=None)["value"], torch.tensor([1.0]))


@needs_fmnist
def test_a_cached_network_of_another_architecture_asks_for_retrain(tmp_data_dir, data):
    split = make_split(TINY, data, "gaussian")
    path = cache_dir() / "cache" / f"pretrain-{cache_key(TINY, 'pretrain')}.pt"
    save_state(path, {"model": small_cnn(1, 10, norm="group").state_dict(), "ce": []})
    with pytest.raises(
        RuntimeError,
        match=rf"the cached network {re.escape(str(path))} does not fit small_cnn \(norm=batch, 1 "
        r"channels, 10 classes\): .* Pass --retrain \(retrain=True\)",
    ):
        pretrained(TINY, split, QUIET)


# ---- the cached stages ---------------------------------------------------------------------------


# ---- the code's version --------------------------------------------------------------------------


def _package_copy(tmp_path) -> Path:
    code = tmp_path / "code"
    shutil.copytree(cache.PACKAGE, code, ignore=shutil.ignore_patterns("__pycache__"))
    return code


def test_the_code_version_follows_the_code_not_its_docstrings_comments_or_layout(tmp_path):
    code = _package_copy(tmp_path)
    before = code_version(code)
    losses = code / "losses.py"
    text = losses.read_text()
    reworded = text.replace('"""MCD\'s losses', '"""The losses of MCD', 1).replace(
        "# (N, K)", "# N x K"
    )
    losses.write_text(
        reworded.replace(
            "    check_logits(logits)\n", "    check_logits(\n        logits\n    )\n", 1
        )
    )
    assert reworded != text and code_version(code) == before
    losses.write_text(text.replace("min=0)", "min=0.0)", 1))  # the hinge's bound, a float now
    assert code_version(code) != before
    # a module outside the training code does not count
    losses.write_text(text)
    (code / "graphs.py").write_text((code / "graphs.py").read_text() + "\nX = 1\n")
    assert code_version(code) == before


def test_the_running_package_keeps_the_version_of_the_code_it_imported(tmp_path, monkeypatch):
    # a long run whose files are edited meanwhile must not label its networks with the edits
    code = _package_copy(tmp_path)
    monkeypatch.setattr(cache, "PACKAGE", code)
    cache._running_version.cache_clear()
    running = code_version()
    losses = code / "losses.py"
    losses.write_text(losses.read_text().replace("min=0)", "min=0.0)", 1))
    assert code_version() == running != code_version(code)  # the files changed, the run did not
    cache._running_version.cache_clear()


@needs_fmnist
def test_a_change_to_the_training_code_trains_again_saying_why(
    tmp_data_dir, tmp_path, monkeypatch, data
):
    code = _package_copy(tmp_path)
    real = cache.code_version
    monkeypatch.setattr(cache, "code_version", lambda: real(code))
    trainings, logs = [], []
    train = stages.train
    monkeypatch.setattr(stages, "train", lambda *a, **k: trainings.append(1) or train(*a, **k))
    split, how = make_split(TINY, data, "gaussian"), RunOptions(progress=False, log=logs.append)
    first = pretrained(TINY, split, how)
    old = f"pretrain-{settings_key(TINY, 'pretrain')}-{real(code)}.pt"
    assert trainings == [1] and (tmp_data_dir / "cache" / old).exists()
    pretrained(TINY, split, how)  # unchanged: loaded
    assert trainings == [1] and "pretrain: loaded from the cache" in logs[-1]
    strategies = code / "strategies.py"
    strategies.write_text(strategies.read_text() + "\nDEFAULT_MARGIN = 1.2\n")  # one statement more
    logs.clear()
    again = pretrained(TINY, split, how)
    assert trainings == [1, 1]
    assert logs[0].startswith(f"pretrain: training it again: the training code changed since {old}")
    for k, v in first.state_dict().items():  # the same code for training: the same network
        assert torch.equal(again.state_dict()[k], v), k
