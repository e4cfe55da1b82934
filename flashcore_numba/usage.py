"""How every `flashcore` command reports a mistake in its arguments: one line, exit status 2.

    flashcore bench: error: --repeats: the benchmark protocol times at least 20 runs, got 5
    flashcore grade: error: argument --seed: invalid int value: 'x' (see flashcore grade --help)

`flashcore` itself (cli.py) and the commands that read their own arguments (`flashcore grade`,
`flashcore lessons`) build their parsers from `Parser`, and report what they find wrong after
parsing with `usage_error`: the same line either way, never argparse's usage block and never a
traceback. A mistake argparse finds points to --help, where the accepted syntax is.
"""

from __future__ import annotations

import argparse
import sys

USAGE_EXIT = 2  # argparse's exit status for a bad argument, kept for every usage error


def usage_error(prog: str, message: str) -> int:
    """Print `<prog>: error: <message>` to stderr; return the exit status to leave with."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    return USAGE_EXIT


class Parser(argparse.ArgumentParser):
    """argparse's parser, its errors in the one-line form of `usage_error` (sub-commands too:
    `add_subparsers` makes them of this class)."""

    def error(self, message):
        usage_error(self.prog, f"{message} (see {self.prog} --help)")
        self.exit(USAGE_EXIT)
