"""classifier package."""
