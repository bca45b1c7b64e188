"""The built-in logits processors pass LogitsProcessorContract, as a third-party one would."""

from __future__ import annotations

from servelab import SamplingParams, StructuredOutput
from servelab.testing import LogitsProcessorContract

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "enum": ["ab", "cd"]},
                                           "ok": {"type": "boolean"}},
          "required": ["name", "ok"], "additionalProperties": False}


class TestRepetitionPenalty(LogitsProcessorContract):
    plugin_name = "repetition_penalty"
    requests = [SamplingParams(repetition_penalty=1.5), SamplingParams(repetition_penalty=0.7)]


class TestFrequencyPenalty(LogitsProcessorContract):
    plugin_name = "frequency_penalty"
    requests = [SamplingParams(frequency_penalty=1.0), SamplingParams(frequency_penalty=-0.5)]


class TestPresencePenalty(LogitsProcessorContract):
    plugin_name = "presence_penalty"
    requests = [SamplingParams(presence_penalty=1.5), SamplingParams(presence_penalty=-1.0)]


class TestLogitBias(LogitsProcessorContract):
    plugin_name = "logit_bias"
    requests = [SamplingParams(logit_bias={5: 10.0, 17: -100}), SamplingParams(logit_bias={3: 2.5})]


class TestMinTokens(LogitsProcessorContract):
    plugin_name = "min_tokens"
    requests = [SamplingParams(min_tokens=3), SamplingParams(min_tokens=1, stop_token_ids=[7, 9])]


class TestBadWords(LogitsProcessorContract):
    plugin_name = "bad_words"
    requests = [SamplingParams(bad_words=["the", "import os"]), SamplingParams(bad_words=["def"])]


class TestStructured(LogitsProcessorContract):
    plugin_name = "structured"
    max_examples = 8
    requests = [SamplingParams(structured=StructuredOutput.json(SCHEMA)),
                SamplingParams(structured=StructuredOutput.regex(r"[a-c]{2,5}x")),
                SamplingParams(structured=StructuredOutput.grammar('root ::= "yes" | "no" | "(" root ")"'))]
