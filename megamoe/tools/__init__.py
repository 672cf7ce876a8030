"""Command-line tools: python -m megamoe.tools.<name>."""
