"""Metrics, logs and resource readings of a running job."""
