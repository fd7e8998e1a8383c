"""Benchmark definitions as lm-eval task YAMLs (``{data_dir}`` is filled in per run)."""
