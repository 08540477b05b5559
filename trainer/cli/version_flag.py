"""``instcls --version``: the version, the commit and the image (``trainer.code_identity``), worked out
only when the flag is given, since the commit takes up to two ``git`` calls."""

from __future__ import annotations

import argparse


class PrintCodeIdentity(argparse.Action):
    """Prints ``describe_code(code_identity())`` to stdout and exits 0, as argparse's ``version`` action does."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS,
                 help="print the version, the git commit and the container image, and exit"):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        from trainer.code_identity import code_identity, describe_code

        print(describe_code(code_identity()))
        parser.exit()
