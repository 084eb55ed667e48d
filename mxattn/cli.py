"""Argument parsing shared by `python -m mxattn`'s commands: a bad command line is one line on stderr, exit status 2."""

from __future__ import annotations

import argparse


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser whose errors (unknown arguments, bad values, a missing file) print one line, not the usage
    block: ``<prog>: error: <message>`` on stderr, exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


__all__ = ["ArgumentParser"]
