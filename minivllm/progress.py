"""The one progress bar format minivllm shows while it starts (converting the bundled model,
loading weights), so a first start reads as one display.

``progress_bar`` is a tqdm bar on stderr in that format. ``ticking`` keeps a bar's clock
moving while a single long call runs (reading a GGUF file, building a tokenizer), so a start
never sits silent for seconds without showing it is alive.
"""

from __future__ import annotations

import contextlib
import sys
import threading

from tqdm.auto import tqdm

BAR_FORMAT = "{desc}: {percentage:3.0f}%|{bar:24}| {n_fmt}/{total_fmt} {unit} [{elapsed}{postfix}]"


def progress_bar(desc: str, total: int | None = None, unit: str = "tensors",
                 disable: bool = False) -> tqdm:
    return tqdm(total=total, desc=desc, unit=unit, bar_format=BAR_FORMAT, file=sys.stderr,
                disable=disable)


@contextlib.contextmanager
def ticking(bar: tqdm, every: float = 0.5):
    """Redraw ``bar`` every ``every`` seconds until the block ends (its elapsed time moves)."""
    stop = threading.Event()

    def tick() -> None:
        while not stop.wait(every):
            bar.refresh()

    thread = threading.Thread(target=tick, daemon=True)
    thread.start()
    try:
        yield bar
    finally:
        stop.set()
        thread.join()
