"""Upstream model providers."""
