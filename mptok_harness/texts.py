"""Real text that the benchmarks build their conversations from, fixed by installed versions.

A replay keeps the conversations it built (and their expected ids) under a
digest of their source texts, so those texts must change only when what they
come from changes: never with an edit of this repository. Each source here is
part of an installed distribution or of the system's base files, and changes
with its version only:

- ``stdlib_sources``: the Python standard library's sources (code);
- ``package_descriptions``: the long descriptions (README prose) in the
  METADATA of mptok's runtime dependencies;
- ``package_file_lists``: the same distributions' RECORD files (paths, hashes,
  sizes: the look of a build or a listing tool's output);
- ``license_texts``: the licenses in /usr/share/common-licenses, where present.
"""

from __future__ import annotations

import importlib.metadata
import sysconfig
from pathlib import Path

# mptok's runtime dependencies: installed wherever mptok is.
DISTRIBUTIONS = ("transformers", "tokenizers", "huggingface-hub", "uvicorn", "jinja2", "psutil", "orjson")


def stdlib_sources() -> str:
    """The standard library's top-level and one-level-deep ``*.py`` files, in a fixed order."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(stdlib.glob("*.py")) + sorted(stdlib.glob("*/*.py"))
    return "".join(path.read_text(encoding="utf-8", errors="replace") for path in files)


def _distribution_files(name: str, names: tuple[str, ...]) -> str:
    parts = []
    for distribution in names:
        try:
            parts.append(importlib.metadata.distribution(distribution).read_text(name) or "")
        except importlib.metadata.PackageNotFoundError:
            continue
    return "\n".join(parts)


def package_descriptions(names: tuple[str, ...] = DISTRIBUTIONS) -> str:
    """The METADATA (headers and long description) of each installed distribution of ``names``."""
    return _distribution_files("METADATA", names)


def package_file_lists(names: tuple[str, ...] = DISTRIBUTIONS) -> str:
    """The RECORD (one ``path,hash,size`` line per installed file) of each distribution of ``names``."""
    return _distribution_files("RECORD", names)


def license_texts(count: int = 6) -> str:
    """The first ``count`` license texts of /usr/share/common-licenses, or nothing."""
    return "\n".join(p.read_text(encoding="utf-8", errors="replace") for p in sorted(Path("/usr/share/common-licenses").glob("*"))[:count] if p.is_file())
