"""Built-in logits processors: vLLM's penalties, logit_bias, min_tokens, bad_words, and
structured output (xgrammar). Each is selected by its SamplingParams field."""

import servelab
from servelab.plugin_types import LogitsProcessorPlugin
from servelab.plugins.logits_processors.options import StructuredOptions

_HERE = "servelab.plugins.logits_processors"


@servelab.hookimpl
def servelab_register_logits_processors():
    return [
        LogitsProcessorPlugin(name="logit_bias", factory=f"{_HERE}.bias:LogitBias",
                              description="adds SamplingParams.logit_bias {token id: bias} to the logits"),
        LogitsProcessorPlugin(name="min_tokens", factory=f"{_HERE}.bans:MinTokens",
                              description="bans EOS and stop_token_ids until min_tokens tokens are out"),
        LogitsProcessorPlugin(name="bad_words", factory=f"{_HERE}.bans:BadWords",
                              description="bans the last token of any bad_words sequence the output would complete"),
        LogitsProcessorPlugin(name="repetition_penalty", factory=f"{_HERE}.penalties:RepetitionPenalty",
                              description="divides positive (multiplies negative) logits of prompt and output tokens"),
        LogitsProcessorPlugin(name="frequency_penalty", factory=f"{_HERE}.penalties:FrequencyPenalty",
                              description="subtracts frequency_penalty x each token's count in the output"),
        LogitsProcessorPlugin(name="presence_penalty", factory=f"{_HERE}.penalties:PresencePenalty",
                              description="subtracts presence_penalty from every token already in the output"),
        LogitsProcessorPlugin(name="structured", factory=f"{_HERE}.structured:StructuredOutputProcessor",
                              options=StructuredOptions,
                              description="JSON schema / regex / EBNF via xgrammar token bitmasks (runs last)"),
    ]
