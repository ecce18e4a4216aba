"""Activation offload: SCO (checkpoint-boundary offload)."""
