"""A tiny DeepSeek model as llama.cpp's `deepseek2` GGUF file (stacked experts, kv_b_proj split into k_b / v_b as
current converters write it, or whole as older files have it; the MLA widths, the router and YaRN in the
metadata: tests/tiny_deepseek.py) gives the outputs of the same weights read from the Hugging Face folder.

Cases: DeepSeek-V2 (softmax greedy routing, queries direct) and DeepSeek-V3 (sigmoid noaux_tc over groups,
q_lora_rank, YaRN with mscale = mscale_all_dim, which is what a deepseek2 file can say).
"""

from __future__ import annotations

import pytest

from cpllm import LLM
from cpllm.model.loaders.gguf_source import GGUFSource
from cpllm.model.loaders.safetensors_source import read_hf_config
from parallel_helpers import assert_same_greedy, generate_counted, greedy_params, workload_prompts
from tiny_deepseek import save_tiny_deepseek, save_tiny_deepseek_gguf

COMMON = dict(quantization="none", max_model_len=128, block_size=4, max_num_batched_tokens=9)


@pytest.mark.parametrize("case, split, tp", [("v2", True, 1), ("v3-yarn-gguf", True, 1), ("v3-yarn-gguf", False, 1),
                                             ("v3-yarn-gguf", True, 2)])
def test_gguf_matches_hf_folder(case, split, tp, tmp_path):
    """TP = 2: each rank joins its own heads' rows of kv_b_proj from the split k_b / v_b."""
    folder = save_tiny_deepseek(str(tmp_path / "hf"), case, seed=1)
    path = str(tmp_path / f"{case}.gguf")
    save_tiny_deepseek_gguf(path, folder, case, split_kv_b=split)
    # the same config, read from the metadata (the GGUF file knows no GLM layer list and no tokenizer ids here)
    want, got = read_hf_config(folder), GGUFSource(path).config
    fields = ("architecture", "mla", "moe", "rope_scaling", "num_key_value_heads", "head_dim", "intermediate_size")
    assert {f: getattr(got, f) for f in fields} == {f: getattr(want, f) for f in fields}
    prompts = {name: p for name, p in workload_prompts(1).items() if name in ("len13", "len37", "shared")}
    params = greedy_params(8, prompt_logprobs=True)
    with LLM(folder, **COMMON) as llm:
        reference = generate_counted(llm, prompts, params, "hf")
    with LLM(path, **COMMON, tensor_parallel_size=tp, threads_per_rank=1, distributed_timeout=60) as llm:
        outputs = generate_counted(llm, prompts, params, "gguf")
    for name, output in outputs.items():
        assert_same_greedy(output, reference[name], what=f"{case} gguf {name}", prompt_logprobs=True)
