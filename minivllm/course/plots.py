"""Plot helpers shared by several chapters (matplotlib only; imported lazily)."""

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
