"""mcd_helpers.paper: the paper's table against the reference, our rows beside it, and its table."""

import math

import pytest

from mcd_helpers.experiments.paper import PAPER_ROWS, beside_paper, beside_paper_markdown

# The paper (Yu & Aizawa, ICCV 2019), DenseNet-BC, CIFAR-10 as ID: ODIN / ELOC / MCD in %, "-" not
# reported.
REFERENCE = """
TINc   3.6/1.5/0.1   4.2/3.0/0.7  99.2/99.6/99.9
TINr  10.1/3.2/1.7   6.9/4.0/2.3  98.2/99.3/99.6
LSUNc  6.0/3.4/0.2   5.3/4.1/0.7  98.7/99.3/99.9
LSUNr  3.5/1.4/0.4   4.2/2.7/1.1  99.2/99.6/99.9
iSUN   5.9/-/0.6     5.3/-/1.3    98.9/-/99.9
"""
OODS, METRICS, METHODS = (
    ("TINc", "TINr", "LSUNc", "LSUNr", "iSUN"),
    ("fpr95", "detection_error", "auroc"),
    ("odin", "eloc", "mcd"),
)


def reference():
    """{(ood, method, metric): value}."""
    out = {}
    for line in REFERENCE.strip().splitlines():
        ood, *cells = line.split()
        for metric, cell in zip(METRICS, cells):
            for method, v in zip(METHODS, cell.split("/")):
                out[(ood, method, metric)] = math.nan if v == "-" else float(v)
    return out


def test_paper_rows_are_the_reference_table():
    ref = reference()
    assert len(PAPER_ROWS) == 15 and {(r["ood"], r["method"]) for r in PAPER_ROWS} == {
        (o, m) for o in OODS for m in METHODS
    }
    for r in PAPER_ROWS:
        assert (r["source"], r["id_dataset"], r["model"]) == ("paper", "cifar10", "densenet_bc_100")
        for k in METRICS:
            want = ref[(r["ood"], r["method"], k)]
            assert (math.isnan(want) and math.isnan(r[k])) or r[k] == want, (r, k)


def ours(ood, method, auroc, fpr95=0.01, det=0.02, id_dataset="cifar10", strategy=None):
    return {
        "id_dataset": id_dataset,
        "ood_dataset": ood,
        "method": method,
        "strategy": strategy,
        "auroc": auroc,
        "fpr95": fpr95,
        "detection_error": det,
    }


def by_key(comparison):
    return {(c["ood"], c["method"], c["metric"]): c for c in comparison}


def test_beside_paper_converts_to_percent_and_takes_the_gap():
    rows = [
        ours("Imagenet", "mcd", 0.995, strategy="separate"),
        ours("Imagenet", "mcd", 0.5, strategy="concat"),
        ours("Imagenet", "odin", 0.98),
        ours("iSUN", "mcd", 0.9, 0.2, 0.1, strategy="separate"),
        ours("LSUN_resize", "mcd", 0.3, id_dataset="cifar100", strategy="separate"),
        ours("LSUN", "msp", 0.7),
    ]
    comparison = beside_paper(rows)
    got = by_key(comparison)
    assert len(comparison) == len(got) == 5 * 2 * 3  # each paper OOD set x ODIN, MCD x 3 metrics
    # TINc is ODIN's Imagenet (crops); the separate strategy, not concat
    r = got[("TINc", "mcd", "auroc")]
    assert (r["ours_ood"], r["paper"], r["ours"], r["gap"]) == pytest.approx(
        ("Imagenet", 99.9, 99.5, 99.5 - 99.9)
    )
    assert got[("TINc", "odin", "auroc")]["gap"] == pytest.approx(98.0 - 99.2)
    assert got[("TINc", "odin", "detection_error")]["gap"] == pytest.approx(2.0 - 4.2)
    assert (
        got[("iSUN", "mcd", "fpr95")]["ours"],
        got[("iSUN", "mcd", "fpr95")]["gap"],
    ) == pytest.approx((20.0, 20.0 - 0.6))
    assert {c["ours_ood"] for c in comparison} == {
        "Imagenet",
        "Imagenet_resize",
        "LSUN",
        "LSUN_resize",
        "iSUN",
    }
    lsunr = got[("LSUNr", "mcd", "auroc")]  # only a CIFAR-100 row: no number of ours
    assert lsunr["paper"] == 99.9 and math.isnan(lsunr["ours"]) and math.isnan(lsunr["gap"])


def test_beside_paper_off_cifar_uses_the_analogs_or_the_names_given():
    rows = [
        ours("photo_crops", "mcd", 0.99, id_dataset="fashion_mnist", strategy="separate"),
        ours("digits", "mcd", 0.97, id_dataset="fashion_mnist", strategy="separate"),
    ]
    filled = {
        (c["ood"], c["metric"]): c["ours"]
        for c in beside_paper(rows, "fashion_mnist", methods=("mcd",))
        if not math.isnan(c["ours"])
    }
    assert filled == pytest.approx(
        {
            (o, k): v
            for o in ("TINc", "LSUNc")
            for k, v in (("fpr95", 1.0), ("detection_error", 2.0), ("auroc", 99.0))
        }
    )
    mine = beside_paper(
        rows, "fashion_mnist", ood_names={"iSUN": "digits"}, methods=("eloc", "mcd")
    )
    assert {(c["ood"], c["method"]) for c in mine if not math.isnan(c["ours"])} == {("iSUN", "mcd")}
    assert math.isnan(by_key(mine)[("iSUN", "eloc", "auroc")]["paper"])  # ELOC has no iSUN number


def test_beside_paper_errors():
    with pytest.raises(
        ValueError,
        match=r"odin.*eloc.*mcd.*\['energy', 'msp'\]",
    ):
        beside_paper([], methods=("mcd", "msp", "energy"))
    with pytest.raises(ValueError, match=r"\('LSUN', 'odin'\)"):
        beside_paper([ours("LSUN", "odin", 0.9), ours("LSUN", "odin", 0.8)])


def data_lines(md):
    return [
        line
        for line in md.splitlines()
        if line.startswith("| ") and not line.startswith(("| OOD", "| ---"))
    ]


def test_beside_paper_markdown():
    md = beside_paper_markdown(
        beside_paper([ours("LSUN", "mcd", 0.97, 0.05, strategy="separate")]), "this run"
    )
    assert (
        md.splitlines()[0]
        == "| OOD (paper) | OOD (this run) | method | metric | paper | this run | gap |"
    )
    lines = data_lines(md)  # paper OOD set x (ODIN, MCD) x metric, in the paper's order
    assert len(lines) == 30 and [line.split(" | ")[0][2:] for line in lines[::6]] == list(OODS)
    assert "| LSUNc | LSUN | MCD | AUROC | 99.90 | 97.00 | -2.90 |" in lines
    assert "| LSUNc | LSUN | MCD | FPR95 | 0.20 | 5.00 | +4.80 |" in lines
    assert "| LSUNc | LSUN | ODIN | FPR95 | 6.00 | – | – |" in lines  # no ODIN row of ours
    assert (
        "gap = ours − paper in percentage points" in md
        and "arXiv 1908.04951" in md
        and "Not shown" not in md
    )


def test_beside_paper_markdown_paired_only_drops_the_lines_without_ours():
    rows = [ours("photo_crops", "mcd", 0.99, id_dataset="fashion_mnist", strategy="separate")]
    comparison = beside_paper(rows, "fashion_mnist", methods=("mcd",))
    full, short = (beside_paper_markdown(comparison, paired_only=p) for p in (False, True))
    assert len(data_lines(full)) == 15
    kept = data_lines(short)
    assert [line.split(" | ")[:4] for line in kept] == [
        ["| " + o, "photo_crops", "MCD", k]
        for o in ("TINc", "LSUNc")
        for k in ("FPR95", "det. error", "AUROC")
    ]
    assert "| TINc | photo_crops | MCD | AUROC | 99.90 | 99.00 | -0.90 |" in kept
    assert (
        "Not shown: the paper's rows for TINr, LSUNr, iSUN, which have no counterpart in our run."
        in short
    )
