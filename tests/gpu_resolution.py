"""pip's resolution of the `gpu` extra for each manylinux architecture (tests/unit/test_gpu_extra.py
checks what it resolved).

Why a module of its own, runnable by the system's Python (stdlib only): the resolution is two to
three minutes of network round trips (PyPI's index pages and wheel METADATA by range requests) and
~45 CPU-s. ``scripts/test.sh`` starts it in the background beside ``scripts/setup.sh`` (a fresh
clone's install, ~3 min, has no timing-sensitive test beside it) and points the test at its
result with ``HYBRIDKV_GPU_RESOLUTION``; the test itself then checks, not resolves. Run beside the
e2e tests instead it slowed them and once cost a store load its 5 s timeout (README). Without the
variable, or if the background run left no result, the test resolves in its own fixture as before.

Usage: ``python3.11 -m tests.gpu_resolution OUT_DIR`` writes ``OUT_DIR/result.json``.
"""

from __future__ import annotations

import json
import os
import ssl
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PYPI = "https://pypi.org/simple"
PIP_VERSION = "26.3"
ARCHES = ("x86_64", "aarch64")
# The Python the GB200 resolution is checked for (Ubuntu 24.04's; the H200 device's).
GPU_PYTHON = (3, 12)
# Oldest glibc the set is checked against: Ubuntu 22.04's. vLLM 0.33's llguidance has only
# manylinux_2_31 wheels, so 2.28 (vLLM's own floor) would not resolve at all.
GLIBC_MINOR = 35
RESOLVE_TIMEOUT_S = 240


def read_requirements(extra: str, pyproject: Path = ROOT / "pyproject.toml") -> list[str]:
    """The base dependencies plus one extra: what `pip install hybridkv[extra]` asks for."""
    project = tomllib.loads(pyproject.read_text())["project"]
    return list(project["dependencies"]) + list(project["optional-dependencies"][extra])


def manylinux_platforms(arch: str) -> list[str]:
    """Every manylinux tag a host with glibc 2.GLIBC_MINOR accepts.

    pip (23.2 to 26.3) does not expand `--platform manylinux_2_35_x86_64` to the older
    manylinux_2_x tags the way a real host does, so each is passed."""
    tags = [f"manylinux_2_{m}_{arch}" for m in range(GLIBC_MINOR, 16, -1)]
    return tags + [f"manylinux2014_{arch}"]


def _trust_bundle() -> str | None:
    """The CA bundle to verify PyPI with: the machine's, as configured.

    TLS trust is the one piece of the machine's pip setup the test keeps (the PyPI front
    here is signed by a local CA that certifi does not know)."""
    for var in ("PIP_CERT", "SSL_CERT_FILE", "REQUESTS_CA_BUNDLE"):
        if os.environ.get(var) and Path(os.environ[var]).is_file():
            return os.environ[var]
    cafile = ssl.get_default_verify_paths().cafile
    return cafile if cafile and Path(cafile).is_file() else None


def clean_pip_env() -> dict[str, str]:
    """The environment for pip with every package SOURCE of this machine removed.

    These machines configure pip with find-links /opt/wheels, local file:// indexes and a
    constraints file (PIP_* variables, ~/.config/pip/pip.conf, /etc/xdg/pip/pip.conf). A
    resolution through them could succeed on a wheel that exists only on this disk, or be
    capped by a local constraint, and then fail for a user. `--isolated` drops the PIP_*
    variables and the user config but NOT the global /etc/xdg/pip config (pip 23-26 still
    load it); PIP_CONFIG_FILE=os.devnull makes pip skip every config file. What remains is
    PyPI, named explicitly with --index-url."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull
    return env


def _pip_common() -> list[str]:
    cert = _trust_bundle()
    return ["--isolated", "--disable-pip-version-check", "--index-url", PYPI, "--timeout", "60"] + (
        ["--cert", cert] if cert else []
    )


def fetch_pip(dest: Path) -> Path:
    """pip PIP_VERSION's wheel, to run pip from (python pip.whl/pip): the resolver is pinned."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            *_pip_common(),
            "--no-deps",
            "--only-binary=:all:",
            "-d",
            str(dest),
            f"pip=={PIP_VERSION}",
        ],
        env=clean_pip_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, f"could not fetch pip {PIP_VERSION}:\n{done.stdout}{done.stderr}"
    (wheel,) = dest.glob(f"pip-{PIP_VERSION}-*.whl")
    return wheel


def start_resolution(
    pip_wheel: Path, requirements: list[str], arch: str, python: tuple[int, int], work: Path
) -> subprocess.Popen[str]:
    """pip's dry-run resolution of `requirements` for manylinux `arch`; writes work/report.json."""
    work.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        str(pip_wheel / "pip"),
        "install",
        *_pip_common(),
        "--dry-run",
        "--ignore-installed",
        "--only-binary=:all:",
        "--no-cache-dir",
        "--use-feature=fast-deps",
        "--implementation",
        "cp",
        "--python-version",
        f"{python[0]}.{python[1]}",
        *[a for p in manylinux_platforms(arch) for a in ("--platform", p)],
        # --target: with --platform pip refuses to install into this venv; --dry-run
        # installs nothing anyway.
        "--target",
        str(work / "target"),
        "--report",
        str(work / "report.json"),
        *requirements,
    ]
    return subprocess.Popen(
        cmd, env=clean_pip_env(), text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )


def resolve_all(
    requirements: list[str], python: tuple[int, int], work: Path
) -> dict[str, dict[str, Any]]:
    """Resolve for every arch at once (the time is network round trips, not CPU)."""
    pip_wheel = fetch_pip(work / "pip")
    procs = {a: start_resolution(pip_wheel, requirements, a, python, work / a) for a in ARCHES}
    out: dict[str, dict[str, Any]] = {}
    for arch, proc in procs.items():
        try:
            log, _ = proc.communicate(timeout=RESOLVE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            log, _ = proc.communicate()
        report = work / arch / "report.json"
        out[arch] = {
            "rc": proc.returncode,
            "log": log,
            "report": json.loads(report.read_text()) if report.exists() else None,
        }
    return out


RESULT_FILE = "result.json"


def _inputs() -> dict[str, Any]:
    """What a resolution depends on here: a result made from other inputs is not reused."""
    return {
        "requirements": read_requirements("gpu"),
        "pip": PIP_VERSION,
        "python": list(GPU_PYTHON),
        "arches": list(ARCHES),
        "glibc_minor": GLIBC_MINOR,
    }


def write_result(work: Path) -> Path:
    """Resolve the gpu extra for GPU_PYTHON into ``work`` and write what resolve_all returned,
    with the inputs it was made from, to ``work/result.json``, atomically (a reader never sees
    half a file)."""
    inputs = _inputs()
    out = resolve_all(inputs["requirements"], GPU_PYTHON, work)
    tmp = work / (RESULT_FILE + ".tmp")
    tmp.write_text(json.dumps({"inputs": inputs, "arches": out}))
    tmp.replace(work / RESULT_FILE)
    return work / RESULT_FILE


def read_result(work: Path) -> dict[str, dict[str, Any]] | None:
    """A background run's resolution per arch, or None (then the test resolves itself): where it
    wrote nothing, was made from other inputs (another pyproject.toml, pip, Python), or any
    arch did not resolve (a timeout or a network error beside setup's own downloads gets a
    second chance; a real failure then fails the test's own resolution)."""
    try:
        doc = json.loads((work / RESULT_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("inputs") != _inputs():
        return None
    arches = doc.get("arches")
    if not isinstance(arches, dict) or set(arches) != set(ARCHES):
        return None
    if any(
        not isinstance(r, dict) or r.get("rc") != 0 or r.get("report") is None
        for r in arches.values()
    ):
        return None
    return arches


if __name__ == "__main__":
    target = Path(sys.argv[1])
    target.mkdir(parents=True, exist_ok=True)
    print(write_result(target))
