"""Several frontend processes routing each conversation to its owner: the
README's multi-process library example, runnable as it stands.

    python examples/owners.py [--frontends 2] [--turns 6]

Each process tokenizes the turns of one growing conversation that land on it
(here: turn t on frontend t % N, as a kernel spreading connections might),
through ``TokenizationOwners.encode``. The first turn to land on a frontend
that does not own the conversation goes to its owner, and the answer is
kept there as a copy; its later turns extend that copy where they land.
Every turn after the first is a cache hit, and every id list equals full
tokenization. Prints what each frontend did.
"""

from __future__ import annotations

import argparse
import multiprocessing
import secrets
import tempfile
from typing import Any

import mptok
from mptok.routing.owners import lower_switch_interval

KEY = "conversation-1"
WAIT_S = 120.0  # bound on every wait for the other processes


def conversation(turns: int) -> list[str]:
    """The prompts of one chat, each the last plus a turn (long enough to be
    cached: prompts under ``CacheConfig.min_chars``, 256, are not). Each turn
    opens with the embedded tokenizer's chat markers, added tokens, where the
    cache splices whatever engine it tokenizes with (docs/CACHE.md)."""
    prompt = "<｜begin▁of▁sentence｜>" + "You are a careful assistant who answers in full sentences. " * 5
    prompts = []
    for turn in range(turns):
        prompt += f"<｜User｜>Tell me about step {turn} of the plan, with reasons.<｜Assistant｜>"
        prompts.append(prompt)
        prompt += f"Step {turn} is to measure before changing anything, then change one thing at a time.<｜end▁of▁sentence｜>"
    return prompts


def frontend(ipc_dir: str, frontend_id: int, num_frontends: int, authkey: bytes, turns: int,
             barrier: Any, results: Any) -> None:
    """One frontend process: serve its cache to the others, tokenize its turns."""
    # Process-wide, so the entry point's to set: peers' calls wait less for this process's GIL.
    lower_switch_interval()
    tokenizer = mptok.load_tokenizer()
    cache = mptok.PrefixTokenCache()
    with mptok.TokenizationOwners(ipc_dir, frontend_id, num_frontends, cache, tokenizer,
                                  authkey=authkey, timeout_s=5.0) as owners:
        barrier.wait(WAIT_S)  # every frontend serves before any asks
        for turn, prompt in enumerate(conversation(turns)):
            if turn % num_frontends == frontend_id:
                ids = owners.encode(tokenizer, prompt, key=KEY)  # may be tokenized by its owner
                assert ids == tokenizer(prompt, add_special_tokens=False)["input_ids"]
            barrier.wait(WAIT_S)  # the turns in order, as a chat sends them
        routing, cached = owners.stats(), cache.stats()
        barrier.wait(WAIT_S)  # keep serving until every frontend is done asking
    results.put((frontend_id, routing["routed"], routing["kept_here"], routing["owned_here"], cached["hits"], cached["misses"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frontends", type=int, default=2)
    parser.add_argument("--turns", type=int, default=6)
    args = parser.parse_args()
    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(args.frontends), context.Queue()
    authkey = secrets.token_bytes(32)  # shared by the frontends, never in argv
    with tempfile.TemporaryDirectory(prefix="mptok-example-") as ipc_dir:  # this user's, mode 0700
        processes = [
            context.Process(target=frontend, args=(ipc_dir, i, args.frontends, authkey, args.turns, barrier, results))
            for i in range(args.frontends)
        ]
        for process in processes:
            process.start()
        rows = sorted(results.get(timeout=WAIT_S * 3) for _ in processes)
        for process in processes:
            process.join(WAIT_S)
    if any(process.exitcode != 0 for process in processes):
        raise SystemExit("a frontend failed")
    print(f"{KEY} is owned by frontend {mptok.owner_of(KEY, args.frontends)}")
    for frontend_id, routed, kept_here, owned_here, hits, misses in rows:
        print(f"frontend {frontend_id}: routed {routed}, kept here {kept_here}, owned here {owned_here}, "
              f"cache hits {hits}, misses {misses}")


if __name__ == "__main__":
    main()
