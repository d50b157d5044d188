"""Benchmarks of lightning_gpipe, one folder per experiment with its README."""
