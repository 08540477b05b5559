"""Benchmarks that print side-by-side ratios measured in one run (`instcls bench ...`)."""
