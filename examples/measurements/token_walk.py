"""How far a sampled token travels inside the engine: the functions it passes through
from the moment the runner hands back logits to the end of the step.

    python examples/measurements/token_walk.py

One engine (builtin:tiny, the n-gram drafter) runs a mixed batch: greedy, seeded
sampling, logprobs, n = 2, prompt logprobs and a periodic prompt the drafter drafts for.
A profiler records every servelab function called from the sampling stage's entry
until the update stage starts (the sampling walk: logits to tokens, drafts verified) and
from there to the end of the step (the update, the retirement of finished requests; the
report left out), and prints for each:

- stops: distinct functions called (the walk a reader follows; comprehensions are not
  counted);
- files: distinct modules those live in;
- hops back up: distinct (function, caller) pairs where a function of one module returns
  into a caller in another.

docs/design.md ("Following a token") quotes its figures before and after the record
refactor.
"""

from __future__ import annotations

import sys
from pathlib import Path

from servelab import LLM, SamplingParams


def servelab_root() -> str:
    import servelab
    return str(Path(servelab.__file__).parent)


def main() -> None:
    llm = LLM("builtin:tiny", seed=0, config={"drafter": {"name": "ngram"}})
    engine = llm.engine
    periodic = [11, 12, 13, 14, 15] * 6
    requests = [
        (periodic, SamplingParams(max_tokens=12, temperature=0)),
        ([5, 6, 7, 8], SamplingParams(max_tokens=12, temperature=0.8, seed=3)),
        ([9, 10, 11], SamplingParams(max_tokens=12, temperature=0, logprobs=2)),
        ([12, 13], SamplingParams(max_tokens=12, temperature=0.8, n=2)),
        ([14, 15, 16, 17], SamplingParams(max_tokens=12, temperature=0, prompt_logprobs=1)),
        (periodic[:20], SamplingParams(max_tokens=12, temperature=0, logprobs=1)),
    ]
    for prompt, params in requests:
        engine.add_request(prompt, params)

    root = servelab_root()
    engine_dir = root + "/"
    sampling_stage = root + "/sampling_stage.py"
    skipped = (root + "/model/", root + "/plugins/", root + "/kit/", root + "/outputs.py")
    walks = {"sampling walk": (set(), set()), "update walk": (set(), set())}
    recording: str | None = None

    def profile(frame, event, arg):  # noqa: ANN001 - sys.setprofile's signature
        nonlocal recording
        if event not in ("call", "return"):
            return
        code = frame.f_code
        filename = code.co_filename
        if recording is None and event == "call" and filename == sampling_stage:
            recording = "sampling walk"
        if not recording or not filename.startswith(engine_dir) or filename.startswith(skipped):
            return
        if code.co_name == "_report" or code.co_name.startswith("<"):  # the report; comprehensions
            return
        if event == "call" and code.co_qualname == "UpdateStage.update":
            recording = "update walk"
        stops, hops = walks[recording]
        if event == "call":
            stops.add((filename[len(engine_dir):], code.co_qualname))
        else:
            caller = frame.f_back
            if caller is not None and caller.f_code.co_filename != filename \
                    and caller.f_code.co_filename.startswith(engine_dir):
                hops.add((code.co_qualname, caller.f_code.co_qualname))

    steps = 0
    while engine.has_unfinished():
        recording = None
        sys.setprofile(profile)
        try:
            engine.step()
        finally:
            sys.setprofile(None)
        steps += 1
    print(f"steps: {steps}")
    for walk, (stops, hops) in walks.items():
        files = sorted({file for file, _ in stops})
        print(f"{walk}: stops {len(stops)}, files {len(files)}, hops back up {len(hops)}")
        for file in files:
            print(f"  {file}: " + ", ".join(sorted(name for f, name in stops if f == file)))


if __name__ == "__main__":
    main()
