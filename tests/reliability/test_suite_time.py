"""The suite's time check (tests/conftest.py): a full run fails when one test file takes more than
`HEAVY_SHARE` of the worker time and is not named, with its reason, in `HEAVY_FILES`."""

from __future__ import annotations

import conftest


def test_a_file_past_its_share_is_named_unless_allowed():
  seconds = {"a.py": 60.0, "b.py": 30.0, "c.py": 5.0, "d.py": 5.0}
  assert conftest.heavy_files(seconds, {}, share=0.05) == [("a.py", 0.6), ("b.py", 0.3)]
  assert conftest.heavy_files(seconds, {"a.py": "why"}, share=0.05) == [("b.py", 0.3)]
  assert conftest.heavy_files(seconds, {}, share=0.6) == []   # exactly at the share passes
  assert conftest.heavy_files({}, {}) == []


def test_every_allowed_heavy_file_exists_and_says_why():
  import pathlib   # pylint: disable=g-import-not-at-top
  root = pathlib.Path(__file__).resolve().parents[2]
  for path, why in conftest.HEAVY_FILES.items():
    assert (root / path).is_file(), path
    assert len(why.split()) >= 4, (path, why)
