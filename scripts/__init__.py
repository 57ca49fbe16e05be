"""The benchmark, replay and drill scripts, run from the repository's root as
modules (``.venv/bin/python -m scripts.replay_bench``) so that they import
``mptok_harness`` and each other without editing ``sys.path``. A regular
package, not a namespace one, so that no other ``scripts`` on the path wins."""
