"""The progress of a generate call: counts from plain numbers, bars on a terminal only, a chunked prefill's counts
seen through `LLM.generate(use_tqdm=...)` and `cpllm generate` on a pseudo-terminal."""

from __future__ import annotations

import fcntl
import functools
import io
import os
import pty
import re
import struct
import subprocess
import sys
import termios

import pytest
from tqdm import tqdm

from cpllm import LLM, SamplingParams
from cpllm.engine.progress import GenerateProgress, ProgressCounts, RequestTally, terminal_bars
from tiny_models import save_tiny_hf_model

CHUNK = 16
"""max_num_batched_tokens of the engine: a prompt longer than this is prefilled over several steps."""
def make_prompt(length: int, seed: int) -> list[int]:
    """Token ids no other test's prompt starts with (the prefix cache would give their blocks at once)."""
    return [(7 * i + 11 * seed + 3) % 250 + 2 for i in range(length)]


PROMPT = make_prompt(50, 0)
"""50 prompt tokens: chunks of 16, 16, 16 and 2."""


class FakeTerminal(io.StringIO):
    """A stream that says it is a terminal, and keeps what is drawn on it."""

    def isatty(self) -> bool:
        return True


def bar_text(stream: io.StringIO, desc: str) -> list[str]:
    """Every `n/total` a bar named `desc` drew, in order."""
    return re.findall(rf"{desc}:[^\r\n]*?\| (\d+)/(\d+|\?)", stream.getvalue())


# ---- the tally, from plain numbers -------------------------------------------------------------------------


def test_tally_sums_requests_and_never_goes_back():
    tally = RequestTally({"a": (50, 8), "b": (10, 4)})
    assert tally.counts() == ProgressCounts(0, 60, 0, 12, 0, 2)
    tally.prompt_computed("a", 16)
    tally.prompt_computed("b", 12)  # at most the prompt (a count may include generated tokens)
    tally.prompt_computed("other", 99)  # another call's request
    assert tally.counts() == ProgressCounts(26, 60, 0, 12, 0, 2)
    tally.prompt_computed("a", 0)  # preempted: its prompt is computed again, counted once
    assert tally.counts().prompt_tokens_done == 26
    tally.output("a", 1, False)  # an output: the whole prompt is in the cache
    tally.output("b", 4, True)
    assert tally.counts() == ProgressCounts(60, 60, 5, 12, 1, 2)


def test_tally_without_a_limit_has_no_output_total_and_refuses_bad_sizes():
    assert RequestTally({"a": (5, None), "b": (3, 2)}).counts().output_tokens_total is None
    with pytest.raises(ValueError, match="prompt of 0 tokens"):
        RequestTally({"a": (0, 4)})
    with pytest.raises(ValueError, match="max_output=-1"):
        RequestTally({"a": (3, -1)})


# ---- the bars ----------------------------------------------------------------------------------------------


def test_bars_show_the_counts_on_a_terminal():
    stream = FakeTerminal()
    factory = functools.partial(terminal_bars(stream), mininterval=0, miniters=1)  # draw every update
    progress = GenerateProgress(factory, {"a": (50, 8), "b": (10, 4)})
    progress.after_step({"a": 16, "b": 10}, [])
    progress.after_step({"a": 32}, [("b", 1, False)])
    progress.after_step({"a": 50}, [("a", 1, False), ("b", 4, True)])
    progress.after_step({}, [("a", 8, True)])
    progress.close()
    assert [int(n) for n, _ in bar_text(stream, "prompt")] == [0, 26, 42, 60, 60]
    assert {total for _, total in bar_text(stream, "prompt")} == {"60"}
    assert [int(n) for n, _ in bar_text(stream, "output")][-1] == 12
    assert [int(n) for n, _ in bar_text(stream, "requests")] == [0, 1, 2, 2]
    assert "tok/s" in stream.getvalue() and "<" in stream.getvalue()  # the rate and the time left


def test_one_request_has_no_requests_bar_and_an_unlimited_output_no_total():
    stream = FakeTerminal()
    progress = GenerateProgress(functools.partial(terminal_bars(stream), mininterval=0, miniters=1), {"a": (5, None)})
    progress.after_step({}, [("a", 3, False)])
    assert "output: 3tok" in stream.getvalue()  # a count and its rate, with no total to reach
    progress.after_step({}, [("a", 4, True)])
    progress.close()
    assert not bar_text(stream, "requests")
    assert bar_text(stream, "output")[-1] == ("4", "4")  # finished: what was generated is the whole
    assert bar_text(stream, "prompt")[-1] == ("5", "5")


def test_an_early_stop_fills_the_output_bar_and_an_unfinished_call_does_not():
    stream = FakeTerminal()
    progress = GenerateProgress(terminal_bars(stream), {"a": (5, 8)})
    progress.after_step({}, [("a", 3, True)])  # EOS after 3 of at most 8 tokens
    progress.close()
    assert bar_text(stream, "output")[-1] == ("3", "3")
    stream = FakeTerminal()
    progress = GenerateProgress(terminal_bars(stream), {"a": (5, 8)})
    progress.after_step({}, [("a", 3, False)])  # interrupted: the limit stays
    progress.close()
    assert bar_text(stream, "output")[-1] == ("3", "8")


def test_nothing_is_drawn_off_a_terminal():
    assert terminal_bars(io.StringIO()) is None  # a file, a pipe or a CI log
    assert terminal_bars(object()) is None  # no isatty at all


# ---- through the engine ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny_hf_model(str(tmp_path_factory.mktemp("tiny")), "llama", seed=6)


@pytest.fixture(scope="module")
def llm(folder):
    with LLM(folder, max_model_len=128, block_size=4, max_num_batched_tokens=CHUNK) as engine:
        yield engine


class Recorder:
    """A bar factory for `use_tqdm`: real tqdm bars on a fake terminal, each bar's count kept when it is made and
    after each update."""

    def __init__(self):
        self.stream = FakeTerminal()
        self.seen: dict[str, list[int]] = {}

    def __call__(self, **kwargs):
        seen = self.seen.setdefault(kwargs["desc"], [])

        class Bar(tqdm):
            def update(self, n=1):
                super().update(n)
                seen.append(self.n)

        bar = Bar(file=self.stream, **kwargs)
        seen.append(bar.n)
        return bar


def test_a_chunked_prefill_is_counted_chunk_by_chunk(llm):
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    recorder = Recorder()
    shown = llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=recorder)[0]
    # one request: the prompt's K/V cached after each of its 4 steps, then the 5 tokens one by one (the output
    # bar made at the first)
    assert recorder.seen["prompt"] == [0, 16, 32, 48, 50]
    assert recorder.seen["output"] == [1, 2, 3, 4, 5]
    assert "requests" not in recorder.seen
    plain = llm.generate({"prompt_token_ids": PROMPT}, params)[0]
    assert shown.outputs[0].token_ids == plain.outputs[0].token_ids  # the bars change nothing
    again = Recorder()
    llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=again)
    assert again.seen["prompt"] == [0, 50]  # 12 blocks from the prefix cache and the last 2 tokens, in one step


def test_several_requests_count_prompts_and_requests(llm):
    prompts = [make_prompt(50, 1), make_prompt(20, 2), make_prompt(3, 3)]
    recorder = Recorder()
    llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=3, ignore_eos=True),
                 use_tqdm=recorder)
    prompt = recorder.seen["prompt"]
    assert prompt == sorted(set(prompt)) and prompt[-1] == 73
    assert all(b - a <= CHUNK for a, b in zip(prompt, prompt[1:]))  # at most one step's budget per step
    assert recorder.seen["output"][-1] == 9
    assert recorder.seen["requests"][-1] == 3


def test_use_tqdm_true_draws_nothing_into_a_pipe(llm, capfd):
    llm.generate({"prompt_token_ids": make_prompt(40, 4)}, SamplingParams(max_tokens=2), use_tqdm=True)
    assert "prompt:" not in capfd.readouterr().err
    with pytest.raises(TypeError, match="use_tqdm must be a bool"):
        llm.generate({"prompt_token_ids": make_prompt(40, 4)}, SamplingParams(max_tokens=2), use_tqdm="yes")


@pytest.mark.timeout(300)
def test_data_parallel_counts_each_prompt_when_its_first_output_arrives(folder):
    """The spawned DP front sees no prefill progress (its replicas keep it): a prompt counts whole at once."""
    prompts = [make_prompt(50, 5), make_prompt(30, 6)]
    recorder = Recorder()
    with LLM(folder, max_model_len=128, block_size=4, max_num_batched_tokens=CHUNK, threads_per_rank=1,
             distributed_timeout=60, data_parallel_size=2) as llm:
        llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=3, ignore_eos=True),
                     use_tqdm=recorder)
    assert recorder.seen["prompt"][-1] == 80
    assert set(recorder.seen["prompt"]) <= {0, 30, 50, 80}  # whole prompts only
    assert recorder.seen["output"][-1] == 6 and recorder.seen["requests"][-1] == 2


def _generate_command(folder: str, prompt_file: str) -> list[str]:
    return [sys.executable, "-m", "cpllm", "generate", "--model", folder, "--prompt-file", prompt_file,
            "--max-tokens", "4", "--ignore-eos", "--max-model-len", "128", "--block-size", "4",
            "--max-num-batched-tokens", str(CHUNK)]


def test_cpllm_generate_draws_on_a_terminal_only(folder, tmp_path):
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text("the cat sat on the mat and looked at the dog across the road " * 3)
    command = _generate_command(folder, str(prompt_file))
    piped = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert piped.returncode == 0, piped.stderr
    assert "prompt:" not in piped.stderr and "%|" not in piped.stderr
    num_prompt = int(re.search(r"prompt tokens: (\d+)", piped.stdout).group(1))
    assert num_prompt > 2 * CHUNK  # several chunks

    leader, follower = pty.openpty()  # stderr on a pseudo-terminal, 120 columns wide as a window would be
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=follower, text=True) as process:
        os.close(follower)
        drawn = _read_all(leader)
        stdout = process.stdout.read()
        assert process.wait(timeout=300) == 0, drawn
    assert "prompt: 100%" in drawn and f"{num_prompt}/{num_prompt}" in drawn
    assert "output: 100%" in drawn and "4/4" in drawn
    assert stdout.split("---")[0] == piped.stdout.split("---")[0]  # the same completion, no bar in it
    assert "%|" not in stdout


def _read_all(fd: int) -> str:
    chunks = []
    while True:
        try:
            data = os.read(fd, 65536)
        except OSError:  # the other end closed (Linux reports EIO)
            break
        if not data:
            break
        chunks.append(data)
    os.close(fd)
    return b"".join(chunks).decode(errors="replace")
