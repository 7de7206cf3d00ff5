"""The `jaxkv` console script's refusals (the server itself is tested in test_server.py)."""

from __future__ import annotations

import os
import shutil

import pytest

pytest.importorskip("uvicorn", reason="jaxkv serve needs the serve extra's uvicorn")

from jaxkv import cli  # noqa: E402

FIXTURE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "hf_llama")


def test_bad_arguments_and_checkpoints_are_named(tmp_path, capsys):
  assert cli.main(["serve", "--checkpoint", str(tmp_path)]) == 2
  assert "tokenizer.json does not exist" in capsys.readouterr().err
  assert cli.main(["serve", "--checkpoint", FIXTURE, "--max-seqs", "0"]) == 2
  assert "--max-seqs=0 must be >= 1" in capsys.readouterr().err
  shutil.copy(os.path.join(FIXTURE, "tokenizer.json"), tmp_path / "tokenizer.json")
  assert cli.main(["serve", "--checkpoint", str(tmp_path)]) == 2
  assert "config.json" in capsys.readouterr().err
  with pytest.raises(SystemExit):
    cli.main(["serve"])   # --checkpoint is required
  assert "--checkpoint" in capsys.readouterr().err
