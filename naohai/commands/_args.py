"""Argument-parsing helpers shared by subcommands."""
from __future__ import annotations

import argparse


def allow_intermixed(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Let ``key=value`` positionals come after options (``RECIPE --flag x k=v``).

    Plain argparse fills every positional from the first run of positional words,
    so words after an option are "unrecognized".  The subcommand's parser is
    switched to argparse's intermixed parsing for this one parser only.
    """
    def parse_known_args(args=None, namespace=None):
        del parser.parse_known_args          # the intermixed parser calls the plain one
        try:
            return parser.parse_known_intermixed_args(args, namespace)
        finally:
            parser.parse_known_args = parse_known_args
    parser.parse_known_args = parse_known_args
    return parser
