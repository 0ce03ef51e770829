"""The value types of the command lines' flags (argparse ``type=``): each gives a usage error
that names what it expected (torch-free: the serve command line is the front's)."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """An argparse type: a clear usage error for 0, negatives and non-numbers."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


_UNITS = {
    "": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
    "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}


def byte_size(text: str) -> int:
    """``4GiB``, ``512MiB``, ``1e9``, ``1000000`` → bytes."""
    raw = text.strip().lower().replace("_", "")
    number = raw.rstrip("kmgtib")
    unit = raw[len(number):]
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit not in _UNITS or not value > 0 or value != value or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive byte size like 4GiB or 512MiB, got {text!r}")
    return int(value * _UNITS[unit])


def fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 < value < 1.0:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1), got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


def port_number(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port in [0, 65535], got {text!r}")
    return value
