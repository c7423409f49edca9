"""IncrementalDetokenizer with a byte-level BPE trained here (no downloads)."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from cpllm.engine.detokenizer import IncrementalDetokenizer
from cpllm.engine.sampling_params import SamplingParams

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world, hello there!",
    "Stop here. END of story.",
    "the end is near, the world is wide",
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(SENTENCES * 5, trainer)
    return tokenizer


def run(tok, text, prompt="Hello", **kwargs):
    """Feeds `text`'s tokens one by one; returns (detokenizer, streamed chunks, stop)."""
    detok = IncrementalDetokenizer(tok, tok.encode(prompt).ids, SamplingParams(**kwargs))
    chunks, stop = [], None
    for token_id in tok.encode(text).ids:
        stop = detok.append(token_id)
        chunks.append(detok.new_text())
        if stop is not None:
            break
    if stop is None:
        detok.finish()
        chunks.append(detok.new_text())
    return detok, chunks, stop


@pytest.mark.parametrize(
    "text", [" Hello world, hello there!", "café 日本 😀 ok", "The end.\nNew line  two  spaces"]
)
def test_incremental_text_equals_full_decode(tok, text):
    ids = tok.encode(text).ids
    detok = IncrementalDetokenizer(tok, tok.encode("The fox").ids, SamplingParams())
    for n, token_id in enumerate(ids, start=1):
        assert detok.append(token_id) is None
        assert not detok.text.endswith("\ufffd")
        assert tok.decode(ids[:n]).startswith(detok.text)
    assert detok.text == text == tok.decode(ids)
    assert detok.num_tokens == len(ids)


def test_multi_token_character_is_held_until_complete(tok):
    ids = tok.encode("😀").ids
    assert len(ids) == 4  # one byte per token: the emoji is not in the merges
    detok = IncrementalDetokenizer(tok, [], SamplingParams())
    for token_id in ids[:3]:
        detok.append(token_id)
        assert detok.text == ""
        assert detok.new_text() == ""
    detok.append(ids[3])
    assert detok.text == "😀"
    assert detok.new_text() == "😀"


def test_finish_flushes_an_incomplete_character(tok):
    detok = IncrementalDetokenizer(tok, [], SamplingParams())
    for token_id in tok.encode("ok 😀").ids[:-2]:
        detok.append(token_id)
    assert detok.text == "ok "
    detok.finish()
    assert detok.text.startswith("ok ") and detok.text.endswith("\ufffd")
    assert detok.new_text() == detok.text
    with pytest.raises(RuntimeError, match="finished"):
        detok.append(5)


def test_stop_string_spanning_tokens(tok):
    ids = tok.encode("Hello world END now").ids
    assert [tok.decode([i]) for i in ids[:3]] == ["Hello", " world", " END"]
    detok, chunks, stop = run(tok, "Hello world END now", stop=["d EN"])
    assert stop == "d EN" and detok.stop_reason == "d EN"
    assert detok.num_tokens == 3  # matched on the token that completed it
    assert detok.text == "Hello worl"
    assert "".join(chunks) == "Hello worl"
    assert detok.finished


def test_include_stop_str_in_output(tok):
    detok, chunks, stop = run(
        tok, "Hello world END now", stop="d EN", include_stop_str_in_output=True
    )
    assert stop == "d EN"
    assert detok.text == "Hello world EN"  # the rest of the token after the stop is dropped
    assert "".join(chunks) == "Hello world EN"


def test_new_text_holds_back_a_possible_stop_prefix(tok):
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=["world peace", "xyz"]))
    ids = tok.encode("Hello world END").ids
    detok.append(ids[0])
    assert detok.new_text() == "Hello"
    detok.append(ids[1])
    assert detok.text == "Hello world"
    assert detok.new_text() == " "  # "world" may still become "world peace"
    detok.append(ids[2])
    assert detok.new_text() == "world END"  # no longer a prefix of a stop string
    assert detok.new_text() == ""


def test_no_hold_back_when_the_stop_string_is_kept(tok):
    params = SamplingParams(stop=["world peace"], include_stop_str_in_output=True)
    detok = IncrementalDetokenizer(tok, [], params)
    for token_id in tok.encode("Hello world").ids:
        detok.append(token_id)
    assert detok.new_text() == "Hello world"


def test_held_back_prefix_is_released_at_finish(tok):
    detok, chunks, stop = run(tok, "Hello world", stop=["world peace"])
    assert stop is None
    assert chunks[-2:] == [" ", "world"]
    assert "".join(chunks) == detok.text == "Hello world"


def test_earliest_stop_string_wins(tok):
    # " world" completes both stop strings at once; the one that starts first wins.
    detok, _, stop = run(tok, "Hello world", stop=["world", "lo w"])
    assert stop == "lo w"
    assert detok.text == "Hel"
    detok, _, stop = run(tok, "the quick brown fox", stop=["brown", "quick"])
    assert stop == "quick"
    assert detok.text == "the "


def test_stop_string_with_multibyte_character(tok):
    detok, chunks, stop = run(tok, "café 日本 ok", stop=["日"])
    assert stop == "日"
    assert detok.text == "café "
    assert "".join(chunks) == "café "


def test_stop_strings_are_not_checked_before_min_tokens(tok):
    ids = tok.encode("Hello world, hello there!").ids
    assert tok.decode(ids[:2]) == "Hello world"
    # " world" is the 2nd token; with min_tokens=2 the first check is at token 3.
    detok, _, stop = run(tok, "Hello world, hello there!", stop=["world"], min_tokens=2)
    assert stop is None
    assert detok.text == "Hello world, hello there!"
    detok, _, stop = run(tok, "Hello world, hello there!", stop=["world"], min_tokens=1)
    assert stop == "world" and detok.text == "Hello "


def test_skip_special_tokens(tok):
    eos = tok.token_to_id("<eos>")
    ids = [*tok.encode("Hello").ids, eos, *tok.encode(" world").ids]
    for skip, expected in ((True, "Hello world"), (False, "Hello<eos> world")):
        detok = IncrementalDetokenizer(tok, [], SamplingParams(skip_special_tokens=skip))
        for token_id in ids:
            detok.append(token_id)
        assert detok.text == expected


def test_prompt_context_is_not_part_of_the_output(tok):
    prompt = tok.encode("The quick brown fox jumps over").ids
    detok = IncrementalDetokenizer(tok, prompt, SamplingParams())
    for token_id in tok.encode(" the lazy dog.").ids:
        detok.append(token_id)
    assert detok.text == " the lazy dog."
