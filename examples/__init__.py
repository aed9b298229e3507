"""Runnable examples built on streamlog (run them from the repository root)."""
