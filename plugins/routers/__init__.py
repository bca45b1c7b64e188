"""Built-in routers: which engine replica serves each request."""

import servelab
from servelab.plugin_types import NoOptions, RouterPlugin
from servelab.plugins.routers.adapter_affinity import AdapterAffinityOptions
from servelab.plugins.routers.prefix_affinity import PrefixAffinityOptions


@servelab.hookimpl
def servelab_register_routers():
    return [
        RouterPlugin(
            name="round-robin",
            factory="servelab.plugins.routers.round_robin:RoundRobinRouter",
            options=NoOptions,
            description="each request to the next live replica in id order, ignoring load and cache",
        ),
        RouterPlugin(
            name="least-loaded",
            factory="servelab.plugins.routers.least_loaded:LeastLoadedRouter",
            options=NoOptions,
            description="the replica with the fewest queued + running tokens",
        ),
        RouterPlugin(
            name="prefix-affinity",
            factory="servelab.plugins.routers.prefix_affinity:PrefixAffinityRouter",
            options=PrefixAffinityOptions,
            description="cache-aware (SGLang's router): the replica holding the longest prefix of the prompt, "
                        "unless its load exceeds the least-loaded replica's by a margin",
        ),
        RouterPlugin(
            name="adapter-affinity",
            factory="servelab.plugins.routers.adapter_affinity:AdapterAffinityRouter",
            options=AdapterAffinityOptions,
            description="a LoRA request to a replica holding its adapter in the fast pool, unless that "
                        "replica's load exceeds the least-loaded replica's by a margin",
        ),
    ]
