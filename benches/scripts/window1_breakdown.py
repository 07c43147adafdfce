#!/usr/bin/env python3
"""Segments of a window-1 message from a `perf script` trace (see
benches/scripts/window1-breakdown.sh). Node 1 is the master; nodes 2 and 3 mirrors.
Usage: window1_breakdown.py TRACE.txt THREADS (lines "tid N<node>")."""
import collections
import re
import sys

LINE = re.compile(r"\s*(.+?)\s+(\d+) \[(\d+)\]\s+([\d.]+):\s+(\S+): (.*)")


def load(trace, threads):
    node = dict(line.split() for line in open(threads))
    events = []
    for line in open(trace):
        m = LINE.match(line)
        if m:
            _comm, tid, cpu, t, event, rest = m.groups()
            events.append((float(t) * 1e6, node.get(tid, "client"), tid, cpu, event.split(":")[-1], rest.strip()))
    events.sort()
    return node, events


def most_common_read(events, who, lo, hi):
    sizes = collections.Counter(
        e[5] for e in events if e[1] == who and e[4] == "sys_exit_recvfrom" and lo <= int(e[5], 16) <= hi
    )
    return sizes.most_common(1)[0][0]


def segments(events):
    # The publish frame and the AppendEntries body are the commonest reads
    # of their size on the master and on a mirror.
    publish = most_common_read(events, "N1", 0x80, 0xC0)
    append = most_common_read(events, "N2", 0x41, 0xFFFF)
    confirm = "len: 0x00000015"
    out = collections.defaultdict(list)
    i, n = 0, len(events)

    def find(j, pred):
        while j < n and not pred(events[j]):
            j += 1
        return j

    def is_publish(e):
        return e[1] == "N1" and e[4] == "sys_exit_recvfrom" and e[5] == publish

    while True:
        j = find(i, is_publish)
        k = find(j, lambda e: e[1] == "N1" and e[4] == "sys_enter_sendto" and confirm in e[5])
        if k >= n:
            break
        window = events[j : k + 1]
        t_pub, t_ack = events[j][0], events[k][0]

        def first(who, event, arg=None):
            return next((e[0] for e in window if e[1] == who and e[4] == event and (arg is None or e[5] == arg)), None)

        seg = {"master: publish received -> confirm sent": t_ack - t_pub}
        ae = first("N1", "sys_enter_writev")
        if ae is not None:
            seg["master: publish received -> first AppendEntries"] = ae - t_pub
            for m in ("N2", "N3"):
                rv, ss, se, wv = (first(m, "sys_exit_recvfrom", append), first(m, "sys_enter_fdatasync"),
                                  first(m, "sys_exit_fdatasync"), first(m, "sys_enter_writev"))
                if None not in (rv, ss, se, wv) and ae <= rv <= ss <= se <= wv:
                    seg[f"{m}: AppendEntries written -> received"] = rv - ae
                    seg[f"{m}: received -> fdatasync starts"] = ss - rv
                    seg[f"{m}: fdatasync"] = se - ss
                    seg[f"{m}: synced -> answer written"] = wv - se
                    seg[f"{m}: answer written -> confirm sent"] = t_ack - wv
        ss, se = first("N1", "sys_enter_fdatasync"), first("N1", "sys_exit_fdatasync")
        if ss is not None and se is not None and ss <= se:
            seg["N1: fdatasync"] = se - ss
            seg["N1: synced -> confirm sent"] = t_ack - se
        nxt = find(k, is_publish)
        if nxt < n:
            seg["client: confirm sent -> next publish received"] = events[nxt][0] - t_ack
        for name, v in seg.items():
            out[name].append(v)
        i = k + 1
    return out


def wakeups(events, node):
    woken, waits, running, on_busy = {}, [], {}, 0
    for t, _who, _tid, cpu, event, rest in events:
        if event == "sched_wakeup":
            pid = re.search(r"pid=(\d+)", rest).group(1)
            if pid in node:
                woken[pid] = t
                target = re.search(r"target_cpu=(\d+)", rest).group(1)
                on_busy += running.get(target, "0") != "0"
        elif event == "sched_switch":
            nxt = re.search(r"next_pid=(\d+)", rest).group(1)
            running[cpu] = nxt
            if nxt in woken:
                waits.append(t - woken.pop(nxt))
    return waits, on_busy


def pct(v, q):
    v = sorted(v)
    return v[min(len(v) - 1, int(len(v) * q))]


def main():
    node, events = load(sys.argv[1], sys.argv[2])
    for name, v in sorted(segments(events).items()):
        print(f"{name:<50} n={len(v):>5}  p50 {pct(v, 0.5):>6.0f} us  p90 {pct(v, 0.9):>6.0f} us")
    waits, on_busy = wakeups(events, node)
    if waits:
        print(f"node threads woken: {len(waits)}, waited to run p50 {pct(waits, 0.5):.0f} us, "
              f"p90 {pct(waits, 0.9):.0f} us; placed on a busy core: {on_busy}")


if __name__ == "__main__":
    main()
