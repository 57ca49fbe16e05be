"""The prompt lengths coding agents send: the ``--long`` form of the replay and of the render benchmark.

One place, so that both benchmarks measure the same lengths: a median near
70k tokens, a tail near 180k, about 1,000 tokens a turn (a file read, a test
run's output).
"""

LONG_TARGETS = (40_000, 52_000, 62_000, 68_000, 72_000, 90_000, 125_000, 180_000)
LONG_DELTA_TOKENS = 1_000
SMOKE_LONG_TARGETS = (3_000, 6_000)  # --long --smoke: two lengths, a few turns each
