#!/usr/bin/env bash
# cupy-paged on a GPU, in one run: kernel conformance tests (quantized caches included)
# and engine end to end (tests/test_cupy_kernels.py), the host tier's asynchronous CUDA
# copies (tests/test_tier_copy.py), then the decode bandwidth benchmark
# (examples/gpu_bench_attention.py). Results go to $OUT (or a temporary folder).
#
# Needs python3 with torch (CUDA), cupy, transformers, pytest, hypothesis and this
# project's pure-Python dependencies; installs nothing from the internet. A missing
# pure-Python package (structlog, say) can be carried as wheels in ./.whl: they are
# installed into /tmp/site first. See docs/attention.md, "GPU check".
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$(mktemp -d)}"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
start=$(date +%s)

if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
# servelab itself (entry points register the built-in plugins); offline, no dependencies.
"$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 \
    || { cat "$OUT/install.log"; exit 1; }
"$PY" - <<'PYEOF' 2>&1 | tee "$OUT/env.txt"
import cupy, torch
print("torch", torch.__version__, "cupy", cupy.__version__, torch.cuda.get_device_name(),
      "cuda runtime", cupy.cuda.runtime.runtimeGetVersion(), "driver", cupy.cuda.runtime.driverGetVersion())
PYEOF

XDIST=""
"$PY" -c "import xdist" 2>/dev/null && XDIST="-n 4"
timeout 400 "$PY" -m pytest -q -p no:cacheprovider $XDIST tests/test_cupy_kernels.py tests/test_tier_copy.py 2>&1 | tee "$OUT/tests.log"
tests_rc=${PIPESTATUS[0]}

timeout 120 "$PY" examples/gpu_bench_attention.py --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log"
bench_rc=${PIPESTATUS[0]}

echo "gpu_check: tests rc=$tests_rc, bench rc=$bench_rc, $(( $(date +%s) - start )) s; results in $OUT" | tee "$OUT/summary.txt"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
