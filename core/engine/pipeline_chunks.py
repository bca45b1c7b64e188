"""Chunk sizing for pipelined prompts: a documented seam (`servelab.contracts.pipeline.ChunkSizing`).

- `fixed`: every chunk `max_chunk` tokens, the last what is left (vLLM's chunked prefill).
- `equal_time`: chunks sized so each takes about as long at a stage as the first
  (`max_chunk` tokens at no context): a later chunk attends to more context, so it gets
  fewer tokens (SGLang's dynamic chunking). Equal stage times keep the pipeline's stages
  from waiting on a slow chunk.
"""

from __future__ import annotations

from servelab.contracts.pipeline import CHUNK_SIZING_CONTRACT_VERSION, ChunkTime


def _check(prompt_len: int, max_chunk: int) -> None:
    if prompt_len < 1 or max_chunk < 1:
        raise ValueError(f"chunking a prompt of {prompt_len} tokens into chunks of at most {max_chunk}: "
                         f"both must be at least 1")


class FixedChunks:
    name = "fixed"
    contract_version = CHUNK_SIZING_CONTRACT_VERSION

    def chunks(self, prompt_len: int, max_chunk: int, chunk_time: ChunkTime) -> list[int]:
        _check(prompt_len, max_chunk)
        full, rest = divmod(prompt_len, max_chunk)
        return [max_chunk] * full + ([rest] if rest else [])


class EqualTimeChunks:
    name = "equal_time"
    contract_version = CHUNK_SIZING_CONTRACT_VERSION

    def chunks(self, prompt_len: int, max_chunk: int, chunk_time: ChunkTime) -> list[int]:
        _check(prompt_len, max_chunk)
        target = chunk_time(min(max_chunk, prompt_len), 0)
        out, done = [], 0
        while done < prompt_len:
            low, high = 1, min(max_chunk, prompt_len - done)
            while low < high:  # the longest chunk from here that fits the first chunk's time
                middle = (low + high + 1) // 2
                if chunk_time(middle, done) <= target:
                    low = middle
                else:
                    high = middle - 1
            out.append(low)
            done += low
        return out


CHUNK_SIZINGS = {"fixed": FixedChunks, "equal_time": EqualTimeChunks}


def chunk_sizing(name: str):
    if name not in CHUNK_SIZINGS:
        raise ValueError(f"unknown chunk sizing {name!r}; known: {', '.join(CHUNK_SIZINGS)}")
    return CHUNK_SIZINGS[name]()
