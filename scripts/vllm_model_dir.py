#!/usr/bin/env python3
"""Write the tiny model directory that real vLLM serves in the plugin's tests and benchmark.

What it holds and why: ``mptok_harness.vllm.write_model_dir``.

    python scripts/vllm_model_dir.py DIR
"""

import argparse
from pathlib import Path

from mptok_harness.vllm import write_model_dir

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", type=Path)
    write_model_dir(parser.parse_args().directory)
