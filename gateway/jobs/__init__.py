"""Batch jobs (placeholder, filled below)."""
