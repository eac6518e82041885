"""Experiments: settings (``config``, ``presets``), the one pipeline every run goes through
(``pipeline``), its cache (``cache``), the command-line run (``run``), baselines, reports and the
paper's numbers.
"""
