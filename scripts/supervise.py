#!/usr/bin/env python3
"""``mptok serve`` for a checkout without the console script: ``python scripts/supervise.py --help``."""

import sys

from mptok.cli import main

if __name__ == "__main__":
    sys.exit(main(["serve", *sys.argv[1:]]))
