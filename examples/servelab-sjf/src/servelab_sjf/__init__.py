"""servelab-sjf: an example third-party servelab plugin package.

Policies (registered in `servelab_sjf.plugin`): the `sjf` scheduler, the `paged-lifo`
allocator and the `repeat-lookup` drafter. Each passes servelab's conformance suite
(see tests/).
"""

__version__ = "0.1.0"
