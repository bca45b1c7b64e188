"""The tests exercise the installed package, entry points included."""

try:
    import servelab_sjf  # noqa: F401
except ImportError as exc:  # a clear message instead of a bare ModuleNotFoundError per module
    raise ImportError("servelab-sjf is not installed: run `pip install -e examples/servelab-sjf` "
                      "(from the servelab checkout)") from exc
