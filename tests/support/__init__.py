"""Helper modules of the tests (fixtures, generation harnesses, reference implementations),
imported as `support.X`: tests/ is on sys.path (pytest puts it there for tests/test_*.py; scripts
and subfolders insert it)."""
