"""The pipeline (mcd_helpers/pipeline.py): splits, cache keys, the cache, the cached stages, model
selection, the strategies that change BatchNorm statistics, and evaluate's rows.

Real Fashion-MNIST (Debian's dataset-fashion-mnist, found whatever $MCD_DATA_DIR is) at toy size
(``TINY``); every cache is a tmp folder of the test or the module, so no stale entry can make a test
pass. Metrics are recomputed from the returned scores by brute force (every pair, every threshold).
"""
import copy
import dataclasses
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from sklearn.metrics import average_precision_score, roc_auc_score

from mcd_helpers import pipeline
from mcd_helpers.baselines import odin_scores
from mcd_helpers.config import PRETRAIN_FIELDS, RUN_FIELDS, MCDConfig
from mcd_helpers.data import DEBIAN_FMNIST_DIR, FMNIST_STD, cache_dir, load_ood
from mcd_helpers.errors import ConfigError
from mcd_helpers.files import save_state
from mcd_helpers.metrics import METRIC_KEYS
from mcd_helpers.models import small_cnn
from mcd_helpers.norms import PerSourceBatchNorm
from mcd_helpers.pipeline import cache_key, cached, finetuned, load_data, make_split, pretrained, selected_epoch
from mcd_helpers.splits import CLASS_SPLITS
from mcd_helpers.train import History

pytestmark = pytest.mark.skipif(not DEBIAN_FMNIST_DIR.exists(), reason="dataset-fashion-mnist not installed")

TINY = MCDConfig(train_subset=600, test_subset=400, n_val=40, ood_size=200, pretrain_epochs=1, pretrain_milestones=(),
                 steps_per_epoch=3, finetune_epochs=2, batch_size_sup=32, batch_size_unsup=32, eval_batch_size=500,
                 odin_temperatures=(1000.0,), odin_epsilons=(0.0, 0.002), ood_sets=("gaussian",),
                 strategies=("separate", "concat"))
LAST = dataclasses.replace(TINY, selection="last-epoch")


def brute_metrics(s_id, s_ood) -> dict:
    """The five metrics of mcd_helpers.metrics by brute force: ID positive, accepted as ID when score <= t,
    every unique score a threshold; AUROC over every (ID, OOD) pair, ties 1/2; AUPRs as step sums."""
    s_id, s_ood = np.asarray(s_id, dtype=np.float64), np.asarray(s_ood, dtype=np.float64)
    t = np.unique(np.r_[s_id, s_ood])  # ascending
    n_id_acc, n_ood_acc = (s_id[None] <= t[:, None]).sum(1), (s_ood[None] <= t[:, None]).sum(1)
    tpr, fpr = n_id_acc / len(s_id), n_ood_acc / len(s_ood)
    first = np.argmax(n_id_acc >= 0.95 * len(s_id) - 1e-9)
    tpr0 = np.r_[0.0, tpr]
    n_ood_flag, n_flag = (s_ood[None] >= t[:, None]).sum(1), (np.r_[s_id, s_ood][None] >= t[:, None]).sum(1)
    rec_out = n_ood_flag / len(s_ood)
    pairs = (s_ood[:, None] > s_id[None]) + 0.5 * (s_ood[:, None] == s_id[None])
    return {"fpr95": fpr[first], "detection_error": min(0.5, np.min(0.5 * (1 - tpr) + 0.5 * fpr)),
            "auroc": pairs.mean(), "aupr_in": np.sum(np.diff(tpr0) * n_id_acc / (n_id_acc + n_ood_acc)),
            "aupr_out": np.sum((rec_out - np.r_[rec_out[1:], 0.0]) * n_ood_flag / n_flag)}


def _history(val_auroc, steps: int = 2) -> History:
    n = steps * len(val_auroc)
    return History(ce=list(range(n)), dis=[0.5] * n, gap=[0.1] * n, step_a=[1.0] * n, val_auroc=list(val_auroc))


@pytest.fixture(scope="module")
def data():
    return load_data(TINY)


@pytest.fixture(scope="module")
def run(tmp_path_factory, data):
    """run_ood_set on TINY (two strategies, both selections) in a module cache of its own; ``calls`` is the
    strategy of each training (None: pre-training)."""
    env, spy, calls = pytest.MonkeyPatch(), pytest.MonkeyPatch(), []
    env.setenv("MCD_DATA_DIR", str(tmp_path_factory.mktemp("pipeline-cache")))
    real = pipeline.train
    spy.setattr(pipeline, "train", lambda *a, **k: calls.append(a[3]) or real(*a, **k))
    res = pipeline.run_ood_set(TINY, data, "gaussian", selections=("ood-labels", "last-epoch"), progress=False, log=None)
    spy.undo()
    yield res, calls
    env.undo()


@pytest.fixture
def no_training(monkeypatch):
    monkeypatch.setattr(pipeline, "train", lambda *a, **k: pytest.fail("trained instead of loading from the cache"))


def _nearest(x, pool):
    """Each image's distance to the nearest image of ``pool`` (0: it is one of them)."""
    return torch.cdist(x.flatten(1), pool.flatten(1), compute_mode="donot_use_mm_for_euclid_dist").min(1).values


# ---- make_split -------------------------------------------------------------------------------------

def test_a_far_set_with_a_class_split_keeps_the_id_classes_relabelled(data):
    ids = CLASS_SPLITS["b"][0]  # (0, 2, 3, 5, 7, 9): 7 -> 4, 9 -> 5
    split = make_split(dataclasses.replace(TINY, class_split="b"), data, "gaussian")
    keep = torch.isin(data.y_train, torch.tensor(ids))
    assert torch.equal(split.x_sup, data.x_train[keep])
    assert split.y_sup.tolist() == [ids.index(c) for c in data.y_train[keep].tolist()]
    n_id_test = int(torch.isin(data.y_test, torch.tensor(ids)).sum())
    assert (len(split.test_id_x), len(split.test_ood_x)) == (n_id_test - 40, 200 - 40)
    gauss = load_ood("gaussian", 200, TINY.seed)
    assert _nearest(split.test_ood_x, gauss).max() == 0  # every test OOD image is a gaussian one


@pytest.mark.parametrize("protocol", ["transductive", "unseen-ood"])
def test_the_held_out_classes_are_the_test_ood_set_under_each_protocol(data, protocol):
    cfg = dataclasses.replace(TINY, class_split="a", protocol=protocol, n_holdout=100)
    split = make_split(cfg, data, "heldout")
    in_ood = torch.isin(data.y_test, torch.tensor(CLASS_SPLITS["a"][1]))
    n_id_te, n_ood_te = int((~in_ood).sum()), int(in_ood.sum())
    assert (len(split.test_id_x), len(split.test_ood_x)) == (n_id_te - 40, n_ood_te - 40)
    assert split.y_sup.max() == 5 and split.test_id_y.max() == 5
    n_id_tr = int((data.y_train <= 5).sum())
    if protocol == "transductive":
        assert len(split.x_sup) == n_id_tr and len(split.x_unsup) == len(split.test_id_x) + len(split.test_ood_x)
    else:  # 100 ID training images held out; the unlabeled OOD part from the digits, the test's ID:OOD ratio
        n_ood = round(100 * n_ood_te / n_id_te)
        assert len(split.x_sup) == n_id_tr - 100 and len(split.x_unsup) == (100 - 40) + (n_ood - 40)
        assert _nearest(split.x_unsup[60:], load_ood("digits")).max() == 0


@pytest.mark.parametrize("cfg, ood, field, match", [
    (TINY, "heldout", "class_split", r"OOD set 'heldout' needs a class split: --class-split a, b, c or 012345/6789\."),
    (dataclasses.replace(TINY, class_split="a", protocol="disjoint"), "gaussian", "protocol",
     r"'gaussian' needs --protocol transductive; 'disjoint' is for 'heldout' only\."),
])
def test_make_split_refuses_what_cannot_be_split(data, cfg, ood, field, match):
    with pytest.raises(ConfigError, match=match) as err:
        make_split(cfg, data, ood)
    assert err.value.field == field


# ---- cache keys -------------------------------------------------------------------------------------

def _other(value):
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1
    return value + ("x",) if isinstance(value, tuple) else value + "x"


@pytest.mark.parametrize("name", [f.name for f in dataclasses.fields(MCDConfig)])
def test_which_fields_change_which_key(name):
    """Pre-training: the fields of PRETRAIN_FIELDS, where a transductive run's labeled set ignores n_holdout and
    split_seed; fine-tuning: every field but RUN_FIELDS (how to run, not what); channels_last=True both."""
    changed = copy.copy(TINY)
    setattr(changed, name, _other(getattr(TINY, name)))
    layout = name == "channels_last"  # a run field that enters every key when on (another network)
    pre = name in PRETRAIN_FIELDS and name not in ("n_holdout", "split_seed") or layout
    assert (cache_key(changed, "pretrain") != cache_key(TINY, "pretrain")) == pre
    assert (cache_key(changed, "finetune", ood="gaussian", strategy="separate")
            != cache_key(TINY, "finetune", ood="gaussian", strategy="separate")) == (name not in RUN_FIELDS or layout)


def test_the_pretraining_key_follows_the_labeled_set_not_the_protocols_name():
    a = dataclasses.replace(TINY, class_split="a", n_holdout=100)
    key = {p: cache_key(dataclasses.replace(a, protocol=p), "pretrain") for p in ("transductive", "disjoint", "unseen-ood")}
    assert key["disjoint"] == key["unseen-ood"] != key["transductive"]  # the same labeled set: all but n_holdout
    disjoint = dataclasses.replace(a, protocol="disjoint")
    for field in ("n_holdout", "split_seed"):  # they choose which images are held out
        assert cache_key(dataclasses.replace(disjoint, **{field: 7}), "pretrain") != key["disjoint"]
    fine = {cache_key(TINY, "finetune", ood=o, strategy=s) for o in ("gaussian", "digits") for s in ("separate", "concat")}
    assert len(fine) == 4 and cache_key(TINY, "pretrain") not in fine


def test_under_torchrun_the_world_size_and_sync_bn_enter_the_keys(monkeypatch):
    one = {stage: cache_key(TINY, stage) for stage in ("pretrain", "finetune")}
    synced = copy.copy(TINY)
    synced.sync_bn = True  # a run field: no key in one process
    assert {stage: cache_key(synced, stage) for stage in one} == one
    monkeypatch.setattr(pipeline.ddp, "world", lambda: (0, 2))
    two = {stage: cache_key(TINY, stage) for stage in one}
    assert all(two[s] != one[s] and cache_key(synced, s) not in (one[s], two[s]) for s in one)


# ---- the cache --------------------------------------------------------------------------------------

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
    assert calls == [1] and second["loaded_from"] == str(path) and torch.equal(second["value"], first["value"])
    assert not ckpt.exists()  # the cache holds the result: the leftover checkpoint goes too
    assert logs == [f"demo: loaded from the cache, {path} (computed earlier in this run or before; --retrain "
                    "computes it again)"]
    cached(TINY, "demo", compute, log=None, ood="y")  # another key: computed
    assert calls == [1, 1]


def test_retrain_true_computes_every_time_and_a_set_once_per_file(tmp_data_dir):
    calls, compute = _counting()
    cached(TINY, "demo", compute, log=None)
    assert "loaded_from" not in cached(TINY, "demo", compute, retrain=True, log=None) and len(calls) == 2
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
    assert len(logs) == 1 and "cannot be read as a checkpoint" in logs[0] and logs[0].endswith("Computing it again.")
    assert torch.equal(cached(TINY, "demo", compute, log=None)["value"], torch.tensor([1.0]))  # the good file now


def test_a_cached_network_of_another_architecture_asks_for_retrain(tmp_data_dir, data):
    split = make_split(TINY, data, "gaussian")
    path = cache_dir() / "cache" / f"pretrain-{cache_key(TINY, 'pretrain')}.pt"
    save_state(path, {"model": small_cnn(1, 10, norm="group").state_dict(), "ce": []})
    with pytest.raises(RuntimeError, match=rf"the cached network {re.escape(str(path))} does not fit small_cnn \(norm=batch, 1 "
                                           r"channels, 10 classes\): .* Pass --retrain \(retrain=True\)"):
        pretrained(TINY, split, progress=False, log=None)


# ---- the cached stages ------------------------------------------------------------------------------

def test_run_ood_set_trains_each_stage_once_and_returns_rows_for_each_selection(run):
    res, calls = run
    assert calls == [None, "separate", "concat"]  # one fine-tuning serves both selections
    methods = [("msp", None), ("odin", None), ("energy", None), ("mcd", "separate"), ("mcd", "concat")]
    assert [(r["selection"], r["method"], r["strategy"]) for r in res.rows] == [
        (sel, m, s) for sel in ("ood-labels", "last-epoch") for m, s in methods]
    n_id, n_ood = len(res.split.test_id_x), len(res.split.test_ood_x)
    for r, (s_id, s_ood) in zip(res.rows, res.row_scores, strict=True):  # row_scores aligned with rows
        assert (len(s_id), len(s_ood)) == (n_id, n_ood)
        for k, v in brute_metrics(s_id, s_ood).items():
            assert r[k] == pytest.approx(v, abs=1e-12), (r["selection"], r["method"], r["strategy"], k)
    for r in (r for r in res.rows if r["method"] == "mcd"):
        h = res.histories[r["strategy"]]
        want = len(h.val_auroc) - 1 if r["selection"] == "last-epoch" else int(np.argmax(h.val_auroc))  # first best
        assert (r["selected_epoch"], r["val_auroc"]) == (want, h.val_auroc[want])
    first, second = res.rows[:5], res.rows[5:]
    for m in (0, 2):  # MSP and energy score the same pre-trained network under both selections
        assert {k: v for k, v in first[m].items() if k != "selection"} == {k: v for k, v in second[m].items()
                                                                          if k != "selection"}


def test_evaluates_scores_and_accuracy_recomputed_from_the_networks(run):
    res, _ = run  # res.scores: the last selection's (last-epoch)
    split, base = res.split, copy.deepcopy(res.models["base"]).eval()
    with torch.no_grad():
        l1 = base(split.test_id_x)[0], base(split.test_ood_x)[0]
        for name, fn in (("msp", lambda z: 1 - F.softmax(z, 1).max(1).values), ("energy", lambda z: -z.logsumexp(1))):
            for got, logits in zip(res.scores[name], l1):
                torch.testing.assert_close(got, fn(logits), rtol=1e-5, atol=1e-6)
        for s in ("separate", "concat"):
            a, b = copy.deepcopy(res.models[s]).eval()(split.test_id_x)
            torch.testing.assert_close(res.scores[f"mcd:{s}"][0], (F.softmax(a, 1) - F.softmax(b, 1)).abs().sum(1),
                                       rtol=1e-5, atol=1e-6)
            row = next(r for r in res.rows[5:] if r["strategy"] == s)
            assert row["id_accuracy"] == pytest.approx((a.argmax(1) == split.test_id_y).double().mean().item(), abs=1e-7)
    acc = (l1[0].argmax(1) == split.test_id_y).double().mean().item()
    assert all(r["id_accuracy"] == pytest.approx(acc, abs=1e-7) for r in res.rows if r["method"] != "mcd")


def test_odin_takes_the_best_validation_pair_of_the_grid_or_the_published_one_without_ood_labels(run, monkeypatch):
    res, _ = run
    split, base = res.split, res.models["base"]
    by = {r["selection"]: r for r in res.rows if r["method"] == "odin"}
    assert (by["last-epoch"]["odin_temperature"], by["last-epoch"]["odin_epsilon"]) == (1000.0, 0.0014)  # not in the grid
    val = {(t, e): brute_metrics(*(odin_scores(base, x, t, [e], FMNIST_STD)[0] for x in (split.val_id_x, split.val_ood_x)))
           ["auroc"] for t in TINY.odin_temperatures for e in TINY.odin_epsilons}
    chosen = (by["ood-labels"]["odin_temperature"], by["ood-labels"]["odin_epsilon"])
    assert chosen in val and val[chosen] == pytest.approx(max(val.values()), abs=1e-12)
    # what the test scores are computed with, and the networks are left as they were (ODIN's input gradients)
    seen, real = [], pipeline.odin_scores
    monkeypatch.setattr(pipeline, "odin_scores", lambda m, x, t, eps, **kw: seen.append((t, eps, kw["pixel_std"]))
                        or real(m, x, t, eps, **kw))
    before = copy.deepcopy(base.state_dict())
    pipeline.evaluate(LAST, base, {}, split, "gaussian", methods=("odin",))
    assert seen == [(1000.0, [0.0014], FMNIST_STD)] * 2  # the ID and the OOD test images
    for k, v in base.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_the_baselines_score_the_id_images_once_per_pretrained_network(run, monkeypatch):
    """Another OOD set with the same ID images and network: only its OOD images are scored again, and the rows
    are those of a computation from scratch; another network scores the ID images again."""
    res, _ = run
    split, base = res.split, res.models["base"]
    other = dataclasses.replace(split, val_ood_x=split.val_ood_x * 0.5, test_ood_x=split.test_ood_x * 0.5)
    seen, real = [], pipeline.odin_scores
    monkeypatch.setattr(pipeline, "odin_scores", lambda m, x, *a, **k: seen.append(x.data_ptr()) or real(m, x, *a, **k))
    for cfg in (TINY, LAST):  # the grid searched; ODIN's published pair
        pipeline.evaluate(cfg, base, {}, split, "gaussian", methods=("msp", "odin", "energy"))
        seen.clear()
        rows, _ = pipeline.evaluate(cfg, base, {}, other, "gaussian", methods=("msp", "odin", "energy"))
        id_side = {split.val_id_x.data_ptr(), split.test_id_x.data_ptr()}
        assert seen and not id_side & set(seen)
        pipeline._MEMO.clear()
        assert rows == pipeline.evaluate(cfg, base, {}, other, "gaussian", methods=("msp", "odin", "energy"))[0]
    changed = copy.deepcopy(base)
    with torch.no_grad():
        changed.F1.bias[0] += 1.0
    seen.clear()
    pipeline.evaluate(LAST, changed, {}, split, "gaussian", methods=("odin",))
    assert split.test_id_x.data_ptr() in seen


def test_the_memo_hands_out_copies_that_a_caller_may_change(run):
    """Scores changed in place by a caller (a notebook normalising them) leave the next OOD set's rows alone."""
    res, _ = run
    first, scores = pipeline.evaluate(LAST, res.models["base"], {}, res.split, "gaussian", methods=("odin",))
    scores["odin"][0].zero_()  # the ID test images' ODIN scores
    again, _ = pipeline.evaluate(LAST, res.models["base"], {}, res.split, "gaussian", methods=("odin",))
    assert again == first and again[0]["auroc"] < 1.0


def test_a_network_is_scored_and_recalibrated_once_per_weights(run, monkeypatch, no_training):
    """A fine-tuned network that two selections both keep: its logits and its recalibrated statistics are computed
    once and equal a computation from scratch; a network with one weight changed is computed again."""
    res, _ = run
    logits, recals = [], []
    for name, log in (("predict_logits", logits), ("recalibrate_bn", recals)):
        real = getattr(pipeline, name)
        monkeypatch.setattr(pipeline, name, lambda *a, real=real, log=log, **k: log.append(1) or real(*a, **k))
    pipeline._MEMO.clear()
    tuned = lambda: finetuned(LAST, res.models["base"], res.split, "gaussian", "recalibrate", progress=False, log=None)[0]
    models = [tuned(), tuned()]
    assert len(recals) == 1
    for k, v in models[0].state_dict().items():
        assert torch.equal(models[1].state_dict()[k], v), k
    kept = copy.deepcopy(models[0].state_dict())
    with torch.no_grad():  # a caller changes the statistics it was handed: the memo's are its own
        models[0].train()(res.split.x_unsup[:64])
    assert not torch.equal(models[0].state_dict()["G.1.running_mean"], kept["G.1.running_mean"])
    for k, v in tuned().state_dict().items():
        assert torch.equal(v, kept[k]), k
    models[0].load_state_dict(kept)
    first, scores = pipeline.evaluate(LAST, res.models["base"], {"recalibrate": models[0]}, res.split, "gaussian", ("mcd",))
    assert len(logits) == 4  # the pre-trained and the fine-tuned network, each on the ID and the OOD test images
    again = pipeline.evaluate(LAST, res.models["base"], {"recalibrate": models[1]}, res.split, "gaussian", ("mcd",))[0]
    assert len(logits) == 4 and again == first
    pipeline._MEMO.clear()
    assert pipeline.evaluate(LAST, res.models["base"], {"recalibrate": models[1]}, res.split, "gaussian",
                             ("mcd",))[0] == first and len(logits) == 8
    with torch.no_grad():
        models[1].F2.bias[0] += 1.0
    changed = pipeline.evaluate(LAST, res.models["base"], {"recalibrate": models[1]}, res.split, "gaussian", ("mcd",))[1]
    assert len(logits) == 10  # the pre-trained network's logits come from the memo
    assert not torch.equal(changed["mcd:recalibrate"][0], scores["mcd:recalibrate"][0])


def test_the_memo_tells_the_sources_of_a_split_bn_network_apart(run):
    """A split-bn network evaluated with its second source's statistics is scored again, not taken from the memo."""
    from mcd_helpers.norms import use_source
    res, _ = run
    model, _, _ = finetuned(LAST, res.models["base"], res.split, "gaussian", "split-bn", progress=False, log=None)
    pipeline._MEMO.clear()
    source0 = pipeline.evaluate(LAST, res.models["base"], {"split-bn": model}, res.split, "gaussian", ("mcd",))[1]
    with use_source(model, 1):
        source1 = pipeline.evaluate(LAST, res.models["base"], {"split-bn": model}, res.split, "gaussian", ("mcd",))[1]
        pipeline._MEMO.clear()
        fresh = pipeline.evaluate(LAST, res.models["base"], {"split-bn": model}, res.split, "gaussian", ("mcd",))[1]
    assert not torch.equal(source1["mcd:split-bn"][0], source0["mcd:split-bn"][0])
    assert torch.equal(source1["mcd:split-bn"][0], fresh["mcd:split-bn"][0])


def test_a_second_call_loads_the_pretrained_network(run, no_training):
    res, _ = run
    logs = []
    again = pretrained(TINY, res.split, progress=False, log=logs.append)
    assert len(logs) == 1 and "pretrain: loaded from the cache" in logs[0]
    for k, v in res.models["base"].state_dict().items():
        assert torch.equal(again.state_dict()[k], v), k


def test_one_cache_file_holds_both_selections_weights(run, no_training):
    res, _ = run
    for cfg, which in ((TINY, "best"), (LAST, "last")):
        model, hist, _ = finetuned(cfg, res.models["base"], res.split, "gaussian", "concat", progress=False, log=None)
        assert hist.val_auroc == res.histories["concat"].val_auroc
        key = cache_key(TINY, "finetune", ood="gaussian", strategy="concat")
        saved = torch.load(cache_dir() / "cache" / f"finetune-{key}.pt", weights_only=True)[which]
        for k, v in model.state_dict().items():
            assert torch.equal(v, saved[k]), (which, k)


@pytest.mark.parametrize("selection, want", [("ood-labels", [0, 1, 1, 1]), ("last-epoch", [0, 1, 2, 3])])
def test_selected_epoch_is_the_first_best_validation_auroc_or_the_last_epoch(selection, want):
    h = _history([0.5, 0.8, 0.8, 0.7])
    assert [selected_epoch(h, selection, upto) for upto in range(4)] == want
    assert selected_epoch(h, selection) == want[-1]


def test_selected_epoch_refuses_an_epoch_outside_the_history():
    for upto in (2, -1):
        with pytest.raises(ValueError, match=rf"epoch {upto} is not in the history's 2 validated epochs\."):
            selected_epoch(_history([0.5, 0.8]), "ood-labels", upto)
    with pytest.raises(ValueError, match=r"epoch -1 is not in the history's 0 validated epochs"):  # nothing validated
        selected_epoch(_history([]), "last-epoch")


def test_selected_epoch_refuses_an_unknown_selection():
    with pytest.raises(ConfigError, match=r"selection must be one of ood-labels, last-epoch, got 'oracle'"):
        selected_epoch(_history([0.5]), "oracle")


def _snapshot(epoch, h):
    return epoch, list(h.ce), list(h.dis), list(h.gap), list(h.step_a), list(h.val_auroc), h.best_epoch


def test_on_epoch_is_called_once_per_epoch_live_and_replayed_from_the_cache(run, monkeypatch):
    res, _ = run
    cfg = dataclasses.replace(TINY, margin=0.5, finetune_epochs=3)  # another fine-tuning: trained here
    live, replay = [], []
    model, hist, seconds = finetuned(cfg, res.models["base"], res.split, "gaussian", "separate", progress=False,
                                     log=None, on_epoch=lambda e, h: live.append(_snapshot(e, h)))
    assert [s[0] for s in live] == [0, 1, 2]
    for e, ce, dis, gap, step_a, val, best in live:  # the history up to that epoch; the epoch kept so far
        assert [len(v) for v in (ce, dis, gap, step_a, val)] == [3 * (e + 1)] * 4 + [e + 1]
        assert best == max(range(e + 1), key=lambda i: (val[i], -i))
    assert live[-1][1:] == _snapshot(0, hist)[1:]
    monkeypatch.setattr(pipeline, "train", lambda *a, **k: pytest.fail("fine-tuned again instead of loading"))
    again, hist2, seconds2 = finetuned(cfg, res.models["base"], res.split, "gaussian", "separate", progress=False,
                                       log=None, on_epoch=lambda e, h: replay.append(_snapshot(e, h)))
    assert replay == live and hist2 == hist and seconds2 == seconds
    for k, v in model.state_dict().items():
        assert torch.equal(again.state_dict()[k], v), k


def _bn_average(model, x, batch_size):
    """Per BatchNorm layer, the mean over batches of ``x`` of its input's batch mean and unbiased variance."""
    net, seen, hooks = copy.deepcopy(model).train(), {}, []
    for name, m in net.named_modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            hooks.append(m.register_forward_pre_hook(lambda m, inp, name=name: seen.setdefault(name, []).append(
                (inp[0].mean((0, 2, 3)), inp[0].var((0, 2, 3), unbiased=True)))))
    with torch.no_grad():
        for chunk in x.split(batch_size):
            net(chunk)  # train mode: each layer normalises with the batch's statistics, whatever its buffers
    return {n: (torch.stack([m for m, _ in v]).mean(0), torch.stack([s for _, s in v]).mean(0), len(v))
            for n, v in seen.items()}


def test_recalibrate_is_separates_run_with_statistics_from_the_labeled_images(run, no_training):
    res, _ = run
    separate = res.models["separate"]  # the last selection's: last-epoch
    recal, hist, _ = finetuned(LAST, res.models["base"], res.split, "gaussian", "recalibrate", progress=False, log=None)
    assert hist.val_auroc == res.histories["separate"].val_auroc
    want = _bn_average(separate, res.split.x_sup, TINY.batch_size_sup)  # 600 images: 19 batches, the last of 24
    assert len(want) == 3
    rs, ss = recal.state_dict(), separate.state_dict()
    for k, v in ss.items():
        layer, _, buf = k.rpartition(".")
        if layer in want:
            if buf in ("running_mean", "running_var"):
                torch.testing.assert_close(rs[k], want[layer][0 if buf == "running_mean" else 1], rtol=1e-5, atol=1e-6)
                assert not torch.allclose(rs[k], v, rtol=1e-3), k  # not the separate run's statistics
                continue
            if buf == "num_batches_tracked":
                assert int(rs[k]) == want[layer][2] == 19
                continue
        assert torch.equal(rs[k], v), k  # every weight is the separate run's


def test_split_bn_fine_tunes_a_copy_with_statistics_per_source(run):
    res, _ = run
    base = res.models["base"]
    before = copy.deepcopy(base.state_dict())
    model, _, _ = finetuned(LAST, base, res.split, "gaussian", "split-bn", progress=False, log=None)
    layers = [m for m in model.modules() if isinstance(m, PerSourceBatchNorm)]
    assert len(layers) == 3 and not any(isinstance(m, torch.nn.BatchNorm2d) for m in model.modules())
    # pre-training: 600 // 128 = 4 batches; then 2 epochs x 3 steps, each Step A and Step B's labeled forward on
    # source 0 and Step B's unlabeled forward on source 1
    for m in layers:
        assert m.num_batches_tracked.tolist() == [4 + 2 * 6, 4 + 6]
        assert not torch.allclose(m.running_mean[0], m.running_mean[1])
    for k, v in base.state_dict().items():  # the pre-trained network is not changed
        assert torch.equal(v, before[k]), k


def test_the_brute_force_metrics_agree_with_a_hand_count_and_with_scikit_learn():
    s_id = [0.1, 0.2, 0.3, 0.35, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9] * 2
    s_ood = [0.25, 0.45, 0.55, 0.65, 0.75, 0.85, 0.95, 1.0, 1.1, 1.2]
    m = brute_metrics(s_id, s_ood)
    assert set(m) == set(METRIC_KEYS)
    # 95% of ID (19 of 20) first accepted at t = 0.9, where 6 of 10 OOD are accepted; at best half the errors is 0.3
    assert (m["fpr95"], m["detection_error"]) == (pytest.approx(0.6), pytest.approx(0.3))
    rng = np.random.default_rng(0)
    s_id, s_ood = rng.integers(0, 8, 50) / 4, rng.integers(3, 12, 30) / 4  # many ties
    m, s, is_ood = brute_metrics(s_id, s_ood), np.r_[s_id, s_ood], np.r_[np.zeros(50), np.ones(30)]
    assert m["auroc"] == pytest.approx(roc_auc_score(is_ood, s), abs=1e-12)
    assert m["aupr_in"] == pytest.approx(average_precision_score(1 - is_ood, -s), abs=1e-12)
    assert m["aupr_out"] == pytest.approx(average_precision_score(is_ood, s), abs=1e-12)
