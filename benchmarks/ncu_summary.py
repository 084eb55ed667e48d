"""Summarise the raw-page CSVs of benchmarks/ncu_kernels.sh (`ncu --page raw --csv`) as a markdown table: per
kernel launch its grid, time, registers, occupancy, issue rate, tensor-pipe and DRAM use, and the leading warp
stall reasons (cycles per issued instruction). Usage: python benchmarks/ncu_summary.py RAW.csv [RAW.csv ...]"""
import csv
import sys

STALL = "smsp__average_warps_issue_stalled_"
COLUMNS = [  # (heading, metric, format)
    ("grid", "launch__grid_size", "{:.0f}"),
    ("ms", "gpu__time_duration.sum", None),
    ("regs", "launch__registers_per_thread", "{:.0f}"),
    ("smem KB", "launch__shared_mem_per_block_dynamic", None),
    ("warps/SM", "sm__warps_active.avg.per_cycle_active", "{:.1f}"),
    ("IPC", "sm__inst_executed.avg.per_cycle_active", "{:.2f}"),
    ("issue busy %", "sm__issue_active.avg.pct_of_peak_sustained_elapsed", "{:.0f}"),
    ("spill insts", "sass__inst_executed_register_spilling", "{:.0f}"),
    ("tensor pipe %", "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active", "{:.0f}"),
    ("DRAM %", "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed", "{:.0f}"),
    ("cycles/issue", "smsp__average_warp_latency_per_inst_issued.ratio", "{:.1f}"),
]


def _num(s: str) -> float:
    return float(s.replace(",", "")) if s not in ("", "n/a") else float("nan")


def summarise(path: str) -> str:
    rows = list(csv.reader(open(path)))
    hdr, units, data = rows[0], rows[1], rows[2:]
    col = {h: i for i, h in enumerate(hdr)}
    out = ["| # | kernel | " + " | ".join(h for h, _, _ in COLUMNS) + " | top stalls (cycles per issue) |",
           "|---" * (len(COLUMNS) + 3) + "|"]
    for r in data:
        cells = []
        for _, metric, fmt in COLUMNS:
            if metric not in col:
                cells.append("-")
                continue
            v, unit = _num(r[col[metric]]), units[col[metric]]
            if metric == "gpu__time_duration.sum":
                v = v / {"nsecond": 1e6, "ns": 1e6, "usecond": 1e3, "us": 1e3}.get(unit, 1.0)
                cells.append(f"{v:.3f}")
            elif metric == "launch__shared_mem_per_block_dynamic":
                v = v / {"byte": 1024, "byte/block": 1024, "Mbyte": 1 / 1024, "Mbyte/block": 1 / 1024}.get(unit, 1.0)
                cells.append(f"{v:.0f}")
            else:
                cells.append(fmt.format(v))
        stalls = sorted(((_num(r[i]), h[len(STALL):].replace("_per_issue_active.ratio", ""))
                         for h, i in col.items() if h.startswith(STALL) and h.endswith("_per_issue_active.ratio")),
                        reverse=True)[:4]
        top = ", ".join(f"{name} {v:.2f}" for v, name in stalls)
        name = r[col["Kernel Name"]]
        out.append(f"| {r[col['ID']]} | {name} | " + " | ".join(cells) + f" | {top} |")
    return "\n".join(out)


if __name__ == "__main__":
    for p in sys.argv[1:]:
        print(f"{p}\n\n{summarise(p)}\n")
