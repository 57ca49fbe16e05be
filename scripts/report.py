"""The report file every benchmark script under ``scripts/`` writes.

A benchmark's figures only mean something beside the machine, the versions
and the command that produced them, so each script writes its last measured
run to ``docs/results/<script>.md`` through ``write_report``: a title, then a
header (the date, the command that reproduces the run, the machine: cores,
CPU, Python, the versions of the packages that shape the figures, the load
average), then the script's own Markdown. The docs link these files instead
of copying figures, so a re-run replaces them in one place. One helper, so
that every report reads alike and no script copies the header.

A script that runs in several configurations (``capacity_replay`` at F = 4,
F = 8 and a sweep) writes each into its own ``section`` of the one file; a
run replaces only its section and keeps the others, each with its own header.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import re
import shlex
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO / "docs" / "results"
# The packages whose versions change what mptok's benchmarks measure.
DEFAULT_PACKAGES = ("mptok", "tokenizers", "transformers")


def package_versions(names: Iterable[str]) -> str:
    """``name version`` for each installed package of ``names``, comma-separated;
    a package that is not installed is named as absent."""
    found = []
    for name in names:
        try:
            found.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            found.append(f"{name} absent")
    return ", ".join(found)


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, or the platform's processor name."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_summary(packages: Iterable[str] = DEFAULT_PACKAGES, extra: Mapping[str, str] | None = None) -> str:
    """One line: cores, CPU, OS, Python, package versions, then ``extra``
    (``{"nginx": "1.22.1"}``: versions of programs that are not packages)."""
    parts = [
        f"{os.cpu_count()} CPUs ({cpu_model()})",
        f"{platform.system()} {platform.machine()}",
        f"Python {platform.python_version()}",
        package_versions(packages),
    ]
    parts += [f"{name} {version}" for name, version in (extra or {}).items()]
    return ", ".join(parts)


def script_command(argv: list[str] | None = None, python: str = ".venv/bin/python") -> str:
    """How this run was started, as a reader types it from the repository's
    root: ``.venv/bin/python -m scripts.<name> <arguments>`` (``python``: the
    interpreter of another venv, such as vLLM's)."""
    argv = sys.argv if argv is None else argv
    module = "scripts." + Path(argv[0]).stem
    return shlex.join([python, "-m", module, *argv[1:]])


def header(command: str, packages: Iterable[str] = DEFAULT_PACKAGES, extra: Mapping[str, str] | None = None, when: datetime.date | None = None) -> str:
    """The lines a report (or a report's section) starts with."""
    when = when or datetime.datetime.now(datetime.UTC).date()
    return (
        f"Measured {when.isoformat()}. Machine: {machine_summary(packages, extra)}; {load_average()}.\n\n"
        f"    {command}\n"
    )


def load_average() -> str:
    """The machine's load when the report is written: other work on the same
    cores slows every figure, so a report says how busy the machine was."""
    try:
        one, five, fifteen = os.getloadavg()
    except OSError:
        return "load average unknown"
    return f"load average {one:.1f} / {five:.1f} / {fifteen:.1f} (1 / 5 / 15 min) at the end of the run"


_SECTION = re.compile(r"<!-- section:(?P<name>[^>]*?):begin -->\n.*?<!-- section:(?P=name):end -->", re.S)


def _section_block(section: str, block: str) -> str:
    return f"<!-- section:{section}:begin -->\n## {section}\n\n{block}<!-- section:{section}:end -->"


def write_report(
    script: str,
    title: str,
    body: str,
    *,
    command: str | None = None,
    packages: Iterable[str] = DEFAULT_PACKAGES,
    extra: Mapping[str, str] | None = None,
    section: str | None = None,
    preamble: str = "",
    directory: Path = RESULTS_DIR,
    file: str | None = None,
) -> Path:
    """Write ``docs/results/<script>.md`` (``<file>.md`` when a script writes
    more than one report, one per workload): ``# title``, ``preamble`` (Markdown
    that explains the report: what the rows and columns are), the header
    (today's date, ``command`` or the command line of this process, the
    machine and ``packages``' versions), then ``body`` (Markdown).

    With ``section``, the run is one section of the file (headed ``## section``,
    its own header): that section is replaced, or added at the end, the other
    sections are kept, and the title and preamble are rewritten. Returns the
    file's path."""
    path = directory / f"{file or script}.md"
    block = header(command or script_command(), packages, extra) + "\n" + body.strip("\n") + "\n"
    intro = f"# {title}\n\n_Written by `scripts/{script}.py`; "
    if section is None:
        text = intro + "re-run it to replace this file._\n\n" + (preamble.strip("\n") + "\n\n" if preamble else "") + block
    else:
        sections = {m.group("name"): m.group(0) for m in _SECTION.finditer(path.read_text(encoding="utf-8"))} if path.exists() else {}
        sections[section] = _section_block(section, block)
        text = intro + "each run replaces its own section._\n\n" + (preamble.strip("\n") + "\n\n" if preamble else "")
        text += "\n\n".join(sections.values()) + "\n"
    directory.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.tmp")
    partial.write_text(text, encoding="utf-8")
    os.replace(partial, path)
    return path


def print_report(
    title: str, body: str, *, python: str, packages: Iterable[str], directory: Path = RESULTS_DIR, file: str | None = None
) -> Path:
    """``write_report`` for this script (named by its command line, run by ``python``), then print the report."""
    path = write_report(
        Path(sys.argv[0]).stem, title, body, command=script_command(python=python), packages=packages, directory=directory, file=file
    )
    print(path.read_text())
    return path
