"""Programs: the `disagg` CLI, the demo (and its deployment presets), generate, plan, figures.
The library never imports this package.
"""
