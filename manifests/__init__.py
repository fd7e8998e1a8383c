"""Data, not code: model layouts, quantization recipes, gate policies, reference results.

A package only so the YAML files ship inside the wheel; read them with ``importlib.resources``.
"""
