"""Markdown tables, through one helper, and the names of metrics and methods in every table and
figure."""

from typing import Sequence

METRIC_NAMES = {
    "auroc": "AUROC",
    "fpr95": "FPR95",
    "id_accuracy": "ID acc.",
    "detection_error": "det. error",
    "aupr_in": "AUPR-In",
    "aupr_out": "AUPR-Out",
}

METHOD_NAMES = {"msp": "MSP", "odin": "ODIN", "energy": "energy", "mcd": "MCD"}


def method_label(method: str, strategy: str | None = None) -> str:
    """A score's name: "MCD (concat)" for a fine-tuned network, "ODIN (pre-trained)" for a
    baseline, which scores the pre-trained network."""
    if method == "mcd":
        return f"MCD ({strategy})"
    return f"{METHOD_NAMES[method]} (pre-trained)"


def markdown_table(header: Sequence, rows: Sequence[Sequence], align: str = "") -> str:
    """A Markdown table; ``align`` one letter per column (``l`` or ``r``; default all left)."""
    marks = ["---:" if c == "r" else "---" for c in (align or "l" * len(header))]
    lines = [header, marks, *rows]
    return "\n".join("| " + " | ".join(map(str, line)) + " |" for line in lines)
