"""Frozen-feature evaluation: weighted kNN and a linear probe on backbone features."""
