"""An OpenAI-compatible HTTP server around the engine (`servelab serve`).

    servelab serve --model DIR --port 8000

Starlette on uvicorn; the synchronous engine's step loop (engine_core) runs in a process
of its own (engine_process), or as Ray actors with `--replicas N` (replicas), behind one
front end (engine_loop); requests become engine requests (generation), and `/metrics`
speaks Prometheus (metrics). Needs the `serve` extra: `pip install 'servelab[serve]'`.
"""

from servelab.server.serve import ServerOptions, run_server

__all__ = ["ServerOptions", "run_server"]
