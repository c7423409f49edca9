"""`cpllm router`: the OpenAI API in front of prefill and decode instances (docs/disaggregated.md, "The router")."""
