"""The same prefill and decode workloads through cpllm, Hugging Face transformers and llama.cpp.

Each runner holds one loaded model and measures, with an explicit thread count:
- `prefill_s(prompt)`: seconds from the prompt to the first token's logits;
- `decode_s(prompt, batch, steps)`: seconds of `steps` decode steps of `batch` sequences whose
  context is `prompt` (for transformers the prompt is prefilled once and its KV cache repeated
  over the batch; llama.cpp runs batch 1 only).
"""

from __future__ import annotations

import os
import time

import torch

from cpllm.bench.common import BenchLayout
from cpllm.bench.decode import time_decode
from cpllm.bench.engines import build_llm
from cpllm.bench.prefill import time_prefill


class CpllmRunner:
    """cpllm on one rank, in this process (torch threads set per measurement), with one weight format:
    `none` (fp32 dequantized: the same weights transformers runs) or `auto` (the GGUF's Q4 blocks as stored: the
    weights llama.cpp runs).

    Two engines: prefill runs on one without prefix caching (the same prompt measured at another
    thread count must be computed again, not found in the cache); decode runs on one with it, so a
    batch sharing a long prompt costs one prefill.
    """

    def __init__(self, model_path: str, max_tokens: int, max_batch: int, decode_tokens: int,
                 quantization: str = "none", compile_decode: bool = False, kv_cache_dtype: str = "auto"):
        """`compile_decode`: decode steps through torch.compile; such a runner only decodes (`decode_only`: its
        prefill is the eager one's)."""
        extras = [quantization] * (quantization != "none") + ["compiled"] * compile_decode
        extras += [f"{kv_cache_dtype} KV"] * (kv_cache_dtype != "auto")
        self.name = "cpllm" + (f" ({', '.join(extras)})" if extras else "")
        self.decode_only = compile_decode
        self.prefill_llm = None if compile_decode else build_llm(
            model_path, BenchLayout.of(), strategy=None, threads_per_rank=1, context_tokens=max_tokens,
            batch_tokens=max(max_tokens, 8192), engine_options={"quantization": quantization})[0]
        self.decode_llm, _ = build_llm(model_path, BenchLayout.of(), strategy=None, threads_per_rank=1,
                                       context_tokens=decode_tokens * max_batch, batch_tokens=8192,
                                       engine_options={"max_model_len": decode_tokens, "max_num_seqs": max_batch,
                                                       "quantization": quantization, "compile_decode": compile_decode,
                                                       "kv_cache_dtype": kv_cache_dtype},
                                       prefix_caching=True)
        self._ids = 0

    def set_threads(self, threads: int) -> None:
        torch.set_num_threads(threads)

    def prefill_s(self, prompt: list[int]) -> float:
        return time_prefill(self.prefill_llm, prompt)

    def decode_s(self, prompt: list[int], batch: int, steps: int) -> float:
        self._ids += 1
        # the batch shares the prompt but the last token: one long prefill, then every request decodes
        prompts = [prompt[:-1] + [(prompt[-1] + i) % 1000 + 16] for i in range(batch)]
        if self.decode_only:  # compiled: untimed runs first compile the graph variants these steps select (the
            # first run computes the prompt and reads its slots as one window; later ones hit the prefix cache)
            for warm in range(2):
                time_decode(self.decode_llm.engine, prompts, 8, f"warm{warm}-{self._ids}")
        return time_decode(self.decode_llm.engine, prompts, steps, f"cmp{self._ids}")

    def close(self) -> None:
        for llm in (self.prefill_llm, self.decode_llm):
            if llm is not None:
                llm.shutdown()


class TransformersRunner:
    """Hugging Face transformers (sdpa attention, float32 or bfloat16) loading the same GGUF file."""

    def __init__(self, model_path: str, dtype: torch.dtype = torch.float32):
        from transformers import AutoModelForCausalLM

        folder, file = os.path.split(model_path)
        self.name = "transformers" if dtype == torch.float32 else f"transformers ({str(dtype).split('.')[-1]})"
        self.model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=dtype,
                                                          attn_implementation="sdpa").eval()

    def set_threads(self, threads: int) -> None:
        torch.set_num_threads(threads)

    @torch.inference_mode()
    def prefill_s(self, prompt: list[int]) -> float:
        ids = torch.tensor([prompt])
        start = time.perf_counter()
        # logits_to_keep=1: the LM head on the last position only, as transformers' own `generate` runs
        # prefill (a plain forward would add the LM head over every prompt position, ~20% more work at 2K).
        logits = self.model(input_ids=ids, logits_to_keep=1).logits
        logits[0, -1].argmax()
        return time.perf_counter() - start

    @torch.inference_mode()
    def decode_s(self, prompt: list[int], batch: int, steps: int) -> float:
        out = self.model(input_ids=torch.tensor([prompt]), use_cache=True)
        cache = out.past_key_values
        if batch > 1:
            cache.batch_repeat_interleave(batch)
        token = out.logits[:, -1:].argmax(-1).expand(batch, 1).contiguous()
        mask = torch.ones(batch, len(prompt) + steps + 1, dtype=torch.long)
        start = time.perf_counter()
        for step in range(steps):
            out = self.model(input_ids=token, past_key_values=cache, use_cache=True,
                             attention_mask=mask[:, : len(prompt) + step + 1])
            cache = out.past_key_values
            token = out.logits[:, -1:].argmax(-1)
        return time.perf_counter() - start

    def close(self) -> None:
        del self.model


class LlamaCppRunner:
    """llama.cpp through llama-cpp-python, on the GGUF file's own quantized weights (Q4_1 for SmolLM2)."""

    name = "llama.cpp"

    def __init__(self, model_path: str, max_tokens: int):
        self.model_path, self.max_tokens = model_path, max_tokens
        self.threads: int | None = None
        self.llm = None

    def set_threads(self, threads: int) -> None:
        from llama_cpp import Llama

        if threads == self.threads:
            return
        self.threads = threads
        self.llm = Llama(model_path=self.model_path, n_ctx=self.max_tokens, n_threads=threads,
                         n_threads_batch=threads, n_batch=512, n_ubatch=512, verbose=False)

    def prefill_s(self, prompt: list[int]) -> float:
        self.llm.reset()
        start = time.perf_counter()
        self.llm.eval(prompt)
        return time.perf_counter() - start

    def decode_s(self, prompt: list[int], batch: int, steps: int) -> float:
        if batch != 1:
            raise ValueError(f"llama-cpp-python decodes one sequence at a time, not a batch of {batch}")
        self.llm.reset()
        self.llm.eval(prompt)
        token = prompt[-1]
        start = time.perf_counter()
        for _ in range(steps):
            self.llm.eval([token])
            token = self._greedy_token()
        return time.perf_counter() - start

    def _greedy_token(self) -> int:
        """Argmax of the last evaluated position (without logits_all, Llama.scores is not filled)."""
        import numpy as np

        logits = np.ctypeslib.as_array(self.llm._ctx.get_logits(), shape=(self.llm.n_vocab(),))
        return int(logits.argmax())

    def close(self) -> None:
        self.llm = None


def llama_cpp_available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True
