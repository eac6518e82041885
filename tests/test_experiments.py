"""What notebooks 04-05 show, on tiny models and data, checked against independent computations:
one iteration of fine-tuning written out, the evaluation's rows, the metrics' positive class, the tables.

The end-to-end equality of the notebook path and the command line is in ``test_pipeline.py``;
the notebooks' own claims are their executed asserts (``test_notebooks.py``).
"""
import copy
import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mcd_helpers.data.nearood import ProtocolSplit
from mcd_helpers.data.sets import transductive_split
from mcd_helpers.experiments import pipeline as ex
from mcd_helpers.experiments.config import MCDConfig
from mcd_helpers.experiments.tables import config_markdown, methods_markdown
from mcd_helpers.losses import discrepancy_score, energy_score, entropy, msp_score
from mcd_helpers.metrics import ood_metrics
from mcd_helpers.models import small_cnn
from mcd_helpers.training.batches import LABELED, UNLABELED, Batches
from mcd_helpers.training.loop import finetune, predict_logits, set_seed


def _tiny():
    """A 3-class small_cnn on 8x8 images, 48 labeled images, a split of 24 ID + 24 OOD (8 + 8 validation).

    Returns ``(model, split, cfg)``; ``split`` is a :class:`ProtocolSplit` (transductive).
    """
    g = torch.Generator().manual_seed(0)
    x_sup = torch.randn(48, 1, 8, 8, generator=g)
    y_sup = torch.arange(48) % 3
    x_sup += y_sup.view(-1, 1, 1, 1).float()  # classes differ in mean brightness
    x_id, y_id = x_sup[:24] + 0.1 * torch.randn(24, 1, 8, 8, generator=g), y_sup[:24]
    x_ood = 4 * torch.rand(24, 1, 8, 8, generator=g) - 2
    t = transductive_split(x_id, y_id, x_ood, n_val=8)
    split = ProtocolSplit(x_sup=x_sup, y_sup=y_sup, x_unsup=t.unlabeled().tensors[0], val_id_x=t.val_id_x,
                          val_id_y=t.val_id_y, val_ood_x=t.val_ood_x, test_id_x=t.test_id_x, test_id_y=t.test_id_y,
                          test_ood_x=t.test_ood_x, protocol="transductive")
    cfg = MCDConfig(n_val=8, batch_size_sup=8, batch_size_unsup=8, steps_per_epoch=3, finetune_epochs=1,
                    eval_batch_size=16, finetune_lr=0.05, margin=0.5,
                    extra={"odin_temperatures": (1.0, 10.0), "odin_epsilons": (0.0, 0.01)})
    torch.manual_seed(1)
    return small_cnn(1, 3, width=4), split, cfg


def _one_iteration(model, xs, ys, xu, cfg, detach_f2=True):
    """Notebook 04's ~20 lines: Step A (F2 on detached features), then Step B with two forwards, each
    with its own zero_grad/backward/step on one SGD optimizer. Returns the updated copy of ``model``."""
    net = copy.deepcopy(model).train()
    opt = torch.optim.SGD(net.parameters(), lr=cfg.finetune_lr, momentum=cfg.finetune_momentum,
                          weight_decay=cfg.finetune_weight_decay)
    feat = net.features(xs)
    loss_a = F.cross_entropy(net.F1(feat), ys) + F.cross_entropy(net.F2(feat.detach() if detach_f2 else feat), ys)
    opt.zero_grad()
    loss_a.backward()
    opt.step()
    (l1s, l2s), (l1u, l2u) = net(xs), net(xu)
    gap = (entropy(l1u) - entropy(l2u)).mean()
    loss_b = F.cross_entropy(l1s, ys) + F.cross_entropy(l2s, ys) + torch.clamp(cfg.margin - gap, min=0)
    opt.zero_grad()
    loss_b.backward()
    opt.step()
    return net


def _max_diff(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a.state_dict().values(), b.state_dict().values())
               if x.is_floating_point())


def test_one_iteration_written_out_equals_finetune():
    """The iteration written out, on finetune's first batches (pass 0, batch 0 of the labeled and the
    unlabeled stream), float64: the same weights and buffers as a 1-step run of finetune; another
    batch, or F2 on features that are not detached in Step A, gives other weights."""
    model, split, cfg = _tiny()
    model = model.double()
    split = dataclasses.replace(split, **{k: v.double() for k, v in vars(split).items()
                                          if torch.is_tensor(v) and v.is_floating_point()})
    cfg = dataclasses.replace(cfg, steps_per_epoch=1, finetune_epochs=1)
    sup = Batches(len(split.x_sup), cfg.batch_size_sup, cfg.seed, LABELED)
    i_unl = Batches(len(split.x_unsup), cfg.batch_size_unsup, cfg.seed, UNLABELED).batch(0, 0)
    i_sup = sup.batch(0, 0)
    xs, ys, xu = split.x_sup[i_sup], split.y_sup[i_sup], split.x_unsup[i_unl]
    net = _one_iteration(model, xs, ys, xu, cfg)
    pkg = copy.deepcopy(model)
    finetune(pkg, split.x_sup, split.y_sup, split, cfg, "separate", progress=False)
    for (k, a), b in zip(net.state_dict().items(), pkg.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12, msg=k)
    assert _max_diff(net, model) > 1e-4  # the iteration moved the weights
    i_next = sup.batch(0, 1)
    assert _max_diff(_one_iteration(model, split.x_sup[i_next], split.y_sup[i_next], xu, cfg), pkg) > 1e-6
    assert _max_diff(_one_iteration(model, xs, ys, xu, cfg, detach_f2=False), pkg) > 1e-6


def test_which_metrics_depend_on_the_positive_class():
    """AUROC is the same with ID or OOD positive; FPR95 is not (OpenOOD / pytorch-ood make OOD positive);
    AUPR-In with ID positive is AUPR-Out with the roles swapped. Checked against scikit-learn and by hand."""
    from sklearn.metrics import average_precision_score, roc_auc_score

    s_id = np.array([0.1, 0.2, 0.3, 0.35, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9] * 2)  # 20 ID scores
    s_ood = np.array([0.25, 0.45, 0.55, 0.65, 0.75, 0.85, 0.95, 1.0, 1.1, 1.2])  # 10 OOD scores
    m = ood_metrics(s_id, s_ood)
    s, is_ood = np.r_[s_id, s_ood], np.r_[np.zeros(20), np.ones(10)]
    assert m["auroc"] == pytest.approx(roc_auc_score(is_ood, s), abs=1e-12)
    assert m["auroc"] == pytest.approx(roc_auc_score(1 - is_ood, -s), abs=1e-12)
    # ID positive: accept 95% of ID (19 of 20: score <= 0.9 covers all 20, <= 0.8 only 18) -> t = 0.9;
    # OOD accepted at t = 0.9: 0.25, 0.45, 0.55, 0.65, 0.75, 0.85 -> 6 of 10
    assert m["fpr95"] == pytest.approx(0.6)
    # OOD positive: flag 95% of OOD (10 of 10 needs score >= 0.25) -> ID flagged: 0.3 ... 0.9 x 2 = 16 of 20
    ood_positive_fpr95 = np.mean(s_id >= 0.25)
    assert ood_positive_fpr95 == pytest.approx(0.8) and abs(m["fpr95"] - ood_positive_fpr95) > 0.1
    assert m["aupr_in"] == pytest.approx(average_precision_score(1 - is_ood, -s))
    assert m["aupr_out"] == pytest.approx(average_precision_score(is_ood, s)) and m["aupr_in"] != m["aupr_out"]


def _val_auroc(model, split):
    s_id = discrepancy_score(*predict_logits(model, split.val_id_x))
    s_ood = discrepancy_score(*predict_logits(model, split.val_ood_x))
    return ood_metrics(s_id, s_ood)["auroc"]


def test_epochs_call_back_and_keep_the_best_epoch():
    model, split, cfg = _tiny()
    cfg = dataclasses.replace(cfg, finetune_epochs=4)
    seen = []
    set_seed(0)
    hist = finetune(model, split.x_sup, split.y_sup, split, cfg, "concat", progress=False,
                    on_epoch=lambda e, h: seen.append((e, len(h.val_auroc), len(h.ce))))
    assert seen == [(e, e + 1, 3 * (e + 1)) for e in range(4)]
    assert hist.best_epoch == int(np.argmax(hist.val_auroc))
    assert _val_auroc(model, split) == pytest.approx(max(hist.val_auroc), abs=1e-12)


def test_evaluate_rows_match_independent_scores():
    model, split, cfg = _tiny()
    tuned = copy.deepcopy(model)
    set_seed(0)
    finetune(tuned, split.x_sup, split.y_sup, split, cfg, "separate", progress=False)
    before = copy.deepcopy(model.state_dict())
    rows, scores = ex.evaluate(cfg, model, {"separate": tuned}, split, "noise")
    assert [(r["method"], r["strategy"]) for r in rows] == [("msp", None), ("odin", None), ("energy", None),
                                                           ("mcd", "separate")]
    assert set(scores) == {"msp", "odin", "energy", "mcd:separate"}
    for k, v in model.state_dict().items():  # the pre-trained network is left as it was (ODIN's input gradients)
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)
    with torch.no_grad():
        l_id, l_ood = model.eval()(split.test_id_x)[0], model(split.test_ood_x)[0]
    by = {r["method"]: r for r in rows}
    assert by["msp"]["auroc"] == pytest.approx(ood_metrics(msp_score(l_id), msp_score(l_ood))["auroc"], abs=1e-9)
    assert by["energy"]["fpr95"] == pytest.approx(ood_metrics(energy_score(l_id), energy_score(l_ood))["fpr95"], abs=1e-9)
    assert (by["odin"]["odin_temperature"], by["odin"]["odin_epsilon"]) in {(1.0, 0.0), (1.0, 0.01), (10.0, 0.0), (10.0, 0.01)}
    base_acc = (l_id.argmax(1) == split.test_id_y).float().mean().item()
    assert all(by[m]["id_accuracy"] == pytest.approx(base_acc) for m in ("msp", "odin", "energy"))
    with torch.no_grad():
        t_id, t_ood = tuned.eval()(split.test_id_x), tuned(split.test_ood_x)
    mcd = ood_metrics(discrepancy_score(*t_id), discrepancy_score(*t_ood))
    assert by["mcd"]["auroc"] == pytest.approx(mcd["auroc"], abs=1e-9)
    assert by["mcd"]["aupr_out"] == pytest.approx(mcd["aupr_out"], abs=1e-9)
    assert by["mcd"]["id_accuracy"] == pytest.approx((t_id[0].argmax(1) == split.test_id_y).float().mean().item())
    # the "before" scores of notebook 04: the pre-trained network as an MCD model, MCD only
    rows0, scores0 = ex.evaluate(cfg, model, {"pre-trained": model}, split, "noise", methods=("mcd",))
    assert [r["strategy"] for r in rows0] == ["pre-trained"] and set(scores0) == {"mcd:pre-trained"}
    with torch.no_grad():
        torch.testing.assert_close(scores0["mcd:pre-trained"][0], discrepancy_score(*model(split.test_id_x)))


def test_evaluate_without_ood_labels_uses_odins_published_setting():
    model, split, cfg = _tiny()
    rows, _ = ex.evaluate(dataclasses.replace(cfg, selection="last-epoch"), model, {}, split, "noise",
                          methods=("odin",))
    assert [(r["odin_temperature"], r["odin_epsilon"]) for r in rows] == [(1000.0, 0.0014)]


def test_methods_markdown_marks_the_best():
    rows = [{"ood_dataset": "digits", "method": m, "auroc": a, "fpr95": f, "id_accuracy": 0.9}
            for m, a, f in (("msp", 0.9, 0.5), ("odin", 0.95, 0.3), ("energy", 0.96, 0.2), ("mcd", 0.999, 0.01))]
    line = next(l for l in methods_markdown(rows).splitlines() if l.startswith("| digits"))
    assert line == "| digits | 90.00 | 95.00 | 96.00 | **99.90** | 50.00 | 30.00 | 20.00 | **1.00** | 90.00 | 90.00 |"


def test_config_markdown_lists_the_settings():
    from mcd_helpers.experiments.presets import get_preset

    def table(cfg):
        return {l.split(" | ")[0][2:]: l.split(" | ")[1].rstrip(" |") for l in config_markdown(cfg).splitlines()[2:]}

    lines = table(get_preset("notebook-quick"))
    assert lines["training images (labeled)"] == "15,000"
    assert lines["fine-tuning"] == "3 epochs × 30 steps, SGD lr 0.005, weight decay 0.0001"
    assert lines["batch, labeled + unlabeled"] == "64 + 64" and lines["margin m"] == "1.2 nats"
    assert lines["ODIN grid"] == "T ∈ [1000.0], ε ∈ [0.0, 0.001, 0.002, 0.004]"
    default = table(MCDConfig())
    assert default["training images (labeled)"] == default["ID test images"] == "all"
    assert default["fine-tuning"].startswith("1 epoch × one pass over the labeled set")
