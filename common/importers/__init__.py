"""Importers of other systems' configs (AReaL, ROLL, cosmos-rl, RLinf) and the coverage table of their keys.

`reader.import_file(system, path)` is `rlstream config import --from SYSTEM FILE`; the key tables of
`roll`, `cosmos` and `rlinf` (rules in `rules`) and AReaL's `common/areal.py` decide every key, and
`coverage` classifies the keys of the seed references with those same tables.
"""
