"""The output folder of a run (mcd_helpers.experiments.outdir): what counts as unfinished work,
what --fresh deletes, and that run.json keeps nothing of how an earlier run ended."""
import json

import pytest

from mcd_helpers.errors import UnfinishedRunError
from mcd_helpers.experiments.outdir import prepare_out, unfinished_work
from mcd_helpers.training.checkpoint import OutputLock


def _earlier_run(out, status):
    """A folder as an earlier benchmark left it: results, scores, a finished cell, a rolling checkpoint."""
    (out / "scores").mkdir(parents=True)
    (out / "cells").mkdir()
    (out / "checkpoints" / "stage").mkdir(parents=True)
    for name in ("results.json", "summary.md", "config.json", "forest.png", "hist_digits.png", "scores/r.npz",
                 "cells/c.json", "checkpoints/stage/last.pt", "notes.txt"):
        (out / name).write_text("x")
    (out / "run.json").write_text(json.dumps({"status": status, "error": "TrainingInterrupted: stop", "seconds": 9,
                                              "rows": 3}))


def _prepare(out, **kw):
    lock = OutputLock(out)
    try:
        prepare_out(out, lock, {"preset": "p"}, quiet=True, **{"resume": False, "fresh": False, **kw})
    finally:
        lock.release()


def test_unfinished_work_counts_cells_and_checkpoints_unless_finished(tmp_path):
    _earlier_run(tmp_path, "interrupted")
    assert [p.name for p in unfinished_work(tmp_path)] == ["last.pt", "c.json"]
    (tmp_path / "run.json").write_text(json.dumps({"status": "finished"}))
    assert [p.name for p in unfinished_work(tmp_path)] == ["last.pt"]  # rolling checkpoints always count


def test_unfinished_work_is_kept_unless_resume_or_fresh(tmp_path):
    _earlier_run(tmp_path, "interrupted")
    with pytest.raises(UnfinishedRunError, match=r"holds checkpoints of an unfinished run \(checkpoints/stage/last.pt, "
                                                 r"cells/c.json\)\. Pass --resume .* Nothing was deleted"):
        _prepare(tmp_path)
    assert (tmp_path / "cells" / "c.json").exists() and (tmp_path / "results.json").exists()


def test_resume_keeps_the_work_and_drops_how_the_earlier_run_ended(tmp_path):
    _earlier_run(tmp_path, "interrupted")
    _prepare(tmp_path, resume=True)
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["status"] == "running" and run["resumed"] is True and run["config"] == {"preset": "p"}
    assert not {"error", "seconds", "rows"} & set(run)
    assert (tmp_path / "cells" / "c.json").exists() and (tmp_path / "scores" / "r.npz").exists()


def test_fresh_deletes_the_earlier_runs_outputs_and_nothing_else(tmp_path):
    _earlier_run(tmp_path, "failed")
    _prepare(tmp_path, fresh=True)
    left = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file())
    assert left == ["notes.txt", "run.json"]  # the user's own file stays
    assert json.loads((tmp_path / "run.json").read_text())["resumed"] is False
