"""Interrupt a training run at a chosen step: the k-th call of a function sends a signal first.

Used in-process by tests/test_train.py (with ``monkeypatch.setattr``) and in a subprocess by
tests/test_resume.py (``python -c DRIVER``), so the test knows exactly which step was cut.
"""

import os


def signal_on_call(module, name: str, k: int, sig, setattr_=setattr) -> None:
    """Replace ``module.<name>`` so that its ``k``-th call sends ``sig`` to this process, then
    runs."""
    original, calls = getattr(module, name), [0]

    def counted(*args, **kwargs):
        calls[0] += 1
        if calls[0] == k:
            os.kill(os.getpid(), sig)
        return original(*args, **kwargs)

    setattr_(module, name, counted)
