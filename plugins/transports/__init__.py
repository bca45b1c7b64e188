"""Built-in KV transports (`[kv_transfer] name = ...`): how a disaggregated deployment
moves a request's KV blocks from its prefill engine to its decode engine."""

import servelab
from servelab.plugin_types import KVTransferPlugin, NoOptions
from servelab.plugins.transports.shared_files import SharedFilesOptions
from servelab.plugins.transports.torch_store import TorchStoreOptions


@servelab.hookimpl
def servelab_register_kv_transfers():
    return [
        KVTransferPlugin(name="in-process", factory="servelab.plugins.transports.in_process:InProcessTransport",
                         options=NoOptions,
                         description="engines in one process: handoffs and block bytes in a shared table"),
        KVTransferPlugin(name="shared-files", factory="servelab.plugins.transports.shared_files:SharedFilesTransport",
                         options=SharedFilesOptions,
                         description="processes on one machine: a directory (tmpfs: shared memory) of atomically "
                                     "written handoff, block and state files"),
        KVTransferPlugin(name="torch-store", factory="servelab.plugins.transports.torch_store:TorchStoreTransport",
                         options=TorchStoreOptions,
                         description="across machines: keys of a torch.distributed TCPStore (one endpoint serves "
                                     "it)"),
    ]
