"""Numeric formats: pure encode/decode functions, one module per format."""
