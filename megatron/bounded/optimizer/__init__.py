"""Optimizers: OffloadStreamAdamW."""
