"""Built-in drafters (speculative decoding). None ship yet: the hook is in place."""

import servelab


@servelab.hookimpl
def servelab_register_drafters():
    return []
