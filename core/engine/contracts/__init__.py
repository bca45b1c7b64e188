"""The policy contracts, one module per kind: everything the author of one kind of policy
reads is in its module (the records it receives and returns, its Protocol, its optional
capabilities, and where its changes by version are listed).

| kind (`KINDS` key) | module |
|---|---|
| allocators | `servelab.contracts.allocator` |
| schedulers | `servelab.contracts.scheduler` |
| victims | `servelab.contracts.victim` |
| kv_transfers | `servelab.contracts.kv_transfer` |
| drafters | `servelab.contracts.drafter` |
| attention | `servelab.contracts.attention` |
| routers | `servelab.contracts.router` |
| logits_processors | `servelab.contracts.logits_processor` |
| evictors | `servelab.contracts.eviction` |
| adapter_residency | `servelab.contracts.adapter_residency` |
| (the model runner) | `servelab.contracts.runner` |
| (seams: expert routing, expert placement) | `servelab.contracts.moe` |
| (seam: pipeline chunk sizing) | `servelab.contracts.pipeline` |

`KINDS[key].contract` names a kind's module. `servelab.interfaces` re-exports all of them.
"""
