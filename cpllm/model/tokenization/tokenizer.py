"""Text <-> token ids and chat templates, over a Hugging Face tokenizer.

A Hugging Face folder is read from tokenizer.json / tokenizer_config.json.
A GGUF file carries its vocabulary, merges and chat template as metadata;
transformers builds a fast tokenizer from them (`gguf_file=`), which takes a
few seconds for a 49k-token vocabulary (about 3.5 s for SmolLM2 here).
"""

from __future__ import annotations

import json
import os
from typing import Any, Sequence

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from cpllm.model.tokenization import cache as tokenizer_cache


class Tokenizer:
    """The engine's view of a tokenizer: encode, decode, chat template, special ids."""

    def __init__(
        self,
        hf_tokenizer: PreTrainedTokenizerBase,
        *,
        chat_template: str | None,
        extra_eos_token_ids: Sequence[int] = (),
    ) -> None:
        self.hf_tokenizer = hf_tokenizer
        """The wrapped transformers tokenizer (for incremental detokenization and the like)."""
        self.chat_template = chat_template
        """Jinja chat template, or None when the model has none."""
        eos = [] if hf_tokenizer.eos_token_id is None else [hf_tokenizer.eos_token_id]
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys([*eos, *extra_eos_token_ids]))
        """Ids that end generation: the tokenizer's eos first, then any the model config adds."""
        self.bos_token_id: int | None = hf_tokenizer.bos_token_id
        """Beginning-of-sequence id, or None."""
        self.vocab_size: int = len(hf_tokenizer)
        """Number of ids the tokenizer can produce, added tokens included."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf_tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf_tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        return list(self.hf_tokenizer.convert_ids_to_tokens(list(ids)))

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None, *, continue_final_message: bool = False,
                            chat_template: str | None = None,
                            template_kwargs: dict[str, Any] | None = None) -> str:
        """The prompt text for `messages`, rendered by the model's jinja chat template (or `chat_template`).

        `tools` (OpenAI's function definitions) reach the template as its `tools` variable; templates that do
        not use it ignore them. `continue_final_message` leaves the last message open (no end-of-turn), so the
        model continues it. `template_kwargs` become extra template variables (e.g. enable_thinking).
        """
        template = chat_template or self.chat_template
        if not template:
            raise ValueError(
                "this model has no chat template; send a plain prompt instead of chat messages"
            )
        return self.hf_tokenizer.apply_chat_template(
            messages,
            **(template_kwargs or {}),
            chat_template=template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tokenize=False,
            tools=tools,
        )


def load_tokenizer(path: str) -> Tokenizer:
    """Tokenizer of a Hugging Face model folder or of a .gguf file."""
    if os.path.isdir(path):
        return _load_folder(path)
    if os.path.isfile(path) and path.endswith(".gguf"):
        return _load_gguf(path)
    raise ValueError(f"tokenizer path {path!r} is neither a model folder nor a .gguf file")


def _load_folder(folder: str) -> Tokenizer:
    hf = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    return Tokenizer(hf, chat_template=hf.chat_template, extra_eos_token_ids=_generation_eos_ids(folder))


def _generation_eos_ids(folder: str) -> list[int]:
    """eos ids from generation_config.json / config.json (instruct models often list several)."""
    ids: list[int] = []
    for file in ("generation_config.json", "config.json"):
        path = os.path.join(folder, file)
        if not os.path.isfile(path):
            continue
        with open(path, encoding="utf-8") as f:
            eos = json.load(f).get("eos_token_id")
        ids.extend(eos if isinstance(eos, list) else [] if eos is None else [eos])
    return ids


def _load_gguf(path: str) -> Tokenizer:
    # a warm start loads the tokenizer converted before and reads nothing of the GGUF (tokenizer_cache.py)
    hf, meta = tokenizer_cache.load_cached(path) or tokenizer_cache.build_and_store(path, _tokenizer_meta)
    template = hf.chat_template or meta.get("tokenizer.chat_template")
    # llama.cpp also stops on end-of-turn, which the HF tokenizer does not know about
    eot = meta.get("tokenizer.ggml.eot_token_id")
    return Tokenizer(hf, chat_template=template, extra_eos_token_ids=[] if eot is None else [int(eot)])


def _tokenizer_meta(path: str) -> dict[str, Any]:
    """The GGUF metadata the Tokenizer reads beside the HF tokenizer (JSON-ready, for the cache entry)."""
    meta = _gguf_scalars(path)
    eot = meta.get("tokenizer.ggml.eot_token_id")
    template = meta.get("tokenizer.chat_template")
    return {"tokenizer.chat_template": None if template is None else str(template),
            "tokenizer.ggml.eot_token_id": None if eot is None else int(eot)}


def _gguf_scalars(path: str) -> dict[str, Any]:
    """GGUF metadata without the large token arrays (cheap)."""
    try:
        from transformers.integrations.gguf.reader import read_gguf_metadata
    except ImportError:  # older transformers: the gguf package parses everything, slower but fine
        from gguf import GGUFReader

        fields = GGUFReader(path).fields
        keys = ("tokenizer.chat_template", "tokenizer.ggml.eot_token_id")
        return {k: fields[k].contents() for k in keys if k in fields}
    metadata, _ = read_gguf_metadata(path)
    return metadata
