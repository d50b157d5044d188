"""Decoding with per-stage caches against transformers' generate: ``python -m benchmarks.generate.run``."""
