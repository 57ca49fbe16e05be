import os
import sys

# Test helpers (families, conversations) import as top-level modules.
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
