"""Where the test tree sits: test files live in folders by subject, so they name paths from here."""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]  # tests/
ROOT = TESTS.parent  # the repository
