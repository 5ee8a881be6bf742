"""Programs: the `disagg` CLI, the demo, generate, plan, figures. The library never imports
this package.
"""
