"""Built-in drafters (speculative decoding): n-gram prompt lookup, suffix decoding, a draft model, Medusa heads,
an EAGLE-style head."""

import servelab
from servelab.plugin_types import DrafterPlugin
from servelab.plugins.drafters.options import (DraftModelOptions, EagleOptions, MedusaOptions, NgramOptions,
                                               SuffixOptions)


@servelab.hookimpl
def servelab_register_drafters():
    return [
        DrafterPlugin(name="ngram", factory="servelab.plugins.drafters.ngram:NgramDrafter", options=NgramOptions,
                      description="prompt lookup: propose what followed the last n-gram's earlier occurrence"),
        DrafterPlugin(name="suffix", factory="servelab.plugins.drafters.suffix:SuffixDrafter", options=SuffixOptions,
                      description="suffix decoding: the most frequent continuation in suffix tries over the "
                                  "sequence and over previous outputs"),
        DrafterPlugin(name="draft-model", factory="servelab.plugins.drafters.draft_model:DraftModelDrafter",
                      options=DraftModelOptions,
                      description="a small model with its own KV cache proposes k tokens with their distributions"),
        DrafterPlugin(name="medusa", factory="servelab.plugins.drafters.medusa:MedusaDrafter",
                      options=MedusaOptions,
                      description="Medusa-1 heads on the target's last hidden state (top-1 chain)"),
        DrafterPlugin(name="eagle", factory="servelab.plugins.drafters.eagle:EagleDrafter", options=EagleOptions,
                      description="an EAGLE-style one-layer head on the target's fused features (chain or "
                                  "EAGLE-2 dynamic tree)"),
    ]
