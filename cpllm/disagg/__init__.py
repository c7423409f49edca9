"""Disaggregated prefill and decode: one instance prefills, another decodes, and the prompt's K/V moves between
them re-sharded from the producer's CP layout to the consumer's (docs/disaggregated.md)."""
