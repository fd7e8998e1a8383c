"""Benchmark definitions as lm-eval task YAMLs.

``{benchmark_dir}`` (the folder holding a benchmark's files) is filled in per run; ``data/`` holds
GSM8K, shipped with quantgate under its MIT licence.
"""
