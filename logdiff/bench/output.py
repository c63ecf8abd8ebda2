"""What `logdiff bench` prints and writes: tables of throughput and ratios, the issue's targets, the
published peer figures (other hardware), a JSON envelope, a speed-up badge and a throughput plot."""

from __future__ import annotations

import re
from pathlib import Path

from logdiff import report
from logdiff.api import Processing
from logdiff.bench.peers import CLAIM_SOURCE, CLAIMED_SPEEDUP, PEER_FIGURES
from logdiff.bench.stats import (
    READINGS,
    TARGETS,
    claim_reading,
    fmt_spread,
    paired_ratio,
    spread,
)

BADGE_CASE = "decode-b32"


def ratios(result: dict) -> list[dict]:
    """Every reading (numerator / denominator) that both stacks measured, per case."""
    rows = []
    for case, r in result["cases"].items():
        tps = r["tokens_per_s"]
        for label, num, den in READINGS:
            if num in tps and den in tps:
                rows.append({"case": case, "reading": label, "numerator": num, "denominator": den,
                             **paired_ratio(tps[num], tps[den])})
    return rows


def targets(result: dict) -> list[dict]:
    rows = []
    for t in TARGETS:
        case = result["cases"].get(t.case, {})
        tps = case.get("tokens_per_s", {})
        if t.denominator == "bound" and t.numerator in case.get("limit_fraction", {}):
            s = spread(case["limit_fraction"][t.numerator])
        elif t.numerator in tps and t.denominator in tps:
            s = paired_ratio(tps[t.numerator], tps[t.denominator])
        else:
            continue
        rows.append({"target": t.label, "measured": s, "met": s["median"] >= t.at_least})
    return rows


def _tiers(result: dict) -> str:
    return ", ".join(f"{dtypes} {tier}" for dtypes, tier in result.get("gemm_tiers", {}).items()) or "tiers not recorded"


def print_summary(result: dict) -> None:
    parallel = result.get("parallel") or {}
    sharded = (", sharded " + " ".join(f"{k} {v}" for k, v in parallel.items())) if parallel else ""
    sampling = dict(result.get("sampling") or {})
    temperature = sampling.pop("temperature", 0.0)
    sampled = f", temperature {temperature:g}, {Processing(**sampling).describe()}" if temperature else ""
    depth = f" (--layers {result['layers']})" if result.get("layers") else ""
    print(f"logdiff bench: {result['model']}{depth} {result['dtype']}{sharded}{sampled}, {result['repeats']} interleaved "
          f"repeats, {result['threads']} threads, logdiff GEMM {_tiers(result)}, load average "
          f"{result['loadavg']['before'][0]:.2f} -> {result['loadavg']['after'][0]:.2f}, {result['wall_seconds']:.0f} s")
    rows = []
    for case, r in result["cases"].items():
        row = {"case": case, "what": r["describe"]}
        for name, values in r["tokens_per_s"].items():
            row[name] = fmt_spread(spread(values))
        for name, reason in r["skipped"].items():
            row[name] = f"skipped: {reason}"
        rows.append(row)
    print("\ntokens/s, median [min-max] over repeats")
    print(report.table(rows))
    _print_checks(result)
    _print_limits(result)
    ratio_rows = ratios(result)
    if ratio_rows:
        print("\nratios, median [min-max] of per-repeat ratios")
        by_case: dict[str, dict] = {}
        for r in ratio_rows:
            column = f"{r['reading']} ({r['numerator']}/{r['denominator']})"
            by_case.setdefault(r["case"], {"case": r["case"]})[column] = fmt_spread(r, "x")
        print(report.table(list(by_case.values())))
        claim = [r for r in ratio_rows if r["reading"] == "the claim"]
        if claim:
            low, high = CLAIMED_SPEEDUP
            print(f"\nthe claim ({low}-{high}x, {CLAIM_SOURCE}): "
                  + "; ".join(f"{r['case']} {r['median']:.2f}x {claim_reading(r['median'], low, high)}" for r in claim))
    target_rows = targets(result)
    if target_rows:
        print("\ntargets (reported, not asserted)")
        print(report.table([{"target": t["target"], "measured": fmt_spread(t["measured"], "x"),
                             "met": "yes" if t["met"] else "NO"} for t in target_rows]))
    print("\npublished figures, each on its authors' own hardware (context only, not comparable to this machine)")
    print(report.table([{"who": p.who, "what": p.what, "slowdown": f"{p.slowdown:g}x", "hardware": p.hardware}
                        for p in PEER_FIGURES]))


def limits(result: dict) -> dict:
    """The machine's measured limits and, per case that has a bound, each stack's fraction of it."""
    cases = {c: {**r["bound"], "fraction": {name: spread(f) for name, f in r["limit_fraction"].items()}}
             for c, r in result["cases"].items() if r.get("bound")}
    return {"machine": result.get("machine"), "cases": cases}


def _print_limits(result: dict) -> None:
    lim = limits(result)
    if not lim["cases"]:
        return
    m = lim["machine"]
    print(f"\nthe limit: memory bandwidth {m['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s, GEMM peak "
          f"{m['gemm_flop_per_s'] / 1e9:.0f} GFLOP/s ({m['gemm_dtype']}, {m['threads']} threads), measured this run; "
          "fraction of the bound, median [min-max]")
    rows = []
    for case, b in lim["cases"].items():
        row = {"case": case, "bound": f"{b['bound_tokens_per_s']:.4g} tokens/s ({b['limit']})"}
        row.update({name: fmt_spread(s) for name, s in b["fraction"].items()})
        rows.append(row)
    print(report.table(rows))


def _print_checks(result: dict) -> None:
    lines = []
    for case, r in result["cases"].items():
        for name, c in r.get("token_check", {}).items():
            if not c["same_counts"]:
                lines.append(f"{case}: {name} generated a different number of tokens than {c['against']}: NOT the same work")
            elif c["equal_ids"] != c["ids"]:
                d = c["first_difference"]
                lines.append(f"{case}: {name} ids equal to {c['against']}'s for {c['equal_ids']}/{c['ids']} tokens "
                             f"(first difference: request {d['request']}, token {d['index']}); same token count")
        for name, c in r.get("output_check", {}).items():
            if name != c["against"]:
                lines.append(f"{case}: {name} output vs {c['against']}: max |diff| {c['max_abs_diff']:.3g} "
                             f"(max |output| {c['max_abs_reference']:.3g})")
        for name, sides in r.get("fidelity", {}).items():
            lines.append(f"{case}: {name} max |logp - logp_fp64| rollout {report.fmt_float(sides['rollout']['max_abs_error'])}, "
                         f"trainer {report.fmt_float(sides['trainer']['max_abs_error'])}"
                         + ("" if all(f["holds"] for f in sides.values()) else " -- outside C0's bounds: NOT the model"))
    if lines:
        print("\nsame-work checks")
        print("\n".join(lines))


def write_outputs(result: dict, out: Path) -> list[Path]:
    parallel = result.get("parallel") or {}
    sharded = "".join(f"-{k.replace('_', '')}{v}" for k, v in parallel.items() if v > 1)
    depth = f"-{result['layers']}l" if result.get("layers") else ""
    stem = f"{_slug(result['model'])}{depth}-{result['dtype']}{sharded}"
    json_path, badge_path, plot_path = out / f"bench-{stem}.json", out / f"speedup-{stem}.svg", out / f"throughput-{stem}.png"
    workload = {"model": result["model"], "layers": result.get("layers"), "dtype": result["dtype"],
                "repeats": result["repeats"], "parallel": parallel,
                "cases": {c: {k: v for k, v in r.items() if k in ("kind", "describe", "batch", "prompt_len",
                                                                   "new_tokens", "counted_tokens")}
                          for c, r in result["cases"].items()}}
    stacks = [{"name": name,
               "cases": {c: {"tokens_per_s": r["tokens_per_s"][name], "seconds": r["seconds"][name],
                             "spread": spread(r["tokens_per_s"][name])}
                         for c, r in result["cases"].items() if name in r["tokens_per_s"]},
               "skipped": {c: r["skipped"][name] for c, r in result["cases"].items() if name in r["skipped"]}}
              for name in result["stacks"]]
    data = report.envelope(
        "bench", workload, stacks,
        ratios=ratios(result), targets=targets(result),
        checks={c: {"tokens": r.get("token_check", {}), "outputs": r.get("output_check", {}),
                    "fidelity": r.get("fidelity", {})}
                for c, r in result["cases"].items()},
        profiles={c: r["profiles"] for c, r in result["cases"].items() if r.get("profiles")},
        limits=limits(result), loadavg=result["loadavg"], wall_seconds=result["wall_seconds"],
        peers={"note": "published by each source on its own hardware; not comparable to this machine",
               "claimed_speedup": list(CLAIMED_SPEEDUP), "claim_source": CLAIM_SOURCE,
               "figures": [p.to_dict() for p in PEER_FIGURES]},
    )
    report.write_json(json_path, data)
    written = [json_path]
    if _write_badge(result, badge_path):
        written.append(badge_path)
    if _write_plot(result, plot_path):
        written.append(plot_path)
    return written


def _slug(model: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(model).name or model)


def _write_badge(result: dict, path: Path) -> bool:
    """Speed-up of reference over naive (the claim) at decode batch 32, or the first case that has it."""
    import anybadge

    claim = [r for r in ratios(result) if r["reading"] == "the claim"]
    if not claim:
        return False
    headline = next((r for r in claim if r["case"] == BADGE_CASE), claim[0])
    low, _ = CLAIMED_SPEEDUP
    badge = anybadge.Badge(f"speed-up vs naive ({headline['case']}, {result['dtype']})", f"{headline['median']:.2f}x",
                           default_color="green" if headline["median"] >= low else "orange")
    report.write_text(path, badge.badge_svg_text)
    return True


def _write_plot(result: dict, path: Path) -> bool:
    """Decode tokens/s against batch size, one line per stack, bars at min-max."""
    decode = sorted(((r["batch"], r) for r in result["cases"].values() if r["kind"] == "decode"), key=lambda br: br[0])
    if not decode:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in result["stacks"]:
        points = [(b, spread(r["tokens_per_s"][name])) for b, r in decode if name in r["tokens_per_s"]]
        if not points:
            continue
        xs = [b for b, _ in points]
        med = [s["median"] for _, s in points]
        err = [[s["median"] - s["min"] for _, s in points], [s["max"] - s["median"] for _, s in points]]
        ax.errorbar(xs, med, yerr=err, marker="o", capsize=3, label=name)
    bounds = [(b, r["bound"]["bound_tokens_per_s"]) for b, r in decode if r.get("bound")]
    if bounds:
        ax.plot([b for b, _ in bounds], [v for _, v in bounds], "k--", label="weight-bandwidth bound")
        ax.set_yscale("log")
    ax.set_xscale("log", base=2)
    ax.set_xticks([b for b, _ in decode], [str(b) for b, _ in decode])
    ax.set_xlabel("decode batch size")
    ax.set_ylabel("decode tokens/s (median, bars: min-max)")
    ax.set_title(f"Eager-mode decode throughput, {result['model']} {result['dtype']}")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    report.write_atomic(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110))
    plt.close(fig)
    return True
