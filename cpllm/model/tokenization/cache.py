"""The fast tokenizer transformers builds from a GGUF file, kept on disk so that a warm start skips the build.

Building it parses the file's metadata and converts a vocabulary and its merges
(seconds for a 49k-token vocabulary); loading the saved tokenizer.json takes a
fraction of that and reads nothing of the GGUF. Entries live in
`$CPLLM_TOKENIZER_CACHE`, else next to the kernel cache (`$CPLLM_KERNEL_CACHE`'s
parent / tokenizers), else ~/.cache/cpllm/tokenizers.

An entry is keyed by the file's content, cheaply: its size and a SHA-256 of its
first 16 MiB and last 1 MiB. The metadata (vocabulary, merges, chat template,
special ids) sits at the start of a GGUF, so a file edited elsewhere changes
the key too only through its size or tail; the transformers version is in the
key as well, since the conversion changes between versions.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import transformers

HEAD_BYTES = 16 * 2**20
"""Bytes hashed from the start of the file (the metadata region of every model cpllm serves)."""
TAIL_BYTES = 2**20
"""Bytes hashed from the end of the file."""
_FORMAT = 1
"""Bumped when what an entry holds changes."""
META_FILE = "cpllm_gguf_meta.json"
"""The GGUF metadata the Tokenizer needs beside the HF files: chat template and end-of-turn id."""

conversions = 0
"""Tokenizers built from a GGUF in this process (the tests count cache misses with it)."""


def cache_root() -> Path:
    if "CPLLM_TOKENIZER_CACHE" in os.environ:
        return Path(os.environ["CPLLM_TOKENIZER_CACHE"])
    if "CPLLM_KERNEL_CACHE" in os.environ:
        return Path(os.environ["CPLLM_KERNEL_CACHE"]).parent / "tokenizers"
    return Path.home() / ".cache" / "cpllm" / "tokenizers"


def content_key(path: str) -> str:
    """Hex key of the file's content (size, head and tail) and of the converter's version."""
    size = os.path.getsize(path)
    digest = hashlib.sha256(f"{_FORMAT}:{transformers.__version__}:{size}:".encode())
    with open(path, "rb") as f:
        digest.update(f.read(HEAD_BYTES))
        if size > HEAD_BYTES:
            f.seek(max(HEAD_BYTES, size - TAIL_BYTES))
            digest.update(f.read(TAIL_BYTES))
    return digest.hexdigest()[:32]


def load_cached(path: str) -> tuple[Any, dict[str, Any]] | None:
    """(HF tokenizer, meta) of the file's entry, or None when there is none (or it cannot be read)."""
    entry = cache_root() / content_key(path)
    try:
        with open(entry / META_FILE, encoding="utf-8") as f:
            meta = json.load(f)
        hf = transformers.AutoTokenizer.from_pretrained(str(entry), local_files_only=True)
    except (OSError, ValueError):
        return None
    return hf, meta


def build_and_store(path: str, meta_of_file) -> tuple[Any, dict[str, Any]]:
    """Builds the tokenizer from the GGUF, stores the entry (atomically: a rename), returns (HF tokenizer, meta).
    `meta_of_file(path)` reads the few metadata values the Tokenizer needs. A cache that cannot be written costs
    the next start the build again, nothing else."""
    global conversions
    folder, name = os.path.split(os.path.abspath(path))
    # The tokenizers-backed class directly: AutoTokenizer would first build a model config from the GGUF with the
    # gguf package's reader (seconds: it parses every metadata value) only to pick a class whose tokenizer is the
    # same converted one (tests/test_startup.py compares the two).
    hf = transformers.TokenizersBackend.from_pretrained(folder, gguf_file=name)
    conversions += 1
    meta = meta_of_file(path)
    entry = cache_root() / content_key(path)
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=entry.parent))
        hf.save_pretrained(str(staging))
        with open(staging / META_FILE, "w", encoding="utf-8") as f:
            json.dump(meta, f)
        try:
            staging.rename(entry)
        except OSError:  # another process stored it first: theirs is as good
            shutil.rmtree(staging, ignore_errors=True)
    except OSError:
        pass
    return hf, meta
