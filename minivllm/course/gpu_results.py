"""GPU measurements a chapter stores, so a learner without a GPU still sees one: on a GPU
``save("02", "decode_speed", data, fig=fig)`` writes ``chapters/gpu_results/02_decode_speed.json``
(and a ``.png``), elsewhere ``show("02", "decode_speed", what)`` prints it and never raises.
``MINIVLLM_GPU_RESULTS`` names another folder than chapters/gpu_results/.
"""

from __future__ import annotations

import datetime
import json
import os
import re

ENV_DIR = "MINIVLLM_GPU_RESULTS"
SUBDIR = "gpu_results"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


def has_cuda() -> bool:
    """Whether torch sees a CUDA device (False when torch is missing or was built without CUDA)."""
    try:
        import torch
        return bool(torch.cuda.is_available())
    except Exception:
        return False


def _is_chapters_dir(path: str) -> bool:
    return (os.path.basename(os.path.normpath(path)) == "chapters" and os.path.isdir(path)
            and any(re.match(r"^\d\d_.*\.ipynb$", f) for f in os.listdir(path)))


def chapters_dir(start: str | None = None) -> str | None:
    """The chapters/ folder from ``start`` (default: the working directory) up, else beside
    this package, else None."""
    here = os.path.abspath(start or os.getcwd())
    while True:
        for candidate in (here, os.path.join(here, "chapters")):
            if _is_chapters_dir(candidate):
                return candidate
        if os.path.dirname(here) == here:
            break
        here = os.path.dirname(here)
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    candidate = os.path.join(package_root, "chapters")
    return candidate if _is_chapters_dir(candidate) else None


def results_dir(start: str | None = None) -> str | None:
    """Where results are stored: ``$MINIVLLM_GPU_RESULTS``, else ``chapters/gpu_results/``."""
    if os.environ.get(ENV_DIR):
        return os.path.abspath(os.environ[ENV_DIR])
    chapters = chapters_dir(start)
    return os.path.join(chapters, SUBDIR) if chapters else None


def paths(chapter: str, name: str, start: str | None = None) -> tuple[str, str] | None:
    """(json path, png path) of one result, or None when no chapters/ folder is found."""
    for label, value in (("chapter", chapter), ("name", name)):
        if not isinstance(value, str) or not _NAME.match(value):
            raise ValueError(f"{label} {value!r}: letters, digits, '_', '-' and '.' only")
    folder = results_dir(start)
    stem = folder and os.path.join(folder, f"{chapter}_{name}")
    return (stem + ".json", stem + ".png") if stem else None


def _jsonable(value):
    """Plain JSON values from what a measurement returns (numpy/torch scalars and arrays...)."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else str(value)
    if hasattr(value, "tolist"):  # numpy arrays and scalars, torch tensors
        return _jsonable(value.tolist())
    if hasattr(value, "item"):
        return _jsonable(value.item())
    return str(value)


def save(chapter: str, name: str, data: dict, fig=None) -> None:
    """On a GPU: store ``data`` (plus date, device, torch version) and ``fig`` as a PNG; without
    one, store nothing (a CPU must never overwrite a GPU's result) and say so."""
    if not has_cuda():
        print(f"No GPU here: {chapter}_{name} not stored.")
        return
    import torch

    where = paths(chapter, name)
    if where is None:
        print(f"No chapters/ folder found from {os.getcwd()}: {chapter}_{name} not stored.")
        return
    json_path, png_path = where
    os.makedirs(os.path.dirname(json_path), exist_ok=True)
    record = {"chapter": chapter, "name": name,
              "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "cuda": torch.version.cuda, "data": _jsonable(data)}
    with open(json_path, "w", encoding="utf-8") as f:
        json.dump(record, f, indent=1)
        f.write("\n")
    if fig is not None:
        fig.savefig(png_path, dpi=100, bbox_inches="tight")
    elif os.path.exists(png_path):
        os.remove(png_path)  # a figure from an earlier run would no longer match the data
    print(f"stored {os.path.relpath(json_path)}" + (" and its figure" if fig is not None else ""))


def load(chapter: str, name: str) -> dict | None:
    """The stored record ({"date", "device", "torch", "data", ...}), or None if there is none."""
    try:
        with open(paths(chapter, name)[0], encoding="utf-8") as f:
            return json.load(f)
    except Exception:  # no chapters/ folder (paths is None), no file, or a broken one
        return None


def _compact(value, width: int = 100) -> str:
    text = json.dumps(value, separators=(", ", ": "), ensure_ascii=False)
    return text if len(text) <= width else text[: width - 1] + "…"


def format_record(record: dict) -> str:
    """A few lines: where and when it was measured, then one line per data key."""
    head = (f"Stored GPU result ({record.get('date', '?')}, {record.get('device', '?')}, "
            f"torch {record.get('torch', '?')}):")
    data = record.get("data", {})
    if not isinstance(data, dict):
        return head + "\n  " + _compact(data)
    return "\n".join([head] + [f"  {key}: {_compact(value)}" for key, value in data.items()])


def show(chapter: str, name: str, what: str) -> None:
    """Without a GPU: say what the cell would measure, then the stored result if any; never
    raises (a broken or missing file is reported as a line of text)."""
    try:
        print(f"No GPU here: this cell would measure {what}.")
        where = paths(chapter, name)
        record = load(chapter, name)
        if record is None:
            print("No GPU result stored yet.")
            return
        print(format_record(record))
        png = where[1] if where else None
        if png and os.path.exists(png):
            try:
                from IPython import get_ipython
                from IPython.display import Image, display
                if get_ipython() is None:
                    raise RuntimeError("not in IPython")
                display(Image(filename=png))
            except Exception:
                print(f"figure: {png}")
    except Exception as e:  # noqa: BLE001 - Run All must get through
        print(f"No GPU result shown ({type(e).__name__}: {e}).")
