"""Filled in by the reference-backend work in progress."""
