"""Issue 9: absurd demo flags end in argparse errors (exit 2, a message naming the flag or the
size), never in a traceback; the demo is called in-process through `demo.main(argv)`."""

from __future__ import annotations

import re

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings

from jaxkv import demo

BASE = ["--requests", "2", "--max-tokens", "2", "--layers", "2", "--prompt-max", "6",
        "--max-write", "4", "--capacity", "64", "--quiet"]
INT_FLAGS = ["--layers", "--hidden", "--head-dim", "--vocab", "--window", "--max-seqs",
             "--max-write", "--capacity", "--initial-capacity", "--requests", "--prompt-min",
             "--prompt-max", "--max-tokens", "--n", "--top-k", "--seed"]
FLOAT_FLAGS = ["--temperature", "--top-p"]
# Every value below is refused for every flag it is drawn for, except the few a flag
# accepts (0 for --top-k/--seed, 2**31 - 1 for --top-k/--seed/--initial-capacity), which
# then run the tiny demo.
ABSURD_INTS = ["0", "-1", "-2147483649", "2147483647", "2147483648", "99999999999999",
               "1.5", "x", "", "nan"]
ABSURD_FLOATS = ["nan", "inf", "-inf", "-1", "1e400", "x", ""]


# capsys is read (and so emptied) in every example, so sharing it across examples is safe.
@settings(max_examples=40, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(flags=st.lists(st.one_of(st.tuples(st.sampled_from(INT_FLAGS), st.sampled_from(ABSURD_INTS)),
                                st.tuples(st.sampled_from(FLOAT_FLAGS),
                                          st.sampled_from(ABSURD_FLOATS))),
                      min_size=1, max_size=3))
def test_absurd_flags_end_in_argparse_errors(flags, capsys):
  argv = BASE + [x for flag, value in flags for x in (flag, value)]
  try:
    code = demo.main(argv)
  except SystemExit as e:
    err = capsys.readouterr().err
    assert e.code == 2, (argv, e.code, err)
    assert re.search(r"python -m jaxkv\.demo: error: \S", err), (argv, err)
    assert "Traceback" not in err
  else:
    assert code == 0, argv   # only flags whose drawn values are all valid get here
    out, err = capsys.readouterr()
    # The accepted values change no size: BASE's 2 requests x 2 tokens are served, silently.
    assert "generated 4 tokens" in out and not err, (argv, out, err)


@pytest.mark.parametrize("argv, match", [
    (["--max-seqs", "100000"], r"needs [\d,]+ bytes .*100001 columns \(max_seqs \+ 1\)"),
    (["--layers", "1000000"], r"--layers=1000000.*weights needs [\d,]+ bytes .* parameters"),
    (["--layers", "2147483647"], r"weights needs"),
    (["--capacity", "2147483647", "--max-write", "8"], r"needs [\d,]+ bytes"),
    (["--window", "2147483647"], r"window=2147483647 \+ max_write=32"),
    (["--requests", "2000000000"], r"--requests=2000000000 prompts on the host needs"),
    (["--prompt-max", "100", "--capacity", "64"], r"cache rows must be <= capacity=64|max_len"),
    (["--seed", "2147483648"], r"--seed=2147483648 must be in \[0, 2\*\*31\)"),
    (["--temperature", "nan"], r"--temperature=nan"),
], ids=["max-seqs", "layers-1e6", "layers-int32", "capacity", "window", "requests",
        "prompt-max", "seed", "temperature"])
def test_absurd_sizes_are_refused_with_the_formula(argv, match, capsys):
  """Before: --max-seqs 100000 tried to allocate 13 GB, a million layers built for minutes,
  and a window near 2**31 raised a traceback from CacheConfig."""
  with pytest.raises(SystemExit, match="2"):
    demo.main(["--quiet", "--requests", "2"] + argv)
  assert re.search(match, capsys.readouterr().err)


def test_seed_at_the_int32_limit_serves_every_request(capsys):
  """Before: --seed 2147483647 failed naming seed 2147483648 (the demo adds the index)."""
  code = demo.main(BASE + ["--seed", "2147483647", "--temperature", "1.0", "--layers", "1"])
  assert code == 0 and "generated 4 tokens" in capsys.readouterr().out
