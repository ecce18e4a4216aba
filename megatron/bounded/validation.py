"""What every check of a configuration raises, and how it names a setting.

The same checks run twice: at argument time on the parsed flags
(:func:`megatron.bounded.launch.arguments.validate_bounded_args`, before any GPU allocation) and when a
:class:`megatron.bounded.model.config.BoundedTransformerConfig` is built (programmatic
use). Each check lives next to the code it protects (the MoE settings in
:mod:`megatron.bounded.moe.backend`, the attention's in :mod:`megatron.bounded.attention.core`, ...)
and raises :class:`BoundedArgumentError`; :func:`option_name` phrases a setting as a flag or as a
config field, whichever the caller has.

This module imports nothing of the package, so every layer may use it.
"""

from __future__ import annotations

__all__ = ["BoundedArgumentError", "option_name"]


class BoundedArgumentError(ValueError):
    """An invalid or contradictory flag combination, detected at argument time."""


def option_name(field: str, flag_style: bool) -> str:
    """``--flag-name`` at argument time, the config field name for programmatic configs."""
    return "--" + field.replace("_", "-") if flag_style else field
