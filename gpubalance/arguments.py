"""Argument types the commands share: argparse turns their errors into exit code 2 with the
message, naming the flag."""

from __future__ import annotations

import argparse
import math


def seconds(text: str) -> float:
    """A number of seconds above 0 (finite)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a number of seconds above 0, got {text!r}")
    return value


def hours(text: str) -> float:
    """A number of hours, 0 or more (finite)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"expected a number of hours, 0 or more, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """A count: an integer of 1 or more."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer of 1 or more, got {text!r}")
    return value


def seed(text: str) -> int:
    """A random seed: an integer of 0 or more."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer of 0 or more, got {text!r}")
    return value
