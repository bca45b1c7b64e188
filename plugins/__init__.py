"""servelab's built-in policies. Each subpackage is an ordinary plugin module,
registered through the distribution's `servelab.plugins` entry points."""
