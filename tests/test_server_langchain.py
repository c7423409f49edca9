"""LangChain's `ChatOpenAI` against `cpllm serve`, as a LangChain user points it at a vLLM server: plain and
streamed chat, forced tool calls through `bind_tools`, and `with_structured_output` by both of its server-side
methods. The tiny random model says nothing sensible, so the grammar (a forced tool, a schema) is what makes each
answer valid; the test checks that LangChain gets and parses what it asked for."""

from __future__ import annotations

from typing import Literal

import pydantic
import pytest
from tiny_models import save_tiny_hf_model

from cpllm.server.process import ServerProcess

langchain_openai = pytest.importorskip("langchain_openai")

ENGINE_FLAGS = ["--kv-cache-memory-bytes", "4MiB", "--max-model-len", "256", "--block-size", "4",
                "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]


class Weather(pydantic.BaseModel):
    """The weather in a city."""

    city: Literal["Paris", "Rome"]


class Verdict(pydantic.BaseModel):
    ok: bool
    grade: Literal["a", "b"]


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory) -> str:
    return save_tiny_hf_model(str(tmp_path_factory.mktemp("tiny_langchain")))


@pytest.fixture(scope="module")
def chat(model_folder):
    with ServerProcess.running([model_folder, *ENGINE_FLAGS]) as server:
        yield langchain_openai.ChatOpenAI(base_url=f"{server.url}/v1", api_key="unused", model=model_folder,
                                          temperature=0, max_tokens=60, timeout=60, max_retries=0)


def test_invoke_and_stream_give_the_same_text(chat):
    whole = chat.invoke("Say hello.")
    streamed = "".join(chunk.content for chunk in chat.stream("Say hello."))
    assert whole.content and streamed == whole.content
    assert whole.usage_metadata["output_tokens"] > 0


def test_bind_tools_forced_call_is_parsed_by_langchain(chat):
    reply = chat.bind_tools([Weather], tool_choice="Weather").invoke("Weather in Rome?")
    (call,) = reply.tool_calls
    assert call["name"] == "Weather" and call["args"]["city"] in ("Paris", "Rome")


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_with_structured_output_returns_the_model(chat, method):
    verdict = chat.with_structured_output(Verdict, method=method).invoke("Grade this.")
    assert isinstance(verdict, Verdict)
