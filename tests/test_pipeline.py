"""The one pipeline (mcd_helpers.experiments.pipeline): the command line and the notebooks get the
same numbers; live and cached epochs reach ``on_epoch`` alike; the cache is hit; bad settings are refused.

Fashion-MNIST comes from /usr/share/datasets/fashion-mnist (Debian's dataset-fashion-mnist), which
the loader reads whatever $MCD_DATA_DIR is, so each test can give the pipeline an empty cache folder
of its own (never the suite's shared one, never the user's).
"""
import dataclasses
import json

import numpy as np
import pytest
import torch

from mcd_helpers.__main__ import main
from mcd_helpers.data.sets import DEBIAN_FMNIST_DIR
from mcd_helpers.errors import ConfigError
from mcd_helpers.experiments import pipeline
from mcd_helpers.experiments.config import MCDConfig
from mcd_helpers.experiments.pipeline import evaluate, finetuned, load_data, make_split, pretrained
from mcd_helpers.experiments.presets import get_preset
from mcd_helpers.metrics import METRIC_KEYS

pytestmark = pytest.mark.skipif(not DEBIAN_FMNIST_DIR.exists(), reason="dataset-fashion-mnist not installed")

METRICS = ("auroc", "fpr95", "detection_error", "aupr_in", "aupr_out", "id_accuracy")

# notebook-quick restricted to one OOD set and one strategy, cut down so the test takes about a
# minute; both paths get exactly these settings (3 fine-tuning epochs, as the preset has).
SMALL = dict(train_subset=3000, test_subset=600, n_val=200, ood_size=400, steps_per_epoch=10)
FLAGS = ["--train-subset", "3000", "--test-subset", "600", "--n-val", "200", "--ood-size", "400",
         "--steps-per-epoch", "10"]


def _cache_files(root):
    return sorted(p.name for p in (root / "cache").glob("*.pt"))


def _snapshot(epoch, hist):
    """What ``on_epoch`` was shown, copied (the live history object keeps growing)."""
    return (epoch, list(hist.ce), list(hist.dis), list(hist.gap), list(hist.step_a), list(hist.val_auroc),
            hist.best_epoch)


@pytest.mark.slow
def test_command_line_and_notebook_path_give_identical_metrics(tmp_path, monkeypatch):
    """Issue 11's must-show: one preset through ``python -m mcd_helpers reproduce`` and through the
    calls notebook 04 makes, each from its own empty cache, every metric of every row equal to 1e-6."""
    # (a) the command line, its own cache
    monkeypatch.setenv("MCD_DATA_DIR", str(tmp_path / "cache-cli"))
    out = tmp_path / "cli"
    assert main(["reproduce", "--preset", "notebook-quick", "--ood-sets", "gaussian", "--strategies", "separate",
                 *FLAGS, "--out", str(out), "--quiet"]) == 0
    cli_rows = json.loads((out / "results.json").read_text())
    assert len(_cache_files(tmp_path / "cache-cli")) == 2  # one pre-training, one fine-tuning

    # (b) notebook 04's calls, another empty cache: everything is trained again
    root = tmp_path / "cache-notebook"
    monkeypatch.setenv("MCD_DATA_DIR", str(root))
    cfg = get_preset("notebook-quick", ood_sets=("gaussian",), strategies=("separate",), **SMALL)
    assert cfg.finetune_epochs == 3
    logs, epochs = [], []
    data = load_data(cfg)
    split = make_split(cfg, data, "gaussian")
    base = pretrained(cfg, split, retrain=False, progress=False, log=logs.append)
    model, hist, _ = finetuned(cfg, base, split, "gaussian", "separate", progress=False, log=logs.append,
                               on_epoch=lambda e, h: epochs.append(e))
    rows, _ = evaluate(cfg, base, {"separate": model}, split, "gaussian")
    assert not any("loaded from the cache" in line for line in logs), logs
    assert epochs == [0, 1, 2] and len(hist.ce) == 3 * 10
    assert _cache_files(root) == _cache_files(tmp_path / "cache-cli")  # same stages, same keys

    assert [(r["method"], r["strategy"]) for r in cli_rows] == [(r["method"], r["strategy"]) for r in rows] == [
        ("msp", None), ("odin", None), ("energy", None), ("mcd", "separate")]
    for a, b in zip(cli_rows, rows):
        for k in METRICS:
            assert abs(a[k] - b[k]) <= 1e-6, (a["method"], k, a[k], b[k])
    # not vacuous: fine-tuning changed the network (F1's ID accuracy moved) and the rows differ by method
    acc = {r["method"]: r["id_accuracy"] for r in rows}
    assert acc["mcd"] != acc["msp"] and len({r["auroc"] for r in rows}) == 4


TINY = MCDConfig(train_subset=600, test_subset=300, n_val=50, ood_size=200, pretrain_epochs=1, pretrain_milestones=(),
                 pretrain_batch_size=64, steps_per_epoch=4, finetune_epochs=3, batch_size_sup=32,
                 batch_size_unsup=32, strategies=("separate",), ood_sets=("gaussian",),
                 extra={"odin_temperatures": (1000.0,), "odin_epsilons": (0.0,)})


@pytest.fixture
def tiny(tmp_data_dir):
    """TINY's data, gaussian split and pre-trained network, in an empty cache of this test's own."""
    data = load_data(TINY)
    split = make_split(TINY, data, "gaussian")
    return data, split, pretrained(TINY, split, progress=False, log=None), tmp_data_dir


def test_on_epoch_is_called_live_each_epoch_and_replayed_identically_from_the_cache(tiny, monkeypatch):
    data, split, base, root = tiny
    live = []
    model, hist, seconds = finetuned(TINY, base, split, "gaussian", "separate", progress=False, log=None,
                                     on_epoch=lambda e, h: live.append(_snapshot(e, h)))
    # once per epoch, with the history up to that epoch (4 steps an epoch, one AUROC an epoch)
    assert [s[0] for s in live] == [0, 1, 2]
    for e, ce, dis, gap, step_a, val, best in live:
        assert len(ce) == len(dis) == len(gap) == len(step_a) == 4 * (e + 1) and len(val) == e + 1
        assert best == int(np.argmax(val))  # the best epoch so far (the first of equal ones)
    assert live[-1][1:] == _snapshot(0, hist)[1:]
    files = _cache_files(root)

    monkeypatch.setattr(pipeline, "finetune", lambda *a, **k: pytest.fail("fine-tuned again instead of loading"))
    replay = []
    again, hist2, seconds2 = finetuned(TINY, base, split, "gaussian", "separate", progress=False, log=None,
                                       on_epoch=lambda e, h: replay.append(_snapshot(e, h)))
    assert replay == live and hist2 == hist and seconds2 == seconds
    assert _cache_files(root) == files
    for k, v in model.state_dict().items():
        torch.testing.assert_close(again.state_dict()[k], v, rtol=0, atol=0)


def test_the_cache_is_hit_on_a_second_call_and_keyed_by_the_settings(tiny, monkeypatch):
    data, split, base, root = tiny
    files = _cache_files(root)
    assert len(files) == 1 and files[0].startswith("pretrain-")
    calls = []
    real = pipeline.pretrain
    monkeypatch.setattr(pipeline, "pretrain", lambda *a, **k: calls.append(1) or real(*a, **k))
    # a second call loads: no training, no new file, the same weights
    same = pretrained(TINY, split, progress=False, log=None)
    assert calls == [] and _cache_files(root) == files
    for k, v in base.state_dict().items():
        torch.testing.assert_close(same.state_dict()[k], v, rtol=0, atol=0)
    # fields that only change fine-tuning, or say how to run, share the pre-trained network
    pretrained(dataclasses.replace(TINY, margin=0.5, finetune_epochs=1, eval_batch_size=7), split, progress=False,
               log=None)
    assert calls == [] and _cache_files(root) == files
    # retrain=True trains again and replaces the file (the seed is fixed: the same weights)
    again = pretrained(TINY, split, retrain=True, progress=False, log=None)
    assert calls == [1] and _cache_files(root) == files
    for k, v in base.state_dict().items():
        torch.testing.assert_close(again.state_dict()[k], v, rtol=0, atol=0)
    # another margin or number of epochs is another fine-tuning: a file each
    for cfg in (TINY, dataclasses.replace(TINY, margin=0.5), dataclasses.replace(TINY, finetune_epochs=1)):
        finetuned(cfg, base, split, "gaussian", "separate", progress=False, log=None)
    assert len([f for f in _cache_files(root) if f.startswith("finetune-")]) == 3


def test_bad_settings_are_refused_with_the_reason(tiny):
    data, split, base, _ = tiny
    with pytest.raises(ValueError, match=r"strategy must be one of separate, concat, split-bn, recalibrate; got 'both'"):
        finetuned(TINY, base, split, "gaussian", "both", progress=False, log=None)
    with pytest.raises(ConfigError, match=r"strategies must be a non-empty subset of"):
        dataclasses.replace(TINY, strategies=("both",))
    with pytest.raises(ConfigError, match=r"OOD set 'heldout' \(held-out classes\) needs a class_split"):
        make_split(TINY, data, "heldout")
    disjoint = dataclasses.replace(TINY, class_split="a", protocol="disjoint")
    with pytest.raises(ConfigError, match=r"the OOD set 'gaussian' runs under the transductive protocol only") as err:
        make_split(disjoint, data, "gaussian")
    assert err.value.field == "protocol"


def test_metric_keys_are_the_ones_compared():
    # the must-show compares every metric a row has: if metrics.py grows one, METRICS must too
    assert set(METRIC_KEYS) | {"id_accuracy"} == set(METRICS)


def test_one_run_serves_both_selections_and_recalibrate_shares_the_separate_run(tiny, monkeypatch):
    """selection only picks which cached weights a fine-tuning keeps; ``recalibrate`` is the
    ``separate`` run with its BatchNorm statistics recomputed (one cache file for both)."""
    from mcd_helpers.norms import recalibrate_bn

    data, split, base, root = tiny
    best, h_best, _ = finetuned(TINY, base, split, "gaussian", "separate", progress=False, log=None)
    monkeypatch.setattr(pipeline, "finetune", lambda *a, **k: pytest.fail("trained again instead of loading"))
    last_cfg = dataclasses.replace(TINY, selection="last-epoch")
    last, h_last, _ = finetuned(last_cfg, base, split, "gaussian", "separate", progress=False, log=None)
    recal, _, _ = finetuned(last_cfg, base, split, "gaussian", "recalibrate", progress=False, log=None)
    assert len([f for f in _cache_files(root) if f.startswith("finetune-")]) == 1
    # the histories are one run's: the validation AUROC is recorded under both selections
    assert h_best.val_auroc == h_last.val_auroc and len(h_last.val_auroc) == TINY.finetune_epochs
    assert h_best.best_epoch == int(np.argmax(h_best.val_auroc)) and h_last.best_epoch == TINY.finetune_epochs - 1
    # the cache file holds both weights; each selection loads its own
    (path,) = (root / "cache").glob("finetune-*.pt")
    state = torch.load(path, weights_only=True)
    for model, which in ((best, "best"), (last, "last")):
        for k, v in model.state_dict().items():
            assert torch.equal(state[which][k], v.cpu()), (which, k)
    # recalibrate = the last-epoch model with running statistics recomputed on the first labeled images
    by_hand = recalibrate_bn(last, split.x_sup[:pipeline.RECALIBRATION_IMAGES], batch_size=TINY.batch_size_sup)
    for k, v in by_hand.state_dict().items():
        torch.testing.assert_close(recal.state_dict()[k], v, rtol=0, atol=0)
    assert not torch.equal(recal.state_dict()["G.1.running_mean"], finetuned(
        last_cfg, base, split, "gaussian", "separate", progress=False, log=None)[0].state_dict()["G.1.running_mean"])


def test_the_pretrain_key_follows_the_labeled_set_not_the_protocol_name():
    from mcd_helpers.experiments.cache import cache_key

    a = dataclasses.replace(TINY, class_split="a")
    keys = {p: cache_key(dataclasses.replace(a, protocol=p), "pretrain") for p in ("transductive", "disjoint",
                                                                                      "unseen-ood")}
    assert keys["disjoint"] == keys["unseen-ood"] != keys["transductive"]  # same labeled set, another
    # the transductive labeled set is every ID training image: n_holdout does not enter its key
    assert cache_key(dataclasses.replace(a, n_holdout=7), "pretrain") == keys["transductive"]
    assert cache_key(dataclasses.replace(a, protocol="disjoint", n_holdout=7), "pretrain") != keys["disjoint"]
    # the model selection never enters a key: both selections come from one fine-tuning
    assert cache_key(a, "finetune", ood="heldout", strategy="separate") == cache_key(
        dataclasses.replace(a, selection="last-epoch"), "finetune", ood="heldout", strategy="separate")


def test_retrain_with_a_set_trains_each_stage_once_recalibrate_included(tiny, monkeypatch):
    data, split, base, root = tiny
    calls = []
    real = pipeline.finetune
    monkeypatch.setattr(pipeline, "finetune", lambda *a, **k: calls.append(a[5]) or real(*a, **k))
    finetuned(TINY, base, split, "gaussian", "separate", progress=False, log=None)
    assert calls == ["separate"]
    retrained = set()  # one run with --retrain: recalibrate (first) trains the separate run again, once
    for s in ("recalibrate", "separate", "recalibrate"):
        finetuned(TINY, base, split, "gaussian", s, retrain=retrained, progress=False, log=None)
    assert calls == ["separate", "separate"] and len(retrained) == 1


def test_bad_strategy_norm_pairs_and_protocols_for_far_sets_are_refused():
    with pytest.raises(ConfigError, match=r"split-bn and recalibrate change BatchNorm statistics and need "
                                          r"norm='batch'; with norm='group'") as err:
        dataclasses.replace(TINY, norm="group", strategies=("separate", "recalibrate"))
    assert err.value.field == "strategies"
    cfg = dataclasses.replace(TINY, class_split="a", protocol="disjoint", ood_sets=("heldout", "digits"))
    with pytest.raises(ConfigError, match=r"protocol 'disjoint' applies to the held-out classes only; OOD set\(s\) "
                                          r"\['digits'\] run under the transductive protocol"):
        cfg.check_ood_sets()
    dataclasses.replace(cfg, ood_sets=("heldout",)).check_ood_sets()  # the held-out classes alone: fine
