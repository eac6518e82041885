"""Redraw the committed figures from the committed rows alone.

    python docs/draw_figures.py

writes docs/answer.png (concat − separate on the 30 random class splits of
benchmarks/results/generality, with split ``a`` of benchmarks/results/primary beside them: the
README's figure), benchmarks/results/mechanism/decomposition.png (each arm of the mechanism study
under each evaluation statistics it reports) and, for every folder of
benchmarks/results/, its ``forest.png``, ``by_protocol.png`` and ``splits.png``
(``mcd_helpers.experiments.report.draw_figures``), the figures a run of that benchmark writes.
"""

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402

from mcd_helpers.experiments.figures import split_forest  # noqa: E402
from mcd_helpers.experiments.mechanism import plot_mechanism  # noqa: E402
from mcd_helpers.experiments.report import draw_figures  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def rows(name: str) -> list[dict]:
    return json.loads((RESULTS / name / "results.json").read_text())


def answer_figure():
    """The README's figure: every random class split and the selected split ``a``."""
    return split_forest(rows("generality"), rows("primary"))


def mechanism_figure():
    """The mechanism study's decomposition: arm x evaluation statistics, per OOD share."""
    return plot_mechanism(rows("mechanism"))


if __name__ == "__main__":
    for fig, path in (
        (answer_figure(), ROOT / "docs" / "answer.png"),
        (mechanism_figure(), RESULTS / "mechanism" / "decomposition.png"),
    ):
        fig.savefig(path, dpi=100)
        plt.close(fig)
    for folder in sorted(p.parent for p in RESULTS.glob("*/results.json")):
        draw_figures(rows(folder.name), folder)
        print(f"redrew {folder.relative_to(ROOT)}")
