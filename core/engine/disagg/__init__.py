"""Prefill/decode disaggregation: a request's prefill runs on one engine (the producer),
its decode on another (the consumer), its KV cache handed over through a KV transport
(`[kv_transfer]`, servelab.contracts.kv_transfer). docs/disaggregation.md draws it."""
