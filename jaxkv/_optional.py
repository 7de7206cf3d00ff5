"""Optional packages: imported where used, with an ImportError that names the extra to install."""

from __future__ import annotations

import importlib

# The extra that installs each optional package (pyproject.toml's optional-dependencies).
EXTRAS = {"tokenizers": "serve", "jinja2": "serve", "huggingface_hub": "serve",
          "fastapi": "serve", "uvicorn": "serve", "outlines_core": "serve"}


def require(module: str, purpose: str):
  """`importlib.import_module(module)`, or ImportError saying what needs it and what to install.

  Args:
    module: the package's import name (e.g. "huggingface_hub").
    purpose: what needs it, for the message (e.g. "loading a Hugging Face model id").
  """
  try:
    return importlib.import_module(module)
  except ImportError as e:
    extra = EXTRAS.get(module, "serve")
    raise ImportError(f"{purpose} needs the optional package {module!r}: "
                      f"pip install \"jaxkv[{extra}]\" ({e})") from e
