"""The wheel is complete: every module of ``asyncrl``, ``datapipes`` and ``workers`` is in it, and ``asyncrl check``
runs from an install of it.

The wheel is built offline from a copy of the sources (``pip wheel --no-deps --no-build-isolation``: no network, the
source tree stays clean) and installed with ``--no-deps`` into a fresh venv; that venv sees this interpreter's
site-packages through a ``.pth`` line (torch, transformers, ... are not reinstalled, and pip never resolves a torch),
but not its editable install of asyncrl, whose finder only a site directory's own ``.pth`` files would register.
"""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("asyncrl", "datapipes", "workers")


def _sources() -> set[str]:
    return {p.relative_to(ROOT).as_posix() for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")
            if "__pycache__" not in p.parts}


def _build_wheel(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                    "--disable-pip-version-check", "-q", "-w", str(out), str(src)], check=True, timeout=300)
    (wheel,) = out.glob("asyncrl-*.whl")
    return wheel


def test_wheel_has_every_module_and_a_working_check(tmp_path):
    wheel = _build_wheel(tmp_path)
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = sorted(_sources() - names)
    assert not missing, f"modules missing from the wheel: {missing}"
    assert not [n for n in names if n.split("/")[0] in ("tests", "recipes", "benchmarks")], "only the three packages"

    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    # this interpreter's dependencies, after the venv's own site-packages (where the wheel goes)
    Path(purelib, "deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index",
                    "--disable-pip-version-check", "-q", str(wheel)], check=True, timeout=300)

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    where = subprocess.run([python, "-c", "import asyncrl, datapipes, workers; "
                            "print(asyncrl.__file__, datapipes.__file__, workers.__file__)"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, check=True, timeout=120).stdout
    assert all(f.startswith(purelib) for f in where.split()), f"imported from outside the install: {where}"
    check = subprocess.run([env_dir / "bin" / "asyncrl", "check", "--help"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=300)
    assert check.returncode == 0, check.stderr[-3000:]
    assert "--model" in check.stdout, check.stdout
