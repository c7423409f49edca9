"""pytest plugin (`-p vllm_server_shim`) that runs vLLM's own OpenAI-server tests against `cpllm serve`.

Loaded by benchmarks/vllm_server_suite.py, never by cpllm's own tests. It changes nothing in the vLLM checkout:

* `tests.utils` (vLLM's test helpers, which import all of vLLM) is replaced by a module whose RemoteOpenAIServer
  starts `python -m cpllm serve` on CPLLM_SUITE_MODEL (default: SmolLM2, cpllm's default model) under the model
  name the test asks for. vLLM flags that cpllm's parser does not know are dropped (each is recorded in
  CPLLM_SUITE_LOG/dropped_flags.json); every flag cpllm knows is passed as it is.
* `vllm` itself is not installed: `vllm.tokenizers.get_tokenizer` is cpllm's tokenizer of the served model, and
  every other `vllm.*` name is a stub, so that a test module imports. A test that touches a stub (in its body or
  a fixture's: it tests vLLM's own Python objects, not the HTTP server) is skipped, naming the stub.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import os
import sys
import types
from pathlib import Path

import openai
import pytest

from cpllm.cli import build_parser
from cpllm.server.process import ServerProcess, free_port

MODEL_ENV = "CPLLM_SUITE_MODEL"
"""The model cpllm serves for every test (a path; empty: cpllm's default model, SmolLM2-135M-Instruct)."""
LOG_ENV = "CPLLM_SUITE_LOG"
"""Folder for the shim's records (dropped flags, server logs of failed starts)."""

_STUB_MARK = "_cpllm_vllm_stub"


# ---- vllm: stubs that import, and a real tokenizer ---------------------------------------------------------

class _StubMeta(type):
    def __getattr__(cls, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _stub(f"{cls.__qualname__}.{name}")

    def __bool__(cls) -> bool:
        return False

    def __getitem__(cls, _item):  # list[RequestOutput]-style annotations
        return cls

    def __or__(cls, _other):  # RequestOutput | None
        return cls

    __ror__ = __or__


def _stub(name: str) -> type:
    """A class standing for vLLM's `name`: importable, subclassable, callable; falsy, so `if is_rocm():` is not."""
    def call(self, *args, **kwargs):
        return _stub(f"{name}()")

    return _StubMeta(name, (), {_STUB_MARK: True, "__init__": lambda self, *a, **k: None, "__call__": call,
                                "__getattr__": lambda self, attr: _stub(f"{name}.{attr}"),
                                "__bool__": lambda self: False, "__iter__": lambda self: iter(())})


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        value = _stub(f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


class _VllmFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Every `vllm` module is a stub module, except the few the shim implements (REAL)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname == "vllm" or fullname.startswith("vllm."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module) -> None:
        if module.__name__ in REAL:
            REAL[module.__name__](module)


def _tokenizers(module) -> None:
    def get_tokenizer(*_args, **_kwargs):
        from cpllm.model.loaders.default_model import default_model_path  # noqa: PLC0415
        from cpllm.model.tokenization.tokenizer import load_tokenizer  # noqa: PLC0415

        return load_tokenizer(os.environ.get(MODEL_ENV) or default_model_path())

    module.get_tokenizer = get_tokenizer


REAL = {"vllm.tokenizers": _tokenizers}
"""vLLM modules the shim implements for real (module name -> fills the module)."""


# ---- tests.utils: RemoteOpenAIServer starts cpllm ------------------------------------------------------------

def cpllm_flags(vllm_args: list[str]) -> tuple[list[str], list[str]]:
    """(the flags cpllm's serve parser knows, with their values; the dropped ones)."""
    actions = build_parser()._subparsers._group_actions[0].choices["serve"]._option_string_actions
    kept, dropped, i = [], [], 0
    while i < len(vllm_args):
        flag = vllm_args[i]
        name = flag.split("=", 1)[0]
        action = actions.get(name)
        takes_value = "=" not in flag and (action.nargs != 0 if action is not None else
                                           i + 1 < len(vllm_args) and not vllm_args[i + 1].startswith("--"))
        group = vllm_args[i:i + 2] if takes_value else [flag]
        (kept if action is not None else dropped).extend(group)
        i += len(group)
    return kept, dropped


def _record_dropped(model: str, dropped: list[str]) -> None:
    folder = os.environ.get(LOG_ENV)
    if not folder or not dropped:
        return
    path = Path(folder) / "dropped_flags.json"
    record = json.loads(path.read_text()) if path.exists() else {}
    record[model] = sorted(set(record.get(model, [])) | {d for d in dropped if d.startswith("-")})
    path.write_text(json.dumps(record, indent=1))


class RemoteOpenAIServer:
    """vLLM's test server, as `cpllm serve`: the same constructor, context manager, URLs and clients."""

    DUMMY_API_KEY = "token-abc123"

    def __init__(self, model: str, vllm_serve_args: list[str], *, env_dict: dict[str, str] | None = None,
                 seed: int | None = 0, auto_port: bool = True, max_wait_seconds: float | None = None,
                 override_hf_configs=None, **_more) -> None:
        args, dropped = cpllm_flags(list(vllm_serve_args))
        _record_dropped(model, dropped)
        if "--served-model-name" not in args:
            args += ["--served-model-name", model]
        if seed is not None and "--seed" not in args:
            args += ["--seed", str(seed)]
        port = None
        if "--port" in args:
            port = int(args[args.index("--port") + 1])
            del args[args.index("--port"):args.index("--port") + 2]
        served = os.environ.get(MODEL_ENV)
        self._server = ServerProcess(([served] if served else []) + args, port=port or free_port(), env=env_dict)
        self.host, self.port = "localhost", self._server.port
        self.proc = self._server.process
        self.uds = None
        try:
            self._server.wait_ready(max_wait_seconds or 600)
        except BaseException:
            self._server.close()
            raise

    def __enter__(self) -> "RemoteOpenAIServer":
        return self

    def __exit__(self, *_exc) -> None:
        self._server.close()

    @property
    def url_root(self) -> str:
        return f"http://{self.host}:{self.port}"

    def url_for(self, *parts: str) -> str:
        return f"{self.url_root}/" + "/".join(part.strip("/") for part in parts if part)

    def get_client(self, **kwargs) -> openai.OpenAI:
        kwargs.setdefault("timeout", 600)
        return openai.OpenAI(base_url=self.url_for("v1"), api_key=self.DUMMY_API_KEY, max_retries=0, **kwargs)

    def get_async_client(self, **kwargs) -> openai.AsyncOpenAI:
        kwargs.setdefault("timeout", 600)
        return openai.AsyncOpenAI(base_url=self.url_for("v1"), api_key=self.DUMMY_API_KEY, max_retries=0,
                                  **kwargs)


def _skip_decorator(reason: str):
    def decorator(*args, **_kwargs):
        if len(args) == 1 and callable(args[0]):
            return pytest.mark.skip(reason=reason)(args[0])
        return pytest.mark.skip(reason=reason)
    return decorator


def _test_utils() -> types.ModuleType:
    module = types.ModuleType("tests.utils")
    module.RemoteOpenAIServer = RemoteOpenAIServer
    module.VLLM_PATH = Path.cwd()
    module.ROCM_EXTRA_ARGS = []
    module.multi_gpu_only = _skip_decorator("needs several GPUs (vLLM's multi_gpu_only)")
    module.requires_fp8 = _skip_decorator("needs FP8 hardware (vLLM's requires_fp8)")
    return module


sys.meta_path.insert(0, _VllmFinder())
sys.modules["tests.utils"] = _test_utils()


# ---- skip what tests vLLM's own objects ------------------------------------------------------------------

def _names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names


def _stub_uses(function, module_globals: dict, seen: set | None = None) -> set[str]:
    """The stubs `function` reaches: names in its code, and through the test module's own helper functions
    (`get_vocab_size()` building vLLM's ModelConfig, `_assemble()` calling vLLM's message assembly)."""
    code = getattr(getattr(function, "__wrapped__", function), "__code__", None)
    seen = set() if seen is None else seen
    if code is None or code in seen:
        return set()
    seen.add(code)
    used = set()
    for name in _names(code):
        value = module_globals.get(name)
        if getattr(value, _STUB_MARK, False) or isinstance(value, _StubModule):
            used.add(name)
        elif isinstance(value, types.FunctionType) and value.__globals__ is module_globals:
            used |= _stub_uses(value, module_globals, seen)
    return used


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        functions = [item.obj]
        for defs in getattr(item, "_fixtureinfo", None).name2fixturedefs.values() if hasattr(item, "_fixtureinfo") \
                else ():
            functions += [d.func for d in defs]
        used = set()
        for function in functions:
            used |= _stub_uses(function, getattr(function, "__globals__", {}))
        for name, value in getattr(getattr(item, "callspec", None), "params", {}).items():
            if getattr(value, _STUB_MARK, False):  # parametrized with one of vLLM's classes
                used.add(f"{name}={getattr(value, '__qualname__', type(value).__qualname__)}")
        if used:
            item.add_marker(pytest.mark.skip(reason=f"tests vLLM's own objects ({', '.join(sorted(used))})"))
