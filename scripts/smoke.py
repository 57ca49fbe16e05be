"""The ``--smoke`` option of every benchmark script: its short form, which CI runs.

Why it exists: CI runs the tests, and a script the README points at could
break (an import, a renamed helper) without any test noticing. With
``--smoke`` a script runs its usual code path end to end on a small workload
(a few turns, one run, one frontend count), writes no report, and exits
non-zero on an error or a wrong id, as a full run does. tests/smoke/ runs
every one of them (``make smoke``).
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from typing import Any


def parse_args_with_smoke(
    parser: argparse.ArgumentParser, smoke_defaults: Mapping[str, Any], argv: Sequence[str] | None = None
) -> argparse.Namespace:
    """Parse ``argv`` with a ``--smoke`` option added: with it, ``smoke_defaults``
    (argparse dests, the one that stops the report included) replace the
    parser's defaults; an option given on the command line still wins."""
    parser.add_argument("--smoke", action="store_true", help="a short run on a small workload that writes no report (what CI runs)")
    known, _ = parser.parse_known_args(argv)
    if known.smoke:
        parser.set_defaults(**smoke_defaults)
    return parser.parse_args(argv)
