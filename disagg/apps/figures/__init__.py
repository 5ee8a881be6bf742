"""`disagg figures`: the tutorials' pictures, measured by `runs`, drawn by `draw` and `layout`.
"""
