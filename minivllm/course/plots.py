"""Plot helpers shared by several chapters (matplotlib, imported lazily)."""

from __future__ import annotations

from minivllm.utils import cdiv


def draw_block_map(ax, tables: dict[str, list[int]], num_blocks: int, columns: int = 16,
                   title: str | None = None, colors: dict[str, object] | None = None) -> dict:
    """The KV cache as a grid of blocks coloured by the request holding them (``tables``, as
    ``views.block_tables`` returns), each labelled with its index in the request's block table.
    Returns the colours used, for a series of maps to keep each request's colour."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle
    colors = dict(colors or {})
    palette = plt.get_cmap("tab20").colors
    for rid in tables:
        colors.setdefault(rid, palette[len(colors) % len(palette)])
    owner = {}
    for rid, blocks in tables.items():
        for i, b in enumerate(blocks):
            owner[b] = (rid, i)
    rows = cdiv(num_blocks, columns)
    for b in range(num_blocks):
        r, c = divmod(b, columns)
        rid, i = owner.get(b, (None, None))
        ax.add_patch(Rectangle((c, rows - 1 - r), 0.95, 0.95, edgecolor="0.6",
                               facecolor=colors[rid] if rid else "white"))
        if rid is not None:
            ax.text(c + 0.475, rows - 1 - r + 0.475, str(i), ha="center", va="center", fontsize=7)
    _grid_axes(ax, columns, rows, f"KV blocks 0..{num_blocks - 1}, row by row "
               "(number: index in the request's block table)")
    if tables:
        ax.legend(handles=[Patch(facecolor=colors[r], label=f"request {r}") for r in tables],
                  loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    if title:
        ax.set_title(title)
    return colors


def _grid_axes(ax, columns: int, rows: int, xlabel: str) -> None:
    ax.set_xlim(0, columns)
    ax.set_ylim(0, rows)
    ax.set_aspect("equal")
    ax.set_xticks([])
    ax.set_yticks([])
    ax.set_xlabel(xlabel)


def draw_batching_timeline(ax, trace: list[dict], request_ids: list[str]) -> int:
    """One row per request, one cell per engine step: orange a prefill, blue a decode, hatched
    grey a step the request sat out while running (v0's prefill steps pause every decode).
    Returns how many such paused cells there are."""
    import matplotlib.pyplot as plt
    steps_of = {rid: [t["step"] for t in trace if any(r == rid for r, _, _ in t["scheduled"])]
                for rid in request_ids}
    paused = 0
    for row, rid in enumerate(request_ids):
        for t in trace:
            kind = next((k for r, _, k in t["scheduled"] if r == rid), None)
            if kind is not None:
                ax.barh(row, 1, left=t["step"] - 0.5, edgecolor="white",
                        color="tab:orange" if kind == "prefill" else "tab:blue")
            elif steps_of[rid] and steps_of[rid][0] < t["step"] < steps_of[rid][-1]:
                ax.barh(row, 1, left=t["step"] - 0.5, color="0.85", edgecolor="white", hatch="///")
                paused += 1
    ax.set_yticks(range(len(request_ids)), request_ids)
    ax.invert_yaxis()
    ax.set_xlabel("engine step")
    ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=c, hatch=h) for c, h in
                       (("tab:orange", ""), ("tab:blue", ""), ("0.85", "///"))],
              labels=["prefill (whole prompt)", "decode (one token)", "running, but paused"],
              loc="upper right", fontsize=8)
    return paused


def draw_token_timeline(ax, token_times: dict[str, list[float]], t0: float,
                        marks: dict | None = None,
                        highlight: str | None = None, title: str | None = None,
                        unit: str = "s") -> None:
    """One row per request, one tick per output token at its time minus ``t0``; ``marks``
    ({label: time}) as vertical lines, ``highlight`` (a request id) in red."""
    rids = list(token_times)
    scale = 1e3 if unit == "ms" else 1.0
    rows = [[(t - t0) * scale for t in token_times[r]] for r in rids]
    colors = ["tab:red" if r == highlight else "tab:blue" for r in rids]
    ax.eventplot(rows, colors=colors, lineoffsets=range(len(rids)), linelengths=0.7, linewidths=1)
    ax.set_yticks(range(len(rids)), rids, fontsize=7)
    ax.invert_yaxis()
    for (label, t), style in zip((marks or {}).items(), ("--", ":", "-.")):
        ax.axvline((t - t0) * scale, color="k", linestyle=style, linewidth=1, label=label)
    if marks:
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    ax.set_xlabel(f"time since the long prompt arrived ({unit})")
    if title:
        ax.set_title(title, fontsize=10)


def draw_tpot_cdf(ax, gaps: dict[str, list[float]], unit: str = "ms",
                  title: str | None = None) -> None:
    """The distribution of times between consecutive output tokens, one curve per run, P99s
    marked."""
    from minivllm.benchmarks.common import percentile
    scale = 1e3 if unit == "ms" else 1.0
    for label, values in gaps.items():
        v = sorted(g * scale for g in values)
        if not v:
            continue
        y = [(i + 1) / len(v) for i in range(len(v))]
        line, = ax.step(v, y, where="post", label=f"{label} (P99 {percentile(v, 99):.0f} {unit})")
        ax.axvline(percentile(v, 99), color=line.get_color(), linestyle=":", linewidth=1)
    plain_log_axis(ax.xaxis)
    ax.set_xlabel(f"time per output token ({unit}, log scale)")
    ax.set_ylabel("fraction of tokens")
    ax.axhline(0.99, color="0.6", linewidth=0.8)
    ax.legend(loc="lower right", fontsize=8)
    if title:
        ax.set_title(title, fontsize=10)


def draw_tpot_over_time(ax, token_times: dict[str, list[float]], t0: float, unit: str = "ms",
                       title: str | None = None) -> None:
    """Each gap between consecutive tokens drawn as a step over the interval it lasted, one
    line per run (a stall: a wide, high step)."""
    scale = 1e3 if unit == "ms" else 1.0
    for label, times in token_times.items():
        edges = [(t - t0) * scale for t in times]
        gaps = [(b - a) * 1e3 for a, b in zip(times, times[1:])]
        ax.stairs(gaps, edges, baseline=None, label=label)
    plain_log_axis(ax.yaxis)
    ax.set_xlabel(f"time since the long prompt arrived ({unit})")
    ax.set_ylabel("time since the previous token (ms, log scale)")
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title, fontsize=10)


def plain_log_axis(axis) -> None:
    """Make ``axis`` a log scale with ticks at 1, 2, 5, 10, 20, ... as plain numbers."""
    from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter
    if axis is axis.axes.xaxis:
        axis.axes.set_xscale("log")
    else:
        axis.axes.set_yscale("log")
    axis.set_major_locator(LogLocator(subs=(1, 2, 5)))
    axis.set_major_formatter(ScalarFormatter())
    axis.set_minor_formatter(NullFormatter())


def draw_scheduler_tick(ax, step: dict, order: list[str], waiting: list[str] | None = None) -> None:
    """One ``get_step_trace()`` step as bars: each request's tokens (decode blue, prefill
    orange), preemptions marked, and the whole step stacked against its token budget."""
    from matplotlib.patches import Patch
    got = {rid: (n, kind) for rid, n, kind in step["scheduled"]}
    preempted = set(step.get("preempted", []))
    color = {"decode": "tab:blue", "prefill": "tab:orange"}
    for i, rid in enumerate(order):
        n, kind = got.get(rid, (0, None))
        if n:
            ax.barh(i, n, color=color[kind])
            ax.text(n + 0.3, i, str(n), va="center", fontsize=8)
        elif rid in preempted:
            ax.text(0.3, i, "preempted: blocks freed, back to the front of the queue",
                    va="center", fontsize=8, color="tab:red")
        elif waiting and rid in waiting:
            ax.text(0.3, i, "waiting", va="center", fontsize=8, color="0.4")
    left = 0
    total_row = len(order) + 0.5
    for rid, n, kind in step["scheduled"]:
        ax.barh(total_row, n, left=left, color=color[kind], edgecolor="white", linewidth=0.5)
        left += n
    budget = step["token_budget"]
    ax.axvline(budget, color="k", linestyle="--", linewidth=1)
    ax.text(budget, -0.9, f" budget {budget}", fontsize=8, va="center")
    ax.set_yticks([*range(len(order)), total_row], [*order, "whole step"], fontsize=8)
    ax.set_ylim(total_row + 0.8, -1.4)
    ax.set_xlim(0, budget * 1.6)
    ax.set_xlabel("tokens scheduled in this step")
    ax.set_title(f"step {step['step']}: {step['num_scheduled_tokens']} of {budget} budget tokens "
                 f"used", fontsize=9)
    ax.legend(handles=[Patch(color="tab:blue", label="decode (1 token)"),
                       Patch(color="tab:orange", label="prefill chunk")],
              loc="center right", fontsize=7)


FREE, CACHED_FREE = "white", "#b8e0b0"


def draw_block_states(ax, states: dict, columns: int = 16, title: str | None = None) -> None:
    """The KV cache as a grid of blocks coloured by state (``views.kv_block_states``): in use
    blue (darker the higher the ref count, which labels it), cached-free green, free white; free
    blocks are labelled with their place in the free queue (#1 is taken next)."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle
    ref_cnt = states["ref_cnt"]
    cached = [h is not None for h in states["block_hash"]]
    place = {b: i + 1 for i, b in enumerate(states["free_order"])}
    blues = plt.get_cmap("Blues")
    num_blocks = len(ref_cnt)
    rows = cdiv(num_blocks, columns)
    for b in range(num_blocks):
        r, c = divmod(b, columns)
        x, y = c, rows - 1 - r
        if ref_cnt[b] > 0:
            shade = min(0.35 + 0.15 * ref_cnt[b], 0.95)
            color, label = blues(shade), str(ref_cnt[b])
            text = dict(color="white" if shade > 0.6 else "black", fontsize=8, weight="bold")
        elif cached[b]:
            color, label, text = CACHED_FREE, f"#{place.get(b, '?')}", dict(color="0.25", fontsize=6)
        elif b in place:  # free, no hash: still in the queue, in the order it was freed
            color, label, text = FREE, f"#{place[b]}", dict(color="0.45", fontsize=6)
        else:
            color, label, text = FREE, "", {}
        ax.add_patch(Rectangle((x, y), 0.95, 0.95, edgecolor="0.6", facecolor=color))
        if label:
            ax.text(x + 0.475, y + 0.475, label, ha="center", va="center", **text)
    _grid_axes(ax, columns, rows, f"KV blocks 0..{num_blocks - 1}, row by row")
    used = sum(1 for n in ref_cnt if n > 0)
    num_cached_free = sum(1 for n, h in zip(ref_cnt, cached) if n == 0 and h)
    ax.legend(handles=[
        Patch(facecolor=blues(0.6), edgecolor="0.6", label=f"in use: {used} (number: ref count)"),
        Patch(facecolor=CACHED_FREE, edgecolor="0.6",
              label=f"cached-free: {num_cached_free} (#k: k-th in the free queue)"),
        Patch(facecolor=FREE, edgecolor="0.6",
              label=f"free: {num_blocks - used - num_cached_free} (#k: k-th in the free queue)"),
    ], loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    if title:
        ax.set_title(title)


def draw_paged_tiles(ax, block_table: list[int], seq_len: int, block_size: int, tile: int,
                     partition: int, num_blocks: int) -> None:
    """How the decode kernel walks one sequence: its tokens cut into partitions and tiles (top),
    each logical block joined to its physical block in the KV cache (bottom)."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle
    colors = plt.get_cmap("tab10")
    used = -(-seq_len // block_size)
    width = num_blocks * block_size  # both rows share the x axis: tokens or slots
    scale = width / max(seq_len, 1)
    for t0 in range(0, seq_len, tile):
        t1 = min(seq_len, t0 + tile)
        part = t0 // partition
        ax.add_patch(Rectangle((t0 * scale, 2.0), (t1 - t0) * scale, 0.8,
                               facecolor=colors(part % 10), alpha=0.35 + 0.25 * ((t0 // tile) % 2),
                               edgecolor="k", linewidth=0.6))
        ax.text((t0 + t1) / 2 * scale, 2.4, f"tile {t0}..{t1 - 1}", ha="center", va="center",
                fontsize=7)
    for p0 in range(0, seq_len, partition):
        ax.text(p0 * scale, 3.0, f"partition {p0 // partition} (program {p0 // partition})",
                fontsize=8, color=colors((p0 // partition) % 10), va="bottom")
    for b in range(num_blocks):
        mine = b in block_table[:used]
        ax.add_patch(Rectangle((b * block_size, 0.0), block_size, 0.8, edgecolor="0.5",
                               facecolor="0.85" if mine else "white"))
        if mine:
            logical = block_table.index(b)
            ax.text((b + 0.5) * block_size, 0.4, f"{logical}", ha="center", va="center", fontsize=7)
    for logical, b in enumerate(block_table[:used]):
        mid = (logical * block_size + min(seq_len, (logical + 1) * block_size)) / 2 * scale
        ax.plot([mid, (b + 0.5) * block_size], [2.0, 0.8], color="0.45", linewidth=0.6)
    ax.set_xlim(0, width)
    ax.set_ylim(-0.2, 3.5)
    ax.set_yticks([0.4, 2.4])
    ax.set_yticklabels(["KV cache blocks\n(number: logical block)", f"the sequence's\n{seq_len} tokens"])
    ax.set_xticks([])


def draw_prefix_caching_runs(runs: dict, num_prompts: int, shared: int, block_size: int,
                             prompt_tokens: int):
    """Chapter 06's panels for ``runs`` ({"prefix caching off" | "prefix caching on": run}):
    mean TTFT, prompt tokens computed and peak KV blocks, the last two split into the system
    prompt's share and each chat's own. Returns (figure, axes)."""
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.patches import Patch
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    names = list(runs)
    color = {"prefix caching off": "tab:red", "prefix caching on": "tab:green"}
    ttft = [np.mean(r["ttfts_s"]) for r in runs.values()]
    bars = axes[0].bar(names, ttft, color=[color[n] for n in names], width=0.5)
    axes[0].bar_label(bars, [f"{t:.1f} s" for t in ttft])
    axes[0].set_ylabel("mean time to first token (s)")
    hits = [r["prefix_cache_hit_tokens"] for r in runs.values()]
    system_tokens = [num_prompts * shared - h for h in hits]
    system_blocks = [num_prompts * (shared // block_size) if h == 0 else shared // block_size
                     for h in hits]
    for ax, system, total, label in [
        (axes[1], system_tokens, [prompt_tokens - h for h in hits], "prompt tokens computed"),
        (axes[2], system_blocks, [r["peak_kv_blocks_used"] for r in runs.values()],
         f"KV blocks in use at the peak ({block_size} tokens each)"),
    ]:
        ax.bar(names, system, color=[color[n] for n in names], width=0.5, label="the system prompt")
        bars = ax.bar(names, [t - s for t, s in zip(total, system)], bottom=system, width=0.5,
                      color=[color[n] for n in names], alpha=0.4, label="each chat's own")
        ax.bar_label(bars, [f"{t:,}" for t in total])
        ax.set_ylabel(label)
        ax.legend(handles=[Patch(color="0.3", label="the system prompt"),
                           Patch(color="0.3", alpha=0.4, label="each chat's own")],
                  fontsize=8, loc="upper right")
    for ax in axes:
        ax.set_ylim(0, ax.get_ylim()[1] * 1.25)
    return fig, axes
