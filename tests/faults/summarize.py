#!/usr/bin/env python3
"""Sums up campaign output (the `seed=... result=...` lines of
campaign.py) for the runs tables of docs/reliability.md and tests/faults/runs/HISTORY.md: runs, passes,
confirmed, lost, duplicates, and how often each fault kind ran.

    python3 tests/faults/summarize.py tests/faults/runs/powercut-*.txt
"""

import collections
import re
import sys

LINE = re.compile(r"^seed=(\d+)(?: broker=\S+)? nodes=(\d+) faults=\[(.*)\] (.*)$")


def kind(desc):
    """`powercut-all-torn(n1,n2,n3,8s)` -> `powercut-all`; the campaign's
    descriptions add the variant (cut/torn, where, room) to the kind."""
    name = desc.split("(", 1)[0]
    for k in ("powercut-all", "powercut", "corrupt", "fsync-eio", "slow-disk", "disk-full", "kill9-unacked",
              "kill9", "sigstop", "partition", "restart", "move", "classic", "pause-heal"):
        if name == k or name.startswith(k + "-"):
            return k
    return name


def main(paths):
    runs = []
    for p in paths:
        with open(p, errors="replace") as f:
            for line in f:
                m = LINE.match(line.strip())
                if not m:
                    continue
                fields = dict(kv.split("=", 1) for kv in m.group(4).split() if "=" in kv)
                faults = [d.strip() for d in re.split(r",\s(?![^()]*\))", m.group(3)) if d.strip()]
                runs.append((int(m.group(1)), int(m.group(2)), faults, fields))
    if not runs:
        sys.exit("no result lines found")
    kinds = collections.Counter(kind(d) for _, _, fs, _ in runs for d in fs)
    by_nodes = collections.Counter(n for _, n, _, _ in runs)
    whole = sum(1 for _, _, fs, _ in runs if any(kind(d) == "powercut-all" for d in fs))
    cut = sum(1 for _, _, fs, _ in runs if any(kind(d) in ("powercut", "powercut-all") for d in fs))
    dups = [int(f.get("duplicates", 0)) for *_, f in runs]
    print(f"runs: {len(runs)} ({', '.join(f'{c} on {n} nodes' for n, c in sorted(by_nodes.items()))})")
    print(f"pass: {sum(1 for *_, f in runs if f.get('result') == 'PASS')}")
    print(f"seeds: {min(r[0] for r in runs)}-{max(r[0] for r in runs)}")
    print(f"with a power cut: {cut}; with a whole-cluster power cut: {whole}")
    print(f"confirmed: {sum(int(f.get('confirmed', 0)) for *_, f in runs):,}")
    print(f"lost: {sum(int(f.get('lost', 0)) for *_, f in runs)}")
    print(f"unexpected: {sum(int(f.get('unexpected', 0)) for *_, f in runs)}")
    print(f"duplicates per run: {min(dups)}-{max(dups)}")
    print(f"data dirs set aside: {sum(int(f.get('set_aside', 0)) for *_, f in runs)}")
    print(f"wedged: {sum(int(f.get('wedged', 0)) for *_, f in runs)}; splits: "
          f"{sum(int(f.get('splits', 0)) for *_, f in runs)}; panics: "
          f"{sum(int(f.get('node_panics', 0)) for *_, f in runs)}")
    print("faults: " + ", ".join(f"{k} x{c}" for k, c in kinds.most_common()))
    for seed, n, _, f in runs:
        if f.get("result") != "PASS":
            print(f"FAILED: seed {seed} ({n} nodes)")


if __name__ == "__main__":
    main(sys.argv[1:])
