"""Running experiments: everything a learner never needs to call to follow the notebooks.

The library at the top of :mod:`mcd_helpers` says what MCD and the two strategies are; this
subpackage runs them as experiments (DomainBed keeps its ``scripts/`` apart in the same way), and no
module at the top imports it:

* ``config``: the settings of a run (:class:`~mcd_helpers.experiments.config.MCDConfig`), its
  checks and the named presets.
* ``loop``: the resumable training loop (restore, step, validate, save) around
  :func:`mcd_helpers.strategies.mcd_step`.
* ``ddp``: DDP under torchrun, as nanoGPT does it.
* ``files``: files written whole or not at all, checkpoints, an output folder's lock.
* ``cache``: where a stage's result is kept, keyed by its settings and the code that trains it.
* ``stages``: the data, the split, the pre-trained and the fine-tuned networks.
* ``evaluation``: MSP, ODIN, energy and MCD scored and measured on the test split.
* ``pipeline``: :func:`~mcd_helpers.experiments.pipeline.run_ood_set`, one OOD set end to end.
* ``reproduce``, ``benchmark``, ``cli``: ``python -m mcd_helpers reproduce`` / ``benchmark``.
* ``report``, ``figures``, ``significance``: the benchmark's tables, figures and statistics over
  seeds.
* ``paper``: the paper's and OpenOOD's numbers beside ours.
* ``live``: the notebooks' live training plot and rerun widget.
"""
