"""The experience collector."""
