"""The paper's rows, our results beside them, and the presets that encode the paper's protocol."""
import math
import re
from pathlib import Path

import matplotlib
import pytest

matplotlib.use("Agg")

from mcd_helpers.experiments import paper
from mcd_helpers.__main__ import main
from mcd_helpers.experiments.config import MCDConfig
from mcd_helpers.experiments.paper import beside_paper, beside_paper_markdown, paper_rows, plot_beside_paper
from mcd_helpers.experiments.presets import PRESETS, describe_preset, get_preset

REFERENCE = Path(__file__).resolve().parents[2] / "shared" / "reference" / "MCD.md"


def _reference_table():
    """Parse the reported table of the reference notes: {ood: {metric: (odin, eloc, mcd)}}."""
    keys = {"FPR at 95% TPR": "fpr95", "Detection error": "detection_error", "AUROC": "auroc"}
    lines = REFERENCE.read_text().splitlines()
    start = next(i for i, l in enumerate(lines) if l.startswith("| OOD | FPR at 95% TPR"))
    header = [c.strip() for c in lines[start].strip("|").split("|")]
    table = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        table[cells[0]] = {keys[h]: tuple(float("nan") if v.strip() == "–" else float(v)
                                          for v in cell.split("/"))
                           for h, cell in zip(header[1:], cells[1:])}
    return table


@pytest.mark.skipif(not REFERENCE.exists(), reason="the project's reference notes are not next to the repository")
def test_paper_rows_match_the_reference_notes():
    table = _reference_table()
    assert set(table) == set(paper.PAPER_OOD_SETS)
    for row in paper.PAPER_ROWS:
        i = ("odin", "eloc", "mcd").index(row["method"])
        for k in paper.PAPER_METRICS:
            expected = table[row["ood"]][k][i]
            assert (math.isnan(expected) and math.isnan(row[k])) or row[k] == expected, (row, k)


def test_paper_rows_have_every_cell_once():
    assert len(paper.PAPER_ROWS) == 5 * 3
    assert len(paper_rows("mcd")) == 5 and all(r["method"] == "mcd" for r in paper_rows("mcd"))
    assert paper.UNOFFICIAL_ROWS[0]["auroc"] == 99.83 and paper.UNOFFICIAL_ROWS[0]["ood"] == "TINr"
    with pytest.raises(ValueError, match="odin"):
        paper_rows("msp")


def _ours(ood, method, auroc, fpr95=0.01, det=0.02, id_dataset="cifar10", strategy=None):
    return {"id_dataset": id_dataset, "ood_dataset": ood, "method": method, "strategy": strategy,
            "auroc": auroc, "fpr95": fpr95, "detection_error": det}


def test_beside_paper_converts_to_percent_and_takes_the_gap():
    ours = [_ours("Imagenet", "mcd", 0.995, strategy="separate"), _ours("Imagenet", "mcd", 0.5, strategy="concat"),
            _ours("Imagenet", "odin", 0.98), _ours("iSUN", "mcd", 0.9, 0.2, 0.1, strategy="separate")]
    rows = {(r["ood"], r["method"], r["metric"]): r for r in beside_paper(ours)}
    assert len(rows) == 5 * 2 * 3  # 5 OOD sets x (ODIN, MCD) x 3 metrics
    r = rows[("TINc", "mcd", "auroc")]
    assert r["ours_ood"] == "Imagenet" and r["paper"] == 99.9
    assert r["ours"] == pytest.approx(99.5) and r["gap"] == pytest.approx(99.5 - 99.9)  # separate, not concat
    assert rows[("TINc", "odin", "auroc")]["gap"] == pytest.approx(98.0 - 99.2)
    assert rows[("iSUN", "mcd", "fpr95")]["gap"] == pytest.approx(20.0 - 0.6)
    assert math.isnan(rows[("LSUNr", "mcd", "auroc")]["ours"]) and math.isnan(rows[("LSUNr", "mcd", "auroc")]["gap"])


def test_beside_paper_fashion_mnist_analogs():
    ours = [_ours("photo_crops", "mcd", 0.99, id_dataset="fashion_mnist", strategy="separate"),
            _ours("digits", "mcd", 0.97, id_dataset="fashion_mnist", strategy="separate")]
    rows = beside_paper(ours, id_dataset="fashion_mnist", methods=("mcd",))
    filled = {(r["ood"], r["metric"]): r["ours"] for r in rows if not math.isnan(r["ours"])}
    assert filled == {(o, k): v for o in ("TINc", "LSUNc")
                      for k, v in (("fpr95", 1.0), ("detection_error", 2.0), ("auroc", 99.0))}


def test_beside_paper_rejects_duplicates_and_unknown_methods():
    dup = [_ours("LSUN", "odin", 0.9), _ours("LSUN", "odin", 0.8)]
    with pytest.raises(ValueError, match="average the seeds"):
        beside_paper(dup)
    with pytest.raises(ValueError, match="energy"):
        beside_paper([], methods=("energy",))


def test_markdown_and_plot():
    comparison = beside_paper([_ours("LSUN", "mcd", 0.97, strategy="separate")])
    md = beside_paper_markdown(comparison)
    assert md.rstrip().endswith("Paper: " + paper.PAPER_SOURCE + ".") and "arXiv 1908.04951" in md
    data = [l for l in md.splitlines() if l.startswith("| ") and not l.startswith(("| OOD", "| ---"))]
    assert len(data) == 15  # 5 OOD sets x 3 metrics
    lsunc = next(l for l in data if l.startswith("| LSUNc") and "AUROC" in l)
    assert re.search(r"\| 97\.00 \|.*\| -2\.90 \|", lsunc)
    fig = plot_beside_paper(comparison, "test")
    assert len(fig.axes) == 3 and all(ax.get_ylabel().endswith("(%)") for ax in fig.axes)
    assert [t.get_text() for t in fig.legends[0].get_texts()][1] == "paper MCD"


def test_plot_legend_covers_no_bar():
    comparison = beside_paper([_ours("LSUN", "mcd", 0.97, strategy="separate"), _ours("LSUN", "odin", 0.9)])
    fig = plot_beside_paper(comparison, "test")
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    legend = fig.legends[0].get_window_extent(renderer)
    for ax in fig.axes:
        assert ax.get_legend() is None
        for bar in ax.patches:
            box = bar.get_window_extent(renderer)
            assert not box.overlaps(legend), f"the legend covers a bar in {ax.get_title()!r}"
        assert legend.y1 <= ax.get_window_extent(renderer).y0  # below the panels


def test_markdown_paired_only_drops_rows_without_ours():
    ours = [_ours("photo_crops", m, a, id_dataset="fashion_mnist", strategy="separate" if m == "mcd" else None)
            for m, a in (("mcd", 0.99), ("odin", 0.95))]
    comparison = beside_paper(ours, id_dataset="fashion_mnist")
    full = beside_paper_markdown(comparison, "ours")
    short = beside_paper_markdown(comparison, "ours", paired_only=True)

    def data(md):
        return [l for l in md.splitlines() if l.startswith("| ") and not l.startswith(("| OOD", "| ---"))]

    assert len(data(full)) == 15
    kept = data(short)
    # only TINc and LSUNc (photo_crops' analogs) x 3 metrics; each kept line has numbers of ours
    assert sorted({l.split(" | ")[0][2:] for l in kept}) == ["LSUNc", "TINc"] and len(kept) == 6
    assert all(l.count("–") == 0 for l in kept)
    dropped = [l for l in data(full) if l not in kept]
    assert all(l.split(" | ")[-4:] == ["–", "–", "–", "– |"] for l in dropped)  # ours and gaps all "–"
    assert "Not shown: the paper's rows for TINr, LSUNr, iSUN" in short


# ----------------------------------------------------------------------------------------------
# Presets: the paper's protocol, the blog's schedule, quick unchanged
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_is_consistent(name):
    """Each preset: the fields describe_preset lists are exactly those that differ from MCDConfig()
    (computed here field by field, ``extra`` aside), the learning rate decays inside pre-training (every milestone
    before the last epoch, increasing), and a split leaves test images after the validation ones."""
    import dataclasses

    cfg, default = PRESETS[name], MCDConfig()
    differ = {f.name for f in dataclasses.fields(MCDConfig) if getattr(cfg, f.name) != getattr(default, f.name)}
    assert set(describe_preset(name)) == differ - {"extra"}  # describe_preset leaves the free-form extras out
    m = list(cfg.pretrain_milestones)
    assert m == sorted(set(m)) and all(0 < e < cfg.pretrain_epochs for e in m), (name, m, cfg.pretrain_epochs)
    assert cfg.finetune_lr > 0 and cfg.margin > 0 and cfg.finetune_epochs >= 1
    if cfg.test_subset > 0:
        assert cfg.n_val < cfg.test_subset
    if cfg.ood_size > 0:
        assert cfg.n_val < cfg.ood_size


def test_running_statistics_blend_the_two_streams():
    """Notebook 05, section 4: separate forwards keep the streams apart in train-mode batch statistics
    only. The running mean, an exponential moving average with momentum 0.1 updated by every forward,
    settles (after each step's last forward) at (0.09 mu_sup + 0.1 mu_unsup) / 0.19 with one labeled
    and one unlabeled forward per step, at (0.171 mu_sup + 0.1 mu_unsup) / 0.271 with the official
    Step A's extra labeled forward; the running variance at the same blend of the unbiased within-batch
    variances (no between-batch term). By hand: the fixed point of m = 0.9^n m + sum_j 0.1 * 0.9^(n-1-j) mu_j."""
    import torch

    x_sup, x_unsup = torch.tensor([[0.0], [2.0]]), torch.tensor([[10.0], [14.0]])  # means 1, 12; variances 2, 8
    steady = []
    for forwards in ((x_sup, x_unsup), (x_sup, x_sup, x_unsup)):
        n = len(forwards)
        w = [0.1 * 0.9 ** (n - 1 - j) for j in range(n)]  # weight of forward j in one step's update
        expected_mean = sum(wj * x.mean().item() for wj, x in zip(w, forwards)) / (1 - 0.9 ** n)
        expected_var = sum(wj * x.var().item() for wj, x in zip(w, forwards)) / (1 - 0.9 ** n)
        bn = torch.nn.BatchNorm1d(1)
        for _ in range(400):
            for x in forwards:
                bn(x)
        assert bn.running_mean.item() == pytest.approx(expected_mean, abs=1e-5)
        assert bn.running_var.item() == pytest.approx(expected_var, abs=1e-5)
        steady.append(bn.running_mean.item())
    assert steady == pytest.approx([(0.09 * 1 + 0.1 * 12) / 0.19, (0.171 * 1 + 0.1 * 12) / 0.271], abs=1e-5)
    # a concatenated forward of both batches sees the between-batch term (law of total variance)
    within, between = (2 - 1) * 2 + (2 - 1) * 8, 2 * (1 - 6.5) ** 2 + 2 * (12 - 6.5) ** 2
    assert torch.cat([x_sup, x_unsup]).var().item() == pytest.approx((within + between) / 3)
    # the same in the weighted form the notebook gives: N_s N_u / (N (N - 1)) (mu_s - mu_u)^2, N = 4
    by_hand = within / 3 + 2 * 2 / (4 * 3) * (1 - 12) ** 2  # 43.667
    assert (within + between) / 3 == pytest.approx(by_hand)
    # the concatenated schedule through the same layer settles at that variance, not at the blend
    bn = torch.nn.BatchNorm1d(1)
    for _ in range(400):
        bn(torch.cat([x_sup, x_unsup]))
    assert bn.running_var.item() == pytest.approx(by_hand, abs=1e-3)
    assert by_hand - (0.09 * 2 + 0.1 * 8) / 0.19 > 30  # the separate forwards' blend: 5.16


def test_paper_source_says_what_was_not_verified():
    """Notebook 05 says the paper's table and section numbers could not be checked offline; so does
    the module (PAPER_SOURCE's docstring), and no table number is claimed in the printed source."""
    import inspect

    src = inspect.getsource(paper)
    assert "table and section numbers are not verified offline" in " ".join(src.split())
    assert "Table" not in paper.PAPER_SOURCE and "arXiv 1908.04951" in paper.PAPER_SOURCE


@pytest.mark.parametrize("name", ["paper-cifar10-densenet", "paper-cifar10-wrn", "paper-cifar100-densenet",
                                  "paper-cifar100-wrn"])
def test_paper_presets_follow_the_reference(name):
    cfg = get_preset(name)
    _, id_set, net = name.split("-")
    assert cfg.id_dataset == id_set and cfg.model == {"densenet": "densenet_bc_100", "wrn": "wrn_28_10"}[net]
    assert set(cfg.ood_sets) == {"Imagenet", "Imagenet_resize", "LSUN", "LSUN_resize", "iSUN", "gaussian", "uniform"}
    # official solver.py
    assert (cfg.schedule, cfg.finetune_lr, cfg.finetune_momentum, cfg.finetune_weight_decay) == ("official", 0.01, 0.9, 1e-4)
    assert (cfg.finetune_epochs, cfg.steps_per_epoch, cfg.batch_size_sup, cfg.batch_size_unsup) == (10, 0, 128, 128)
    assert cfg.margin == 1.2 and cfg.n_val == 1000 and cfg.split_seed == 3 and cfg.strategies == ("separate",)
    # pre-training of the unofficial reproduction
    assert (cfg.pretrain_epochs, cfg.pretrain_lr, cfg.pretrain_milestones) == (300, 0.1, (150, 225))
    assert (cfg.pretrain_momentum, cfg.pretrain_weight_decay) == (0.9, 5e-4)


def test_step_b_presets_follow_the_blog():
    from mcd_helpers.experiments.cache import cache_key

    for name, base in (("quick-step-b", "quick"), ("unofficial-cifar10-densenet", "paper-cifar10-densenet")):
        cfg = get_preset(name)
        assert (cfg.schedule, cfg.finetune_lr, cfg.finetune_weight_decay) == ("step_b", 0.001, 5e-4)
        assert cfg.batch_size_sup == cfg.batch_size_unsup == 64
        assert cache_key(cfg, "pretrain") == cache_key(get_preset(base), "pretrain")  # same pre-trained network
        assert cache_key(cfg, "finetune") != cache_key(get_preset(base), "finetune")


def test_presets_are_overridable_and_listed(capsys):
    assert get_preset("paper-cifar10-densenet", finetune_lr=0.1).finetune_lr == 0.1
    assert describe_preset("quick") == {"pretrain_epochs": 4, "pretrain_milestones": (3,), "steps_per_epoch": 150,
                                        "finetune_lr": 0.003}
    with pytest.raises(KeyError, match="paper-cifar10-densenet"):
        get_preset("paper")
    assert main(["reproduce", "--list-presets"]) == 0
    out = capsys.readouterr().out
    assert all(f"{name}:" in out for name in PRESETS)
