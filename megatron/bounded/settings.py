"""Settings objects: each operator's flags as one dataclass, the refusal every check raises.

An operator's module declares its flags as the fields of one :class:`Settings` dataclass: the
field name is the flag (``pipelined_llep_max_chunks`` is ``--pipelined-llep-max-chunks`` and the
parsed ``args`` attribute), the default is written once, and :func:`knob` gives the one-line help.
From that declaration :meth:`Settings.add_arguments` makes the flags, :meth:`Settings.from_args`
reads them back (refusing an operator's knobs given without the operator) and
:meth:`Settings.check` refuses what the operator cannot run, naming the flags and the fix.
The rules on a class's own fields alone are its :meth:`Settings.check_values`, which ``check``
runs on parsed flags and the model config runs on configs built in code (it inherits the fields
of the settings that reach the model).

This module imports nothing of the package, so every layer may use it.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, ClassVar, Optional

__all__ = ["BoundedArgumentError", "Settings", "flag_name", "knob"]


class BoundedArgumentError(ValueError):
    """An invalid or contradictory flag combination, detected before the model is built."""


def flag_name(field: str) -> str:
    """The command-line flag of a settings field or ``args`` attribute."""
    return "--" + field.replace("_", "-")


def knob(default: Any, help: str, *, choices: Optional[tuple] = None,
         metavar: Optional[str] = None) -> Any:
    """A settings field: its default and one-line help (and the values it takes)."""
    return dataclasses.field(
        default=default, metadata={"help": help, "choices": choices, "metavar": metavar},
    )


_TYPES = {"int": int, "float": float, "str": str}


def _value_type(annotation: str):
    """The argparse type of a field annotation (``Optional[int]`` -> int)."""
    name = annotation.replace("Optional[", "").rstrip("]")
    return _TYPES[name]


class Settings:
    """Base of the settings dataclasses. ``SWITCH`` names the field that turns the operator on
    (None: the fields are independent); the other fields are its knobs, which mean nothing
    without it: given alone they are refused."""

    SWITCH: ClassVar[Optional[str]] = None
    # False where check() needs what upstream's validation derives (e.g. the data-parallel size):
    # the refusals before upstream's validation then only refuse knobs given without the switch
    EARLY: ClassVar[bool] = True

    @classmethod
    def knobs(cls) -> list:
        return [f for f in dataclasses.fields(cls) if f.name != cls.SWITCH]

    @classmethod
    def add_arguments(cls, group) -> None:
        """Add one flag per field to ``group`` (an argparse group or parser)."""
        for field in dataclasses.fields(cls):
            help_text, choices = field.metadata["help"], field.metadata["choices"]
            if field.type == "bool":
                if field.default:  # on by default: the flag turns it off
                    group.add_argument(flag_name("no_" + field.name), dest=field.name,
                                       action="store_false", help=help_text)
                else:
                    group.add_argument(flag_name(field.name), action="store_true", help=help_text)
                continue
            if field.default is not None:
                help_text += f" Default: {field.default:g}." if isinstance(field.default, float) \
                    else f" Default: {field.default}."
            group.add_argument(
                flag_name(field.name), type=_value_type(field.type), choices=choices,
                metavar=field.metadata["metavar"], help=help_text,
                # a knob of a switched operator parses to None when not given, so that
                # from_args can tell it was given without its operator
                default=None if cls.SWITCH and field.name != cls.SWITCH else field.default,
            )

    @classmethod
    def given_knobs(cls, args: argparse.Namespace) -> list:
        """The flags of this operator's knobs set on ``args``."""
        # "is", not "in (None, False)": a knob given as 0 equals False and would pass as absent
        return [flag_name(f.name) for f in cls.knobs()
                if getattr(args, f.name, None) is not None
                and getattr(args, f.name, None) is not False]

    @classmethod
    def of(cls, args: argparse.Namespace):
        """The settings ``args`` holds (parsed flags, or a namespace with the settings' values;
        unset fields get their defaults), neither checked nor refused."""
        values = {}
        for field in dataclasses.fields(cls):
            value = getattr(args, field.name, None)
            values[field.name] = field.default if value is None else value
        return cls(**values)

    @classmethod
    def from_args(cls, args: argparse.Namespace, check: bool = True):
        """The settings of parsed ``args`` (unset knobs get their defaults), checked unless
        ``check`` is False (then only knobs given without the operator are refused)."""
        if cls.SWITCH and not getattr(args, cls.SWITCH, False):
            given = cls.given_knobs(args)
            if given:
                switch = flag_name(cls.SWITCH)
                raise BoundedArgumentError(
                    f"{', '.join(given)} {'has' if len(given) == 1 else 'have'} no effect without "
                    f"{switch}: add {switch} or remove {', '.join(given)}."
                )
        settings = cls.of(args)
        if check:
            settings.check(args)
        return settings

    def check_values(self) -> None:
        """Refuse values of this class's own fields that no other flag makes valid, naming the
        flag and the fix (the one home of those rules: parsed flags and model configs alike)."""

    def check(self, args: argparse.Namespace) -> None:
        """Refuse what the operator cannot run with the rest of the parsed flags ``args``."""

    @property
    def enabled(self) -> bool:
        """Whether the operator is on (its switch; settings without one are always on)."""
        return bool(getattr(self, self.SWITCH)) if self.SWITCH else True

    def fields(self) -> dict:
        """``{flag attribute: value}`` of these settings."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def to_flags(self) -> list:
        """The command-line flags that give these settings (defaults left out)."""
        flags = []
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value == field.default:
                continue
            if field.type == "bool":
                flags.append(flag_name(("no_" if field.default else "") + field.name))
            else:
                text = f"{value:g}" if isinstance(value, float) else str(value)
                flags += [flag_name(field.name), text]
        return flags
