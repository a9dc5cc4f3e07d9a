"""The package installs everywhere it should, with every subpackage and no stray floors."""

import os
import re
try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _pyproject():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def _packages_on_disk() -> set[str]:
    """Every folder under minivllm/ with an __init__.py (through the kernels link), as a
    package name."""
    found = set()
    for dirpath, _, files in os.walk(os.path.join(ROOT, "minivllm"), followlinks=True):
        if "__init__.py" in files and "__pycache__" not in dirpath:
            found.add(os.path.relpath(dirpath, ROOT).replace(os.sep, "."))
    return found


def test_triton_has_a_linux_marker_and_no_floor_above_the_gpu_machine():
    deps = _pyproject()["project"]["dependencies"]
    triton = [d for d in deps if d.startswith("triton")]
    assert triton and "sys_platform == 'linux'" in triton[0]
    limits = {"torch": (2, 11), "triton": (3, 6), "transformers": (5, 17)}
    for dep in deps:
        m = re.match(r"(torch|triton|transformers)>=(\d+)\.(\d+)", dep)
        if m:
            assert (int(m[2]), int(m[3])) <= limits[m[1]], dep


def test_readme_test_command_is_what_ci_runs():
    readme = open(os.path.join(ROOT, "README.md")).read()
    ci = open(os.path.join(ROOT, ".ci", "run")).read()
    m = re.search(r"<!-- test-command -->\s*```bash\n(.+?)\n```", readme, re.S)
    assert m, "README must mark its test command with <!-- test-command -->"
    assert m[1].strip() in ci


def test_kernels_import_from_a_checkout_without_installing():
    """The top-level kernels/ folder (the course's layout) is minivllm.kernels in a checkout too
    (minivllm/kernels links to it), so scripts run from a clone need no install step."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f).lower()]\n"
        f"sys.path.insert(0, {ROOT!r})\n"
        "import minivllm.kernels.decode_attention as m\n"
        "print(m.__file__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert os.path.realpath(out.stdout.strip()) == os.path.join(
        os.path.realpath(ROOT), "kernels", "decode_attention.py")


def test_a_built_wheel_carries_every_package_and_the_kernel_source(tmp_path):
    """minivllm/cpu_kernels.cpp is compiled where minivllm runs, so a wheel must ship it; and
    every package (found by setuptools, not listed) with its modules. Built from a copy of
    the sources, so that no build/ folder lands in the checkout."""
    import shutil
    import subprocess
    import sys
    import zipfile

    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(os.path.join(ROOT, name), src / name)
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(os.path.join(ROOT, "minivllm"), src / "minivllm", symlinks=True, ignore=skip)
    shutil.copytree(os.path.join(ROOT, "kernels"), src / "kernels", ignore=skip)
    try:  # build with this environment's setuptools when it has one (fast, offline)
        import setuptools  # noqa: F401

        isolation = ["--no-build-isolation"]
    except ImportError:
        isolation = []
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation,
                          "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    wheel, = (tmp_path / "dist").glob("minivllm-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "minivllm/cpu_kernels.cpp" in names and "minivllm/kernels/rms_norm.py" in names
    # the packages are found, not listed: every one on disk is in the wheel, with its modules
    packages = _packages_on_disk()
    assert {"minivllm.kernels", "minivllm.entrypoints.openai", "minivllm.course.checks"} <= packages
    for package in packages:
        folder = package.replace(".", "/")
        assert f"{folder}/__init__.py" in names, package
        source = os.path.join(ROOT, "kernels" if package == "minivllm.kernels" else folder)
        modules = {f for f in os.listdir(source) if f.endswith(".py")}
        assert {f"{folder}/{m}" for m in modules} <= set(names), package


def test_the_repository_root_does_not_hide_the_pypi_package_kernels():
    """Python started in the repository root has kernels/ (minivllm.kernels) on its path; there,
    `import kernels` must still reach the installed PyPI package (transformers imports it), or
    fail as a missing module where that package is not installed."""
    import subprocess
    import sys

    probe = ("import importlib.metadata as m, os, sys\n"
             "try:\n    m.version('kernels')\nexcept m.PackageNotFoundError:\n"
             "    installed = False\nelse:\n    installed = True\n"
             "try:\n    import kernels\nexcept ModuleNotFoundError:\n"
             "    print('absent', installed)\nelse:\n"
             "    print('ours' if os.path.dirname(os.path.dirname(kernels.__file__)) == os.getcwd()"
             " else 'installed', installed)\n"
             "import minivllm.kernels as k\nprint(callable(k.triton_unavailable_reason))\n")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    found, installed, ours_works = out.stdout.split()
    assert found == ("installed" if installed == "True" else "absent")
    assert ours_works == "True"
