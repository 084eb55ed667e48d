"""The repository's root for tests that read its files (README.md, samples/, benchmarks/) or start scripts from it."""

from pathlib import Path

#: the repository root (tests/ is one level below it)
ROOT = Path(__file__).resolve().parents[1]
