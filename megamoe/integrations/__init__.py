"""Adapters to serving frameworks (imported on demand; none of them is a dependency)."""
