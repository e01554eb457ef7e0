"""Elastic, adaptive-batch-size training for PyTorch (filled in by the core)."""
