"""argparse help that states every option's default (the CLIs' one formatter)."""

from __future__ import annotations

import argparse


class DefaultsHelp(argparse.HelpFormatter):
    """Every option's help ends with its default, unless the help already states one."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if not action.option_strings or isinstance(action, argparse._HelpAction) or "default" in text.lower():
            return text
        if action.required:
            return f"{text} (required)".strip()
        if action.nargs == 0:  # a switch
            shown = "on" if action.default is True else "off"
        elif action.default is None or action.default == argparse.SUPPRESS:
            shown = "none"
        else:
            shown = "%(default)s"
        return f"{text} (default: {shown})".strip()
