"""The help formatter of qil's command lines (``qil_client``, ``qil_worker``, the scripts).

It lives in the client package because the client CLI must not import ``qil_worker``.
"""

from __future__ import annotations

import argparse


def _says_nothing(default: object) -> bool:
    """A default whose value tells a reader nothing: the flag's help says what leaving it out
    means (``--model``'s None is the demo model, ``--chat``'s False is off)."""
    if default is None or default is False or default is argparse.SUPPRESS:
        return True
    return isinstance(default, (str, list, tuple)) and not default


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``ArgumentDefaultsHelpFormatter``, without its ``(default: None)`` noise: the default is
    appended unless the help already gives it (``%(default)s`` or ``default:``) or it says nothing
    (None, False, empty)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "%(default)" in text or "default:" in text or _says_nothing(action.default):
            return action.help
        return super()._get_help_string(action)
