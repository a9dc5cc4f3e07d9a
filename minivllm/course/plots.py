"""Plot helpers shared by several chapters (matplotlib only; imported lazily): the KV block map
by request (chapter 03) and by block state (chapter 06)."""

from __future__ import annotations


def draw_block_map(ax, tables: dict[str, list[int]], num_blocks: int, columns: int = 16,
                   title: str | None = None, colors: dict[str, object] | None = None) -> dict:
    """Draw the KV cache as a grid of blocks, each coloured by the request holding it.

    ``tables``: request id -> block ids (as ``views.block_tables`` returns). Free blocks are
    white. Each block shows its index within its request's block table (0, 1, 2, ...), so
    a request's blocks can be followed in order even when scattered. Returns the colours
    used, so a series of maps (one per step) can keep each request's colour.
    """
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
    rows = -(-num_blocks // columns)
    for b in range(num_blocks):
        r, c = divmod(b, columns)
        rid, i = owner.get(b, (None, None))
        ax.add_patch(Rectangle((c, rows - 1 - r), 0.95, 0.95, edgecolor="0.6",
                               facecolor=colors[rid] if rid else "white"))
        if rid is not None:
            ax.text(c + 0.475, rows - 1 - r + 0.475, str(i), ha="center", va="center", fontsize=7)
    ax.set_xlim(0, columns)
    ax.set_ylim(0, rows)
    ax.set_aspect("equal")
    ax.set_xticks([])
    ax.set_yticks([])
    ax.set_xlabel(f"KV blocks 0..{num_blocks - 1}, row by row "
                  "(number: index in the request's block table)")
    if tables:
        ax.legend(handles=[Patch(facecolor=colors[r], label=f"request {r}") for r in tables],
                  loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    if title:
        ax.set_title(title)
    return colors


FREE, CACHED_FREE = "white", "#b8e0b0"


def draw_block_states(ax, states: dict, columns: int = 16, title: str | None = None) -> None:
    """Draw the KV cache as a grid of blocks coloured by state (``views.kv_block_states``).

    Free blocks are white; cached-free blocks (nobody holds them, but they keep their hash, so a
    request with the same prefix can revive them) are green, labelled with their place in the
    free queue (#1 is taken next, its hash evicted); blocks in use are blue, darker the more
    requests share them, labelled with their reference count.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    ref_cnt = states["ref_cnt"]
    cached = [h is not None for h in states["block_hash"]]
    place = {b: i + 1 for i, b in enumerate(states["free_order"])}
    blues = plt.get_cmap("Blues")
    num_blocks = len(ref_cnt)
    rows = -(-num_blocks // columns)
    for b in range(num_blocks):
        r, c = divmod(b, columns)
        x, y = c, rows - 1 - r
        if ref_cnt[b] > 0:
            shade = min(0.35 + 0.15 * ref_cnt[b], 0.95)
            color, label = blues(shade), str(ref_cnt[b])
            text = dict(color="white" if shade > 0.6 else "black", fontsize=8, weight="bold")
        elif cached[b]:
            color, label, text = CACHED_FREE, f"#{place.get(b, '?')}", dict(color="0.25", fontsize=6)
        else:
            color, label, text = FREE, "", {}
        ax.add_patch(Rectangle((x, y), 0.95, 0.95, edgecolor="0.6", facecolor=color))
        if label:
            ax.text(x + 0.475, y + 0.475, label, ha="center", va="center", **text)
    ax.set_xlim(0, columns)
    ax.set_ylim(0, rows)
    ax.set_aspect("equal")
    ax.set_xticks([])
    ax.set_yticks([])
    ax.set_xlabel(f"KV blocks 0..{num_blocks - 1}, row by row")
    used = sum(1 for n in ref_cnt if n > 0)
    num_cached_free = sum(1 for n, h in zip(ref_cnt, cached) if n == 0 and h)
    ax.legend(handles=[
        Patch(facecolor=blues(0.6), edgecolor="0.6", label=f"in use: {used} (number: ref count)"),
        Patch(facecolor=CACHED_FREE, edgecolor="0.6",
              label=f"cached-free: {num_cached_free} (#k: k-th in line to be reused)"),
        Patch(facecolor=FREE, edgecolor="0.6", label=f"free: {num_blocks - used - num_cached_free}"),
    ], loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    if title:
        ax.set_title(title)
