"""megatron.bounded: bounded-memory long-context MoE training on top of megatron-core.

Everything this project adds lives here; upstream ``megatron.core`` and
``megatron.training`` come from the installed ``megatron-core`` distribution
(``megatron/`` is a namespace package shared with it, so there is no
``megatron/__init__.py`` in this repository).
"""

__version__ = "0.1.0"

# The megatron-core release every run-time patch and subclass was written against.
UPSTREAM_VERSION = "0.19.2"
