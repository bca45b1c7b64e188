"""The servelab plugin module of servelab-sjf (the `servelab.plugins` entry point).

It registers four policies by name; factories are "module:attribute" strings, so
`servelab plugins` lists them without importing anything heavy.
"""

import servelab
from servelab.plugin_types import AllocatorPlugin, DrafterPlugin, LogitsProcessorPlugin, SchedulerPlugin
from servelab_sjf.lookup import LookupOptions
from servelab_sjf.no_repeat import NoRepeatOptions
from servelab_sjf.sjf import SJFOptions


@servelab.hookimpl
def servelab_register_schedulers():
    return [SchedulerPlugin(name="sjf", factory="servelab_sjf.sjf:SJFScheduler", options=SJFOptions, contract_version=1,
                            description="shortest job first (prompt + max_tokens), with aging; "
                                        "preempts the longest job")]


@servelab.hookimpl
def servelab_register_allocators():
    return [AllocatorPlugin(name="paged-lifo", factory="servelab_sjf.lifo:LIFOPagedAllocator", contract_version=2,
                            description="paged blocks from a LIFO stack: the most recently freed block is "
                                        "reused first; fork and copy-on-write")]


@servelab.hookimpl
def servelab_register_drafters():
    return [DrafterPlugin(name="repeat-lookup", factory="servelab_sjf.lookup:RepeatLookupDrafter",
                          options=LookupOptions, contract_version=2,
                          description="prompt lookup: propose what followed the last n-gram's previous occurrence")]


@servelab.hookimpl
def servelab_register_logits_processors():
    return [LogitsProcessorPlugin(name="no-repeat-ngram", factory="servelab_sjf.no_repeat:NoRepeatNGram",
                                  options=NoRepeatOptions, contract_version=1,
                                  description="bans tokens that would repeat an n-gram of prompt + output")]
