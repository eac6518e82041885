"""Experiments: settings (``config``, ``presets``), the one pipeline every run goes through
(``pipeline``), its cache (``cache``), the output folder (``outdir``), the command-line runs
(``run``: reproduce, ``benchmark``: the near-OOD grid), baselines, statistics (``stats``),
reports (``report``, ``tables``, ``plots``) and the paper's numbers (``paper``).
"""
