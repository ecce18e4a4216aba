"""Knobs of an operator that mean nothing without it, and their defaults.

A knob such as ``--offload-stream-slots`` has a default, so after parsing one cannot tell whether
the user typed it. Each operator's module declares its knobs with :class:`OperatorKnobs`;
:mod:`megatron.bounded.launch.arguments` has the parser default them to None (remembering the declared
defaults) and, at validation, the operator's check calls :meth:`OperatorKnobs.resolve`: a knob
given without its operator is refused, naming both flags, and every knob left unset gets its
default back before anything reads it.
"""

from __future__ import annotations

import argparse
from typing import Optional

# args attribute listing the knobs resolve() gave their default (so a second validation pass,
# e.g. after --auto-bounds, does not take them for given)
_DEFAULTED = "_bounded_defaulted_knobs"


class OperatorKnobs:
    """The knobs (args attribute -> flag) of the operator switched on by ``feature``."""

    def __init__(self, feature: str, feature_flag: str, knobs: dict[str, str],
                 defaults: Optional[dict] = None):
        self.feature = feature
        self.feature_flag = feature_flag
        self.knobs = dict(knobs)
        self.defaults = dict(defaults or {})

    def defer_defaults(self, parser: argparse.ArgumentParser) -> None:
        """Make the parser leave these knobs None when not given; their declared defaults
        (from ``add_argument``) are kept here for :meth:`resolve`."""
        for attribute in self.knobs:
            declared = parser.get_default(attribute)
            if declared is not None:
                self.defaults[attribute] = declared
        parser.set_defaults(**{attribute: None for attribute in self.knobs})

    def given(self, args: argparse.Namespace) -> list[str]:
        """The flags of the knobs set on ``args`` (by the user, or by a planner)."""
        defaulted = getattr(args, _DEFAULTED, set())
        return [
            flag for attribute, flag in self.knobs.items()
            if getattr(args, attribute, None) is not None and attribute not in defaulted
        ]

    def resolve(self, args: argparse.Namespace, error_class=ValueError) -> None:
        """Refuse knobs given without the operator; give the others their defaults."""
        given = self.given(args)
        if given and not getattr(args, self.feature, False):
            raise error_class(
                f"{', '.join(given)} {'has' if len(given) == 1 else 'have'} no effect without "
                f"{self.feature_flag}: add {self.feature_flag} or remove {', '.join(given)}."
            )
        defaulted = set(getattr(args, _DEFAULTED, set()))
        for attribute in self.knobs:
            if getattr(args, attribute, None) is None and attribute in self.defaults:
                setattr(args, attribute, self.defaults[attribute])
                defaulted.add(attribute)
        setattr(args, _DEFAULTED, defaulted)
