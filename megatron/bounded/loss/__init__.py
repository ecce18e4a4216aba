"""Losses: Ring-DTP vocabulary-parallel linear + cross-entropy."""
