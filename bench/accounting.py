"""Print the parameter, active-parameter and cache-byte accounting of a flavor.

    python bench/accounting.py            # flash (the released config)
    python bench/accounting.py debug --roles

Output: one JSON line per family and per total (stdout, machine-readable), then a readable table
and, with --roles, the layer-role table. Analytic only (model.accounting); builds no model.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from model.accounting import FAMILIES, report  # noqa: E402
from model.config import FLAVORS, get_flavor  # noqa: E402


def _human(n: float) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:,.3f}{unit}"
    return f"{n:,.0f}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("flavor", nargs="?", default="flash", choices=sorted(FLAVORS))
    parser.add_argument("--roles", action="store_true", help="also print the layer-role table")
    opts = parser.parse_args(argv)
    args = get_flavor(opts.flavor)
    r = report(args)
    params, prefill, decode, cache = r["params"], r["active_prefill"], r["active_decode"], r["cache"]

    for family in (*FAMILIES, "backbone", "total"):
        row = {"flavor": opts.flavor, "family": family, "params": params[family]}
        if family != "backbone":  # active counts are defined per family and for the total only
            row |= {"active_prefill": prefill.get(family, 0), "active_decode": decode.get(family, 0)}
        print(json.dumps(row))
    print(json.dumps({"flavor": opts.flavor, "cache": cache}))

    print(f"\n{opts.flavor}: {args.n_layers} layers + {args.n_mtp_layers} DSpark stages, dim {args.dim}")
    print(f"{'family':<16}{'params':>16}{'prefill/token':>16}{'decode/token':>16}")
    for family in (*FAMILIES, "backbone", "total"):
        a, d = _human(prefill.get(family, 0)), _human(decode.get(family, 0))
        if family == "backbone":
            a = d = ""
        print(f"{family:<16}{_human(params[family]):>16}{a:>16}{d:>16}")
    print(
        "backbone = all but engram_table, dspark, vision (the report's 552B). Active: decode = all "
        "layers with top-k experts + final norm + head; prefill = encoder layers + the first decoder "
        "layer's bank projection (see model/accounting.py)."
    )
    print(
        f"global KV: {cache['global_entries_per_token']:g} entries/token x "
        f"({cache['main_kv_entry_bytes']} + {cache['index_key_entry_bytes']}) B = "
        f"{cache['global_bytes_per_token']:g} B/token "
        f"(bf16 view {cache['global_bytes_per_token_bf16']:g} B); "
        f"SWA ring {cache['swa_bytes_per_layer']:,} B/layer x {cache['swa_rings']} = "
        f"{cache['swa_bytes_per_sequence']:,} B/sequence"
    )
    if opts.roles:
        print(f"\n{'layer':>5} {'ratio':>5} {'role':<8} {'kv_src':>6} {'idx_src':>7}  flags")
        for row in args.role_table():
            flags = [k for k in ("engram", "candidate_source", "dspark_target", "mtp") if row[k]]
            kv = "" if row["kv_source"] is None else row["kv_source"]
            idx = "" if row["index_source"] is None else row["index_source"]
            print(f"{row['layer']:>5} {row['ratio']:>5} {row['role']:<8} {kv:>6} {idx:>7}  {' '.join(flags)}")


if __name__ == "__main__":
    main()
