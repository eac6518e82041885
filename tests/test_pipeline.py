"""mcd_helpers.experiments.pipeline: run_ood_set trains each stage once and gives rows for each
model selection, their metrics recomputed by brute force from the scores."""

import numpy as np
import pytest
from pipeline_setup import brute_metrics

from mcd_helpers.data import DEBIAN_FMNIST_DIR
from mcd_helpers.experiments.stages import RunOptions

needs_fmnist = pytest.mark.skipif(
    not DEBIAN_FMNIST_DIR.exists(), reason="dataset-fashion-mnist not installed"
)
pytestmark = needs_fmnist
QUIET = RunOptions(progress=False, log=None)


def test_run_ood_set_trains_each_stage_once_and_returns_rows_for_each_selection(run):
    res, calls = run
    assert calls == [None, "separate", "concat"]  # one fine-tuning serves both selections
    methods = [
        ("msp", None),
        ("odin", None),
        ("energy", None),
        ("mcd", "separate"),
        ("mcd", "concat"),
    ]
    assert [(r["selection"], r["method"], r["strategy"]) for r in res.rows] == [
        (sel, m, s) for sel in ("ood-labels", "last-epoch") for m, s in methods
    ]
    n_id, n_ood = len(res.split.test_id_x), len(res.split.test_ood_x)
    # row_scores aligned with rows
    for r, (s_id, s_ood) in zip(res.rows, res.row_scores, strict=True):
        assert (len(s_id), len(s_ood)) == (n_id, n_ood)
        for k, v in brute_metrics(s_id, s_ood).items():
            assert r[k] == pytest.approx(v, abs=1e-12), (
                r["selection"],
                r["method"],
                r["strategy"],
                k,
            )
    for r in (r for r in res.rows if r["method"] == "mcd"):
        h = res.histories[r["strategy"]]
        # first best
        want = (
            len(h.val_auroc) - 1 if r["selection"] == "last-epoch" else int(np.argmax(h.val_auroc))
        )
        assert (r["selected_epoch"], r["val_auroc"]) == (want, h.val_auroc[want])
    first, second = res.rows[:5], res.rows[5:]
    for m in (0, 2):  # MSP and energy score the same pre-trained network under both selections
        assert {k: v for k, v in first[m].items() if k != "selection"} == {
            k: v for k, v in second[m].items() if k != "selection"
        }
