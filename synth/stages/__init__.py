"""The factory's stages, in order: ingest, feasibility, specify, build, solve, inspect.

Each module exposes `NAME`, `OUTPUT` (its record type), `units(inputs, ctx)` (the units of work:
one output record each, keyed) and `process(unit, ctx)` (one unit -> one record).
"""
