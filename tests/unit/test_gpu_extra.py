"""The `gpu` extra is ONE installable CUDA 13 set for vLLM 0.33, on x86_64 AND aarch64 (GB200).

Why a resolver run and not a look at the pins: the ways this extra breaks are in other
projects' metadata -- a pinned version without an aarch64 wheel, a dependency that needs a
newer glibc, a NIXL or Mooncake build for another CUDA major than the torch vLLM pins. So the
test reads the extra from pyproject.toml (what ships), asks pip to resolve it for each
manylinux architecture with `--dry-run --platform ... --only-binary=:all:` against PyPI, and
checks the resolution: vllm 0.33.0, vLLM's own torch pin, torch's CUDA major 13, and the NIXL
and Mooncake builds for that same major.

Nothing but metadata is fetched: with `--dry-run` pip never downloads a wheel body. Where the
index serves PEP 658 metadata pip reads that; where it does not (the PyPI front these machines
reach does not) `--use-feature=fast-deps` reads each wheel's METADATA with HTTP range
requests. Measured here (pip 26.3, counting CONNECT proxy): 85.6 MB per architecture, almost
all of it index pages (grpcio's alone is 4.9 MB), for a resolution of ~210 wheels whose
bodies total several GB (torch's aarch64 wheel alone is 432 MiB); 28-48 s per architecture,
both run at once.

The resolver is pip 26.3, fetched as a wheel (~1.8 MB) and run from it, not the venv's pip:
pip 23.2 (the venv's) took 94 s (x86_64) and 141 s (aarch64) for the same resolution.

The resolution itself lives in tests/gpu_resolution.py: scripts/test.sh runs it beside setup
(off the suite's critical path) and this file checks its result.
"""

from __future__ import annotations

import json
import os
import re
import ssl
import tomllib
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.tags import Tag, compatible_tags, cpython_tags
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

from tests.gpu_resolution import (
    ARCHES,
    GPU_PYTHON,
    PYPI,
    ROOT,
    _trust_bundle,
    manylinux_platforms,
    read_requirements,
    read_result,
    resolve_all,
)

CUDA_MAJOR = 13

_CUDA_SUFFIX = re.compile(r"-cu(?:da)?(\d+)$")


def requires_python(pyproject: Path = ROOT / "pyproject.toml") -> SpecifierSet:
    return SpecifierSet(tomllib.loads(pyproject.read_text())["project"]["requires-python"])


def cuda_major_of(name: str) -> int | None:
    """The CUDA major a distribution's NAME commits to (nixl-cu13, ...-cuda13), else None."""
    m = _CUDA_SUFFIX.search(canonicalize_name(name))
    return int(m.group(1)) if m else None


def _target_env(arch: str, python: tuple[int, int]) -> dict[str, str]:
    env = default_environment()
    env.update(
        platform_machine=arch,
        platform_system="Linux",
        sys_platform="linux",
        python_version=f"{python[0]}.{python[1]}",
        python_full_version=f"{python[0]}.{python[1]}.0",
        implementation_name="cpython",
        platform_python_implementation="CPython",
    )
    return env


def check_gpu_set(
    requirements: list[str], result: dict[str, Any], arch: str, python: tuple[int, int]
) -> None:
    """Assert that one architecture's resolution is the CUDA 13 set vLLM 0.33 needs."""
    errors = [line for line in result["log"].splitlines() if line.startswith("ERROR")]
    assert result["rc"] == 0 and result["report"] is not None, (
        f"the gpu extra does not resolve for manylinux {arch} cp{python[0]}{python[1]} "
        f"(pip exit {result['rc']}): {errors}\n{result['log'][-3000:]}"
    )
    items = {canonicalize_name(i["metadata"]["name"]): i for i in result["report"]["install"]}
    version = {n: i["metadata"]["version"] for n, i in items.items()}

    def wheel(name: str) -> str:
        return items[name]["download_info"]["url"].rsplit("/", 1)[-1]

    # Every wheel is for this architecture or for any (the --platform really applied).
    for name in items:
        plats = {t.platform for t in parse_wheel_filename(wheel(name))[3]}
        assert plats == {"any"} or all(p.endswith(arch) for p in plats), (name, wheel(name))

    assert version.get("vllm") == "0.33.0", version.get("vllm")
    env = _target_env(arch, python)
    vllm_torch = [
        r
        for r in map(Requirement, items["vllm"]["metadata"]["requires_dist"])
        if canonicalize_name(r.name) == "torch" and (r.marker is None or r.marker.evaluate(env))
    ]
    assert [str(r.specifier) for r in vllm_torch] == ["==2.14.0"]
    assert version["torch"] == "2.14.0"
    assert wheel("torch").endswith(f"_{arch}.whl"), wheel("torch")

    # torch's CUDA major, from what its metadata pins on Linux: cuda-toolkit==13.x and nvidia-*-cu13.
    torch_reqs = [
        r
        for r in map(Requirement, items["torch"]["metadata"]["requires_dist"])
        if r.marker is None or r.marker.evaluate(env)
    ]
    majors = {cuda_major_of(r.name) for r in torch_reqs} - {None}
    majors |= {Version(version["cuda-toolkit"]).major} if "cuda-toolkit" in version else set()
    assert majors == {CUDA_MAJOR}, f"torch {version['torch']} on {arch} pins CUDA majors {majors}"

    # What the extra itself names must be built for that major (nixl-cu12 or a -cuda12 build
    # next to vLLM 0.33's CUDA 13 torch would resolve fine and fail at the first transfer).
    for req in map(Requirement, requirements):
        major = cuda_major_of(req.name)
        assert major in (None, CUDA_MAJOR), (
            f"{req} is a CUDA {major} build; torch is CUDA {CUDA_MAJOR}"
        )

    # NIXL: the `nixl` package vLLM imports loads nixl_cu<torch's major>; it must be there,
    # at nixl's version, as a wheel for this arch.
    assert version.get("nixl") == "1.5.1", version.get("nixl")
    assert version.get(f"nixl-cu{CUDA_MAJOR}") == version["nixl"]
    assert wheel(f"nixl-cu{CUDA_MAJOR}").endswith(f"_{arch}.whl")

    # Mooncake: exactly one build, the CUDA 13 one (the plain wheel is a CUDA 12 build, the
    # non-cuda one cannot register GPU memory).
    mooncake = {n for n in items if n.startswith("mooncake-transfer-engine")}
    assert mooncake == {f"mooncake-transfer-engine-cuda{CUDA_MAJOR}"}, mooncake
    assert version[f"mooncake-transfer-engine-cuda{CUDA_MAJOR}"] == "0.3.14"
    assert wheel(f"mooncake-transfer-engine-cuda{CUDA_MAJOR}").endswith(f"_{arch}.whl")


@pytest.fixture(scope="module")
def gpu_resolution(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """The background run's result where scripts/test.sh started one (HYBRIDKV_GPU_RESOLUTION,
    tests/gpu_resolution.py: same code, same pyproject.toml), else a resolution here."""
    background = os.environ.get("HYBRIDKV_GPU_RESOLUTION")
    done = read_result(Path(background)) if background else None
    if done is not None:
        print(f"gpu extra: the resolution scripts/test.sh ran beside setup ({background})")
        return done
    return resolve_all(read_requirements("gpu"), GPU_PYTHON, tmp_path_factory.mktemp("gpu-extra"))


def test_requires_python_admits_the_gpu_python() -> None:
    assert f"{GPU_PYTHON[0]}.{GPU_PYTHON[1]}" in requires_python()
    assert "3.11" in requires_python()  # the CPU path's Python


@pytest.mark.parametrize("arch", ARCHES)
def test_gpu_extra_resolves_to_one_cuda13_set(
    gpu_resolution: dict[str, dict[str, Any]], arch: str
) -> None:
    check_gpu_set(read_requirements("gpu"), gpu_resolution[arch], arch, GPU_PYTHON)


def _index_files(name: str) -> list[str]:
    req = urllib.request.Request(
        f"{PYPI}/{name}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"}
    )
    ctx = ssl.create_default_context(cafile=_trust_bundle())
    with urllib.request.urlopen(req, context=ctx, timeout=60) as r:
        return [f["filename"] for f in json.load(r)["files"] if not f.get("yanked")]


def test_every_pinned_wheel_exists_for_each_supported_python_and_arch() -> None:
    """The full resolution runs for GPU_PYTHON only (time); the pins themselves are checked for
    every minor in requires-python x both arches, from the index listing (wheel tags)."""
    minors = [(3, m) for m in range(10, 16) if f"3.{m}" in requires_python()]
    assert minors == [(3, 11), (3, 12)]
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extra = [Requirement(r) for r in project["optional-dependencies"]["gpu"]]
    assert all([s.operator for s in r.specifier] == ["=="] for r in extra), extra  # the extra pins
    pinned = [
        r
        for r in map(Requirement, read_requirements("gpu"))
        if [s.operator for s in r.specifier] == ["=="]
    ]  # + the pinned base deps
    missing = []
    for req in pinned:
        (spec,) = req.specifier
        files = [
            f
            for f in _index_files(req.name)
            if f.endswith(".whl") and parse_wheel_filename(f)[1] == Version(spec.version)
        ]
        tags: set[Tag] = {t for f in files for t in parse_wheel_filename(f)[3]}
        for py in minors:
            for arch in ARCHES:
                wanted = set(cpython_tags(py, platforms=manylinux_platforms(arch))) | set(
                    compatible_tags(py, platforms=manylinux_platforms(arch))
                )
                if not tags & wanted:
                    missing.append(f"{req} cp{py[0]}{py[1]} {arch}")
    assert missing == []


def test_a_background_result_is_reused_only_if_it_resolved_from_these_inputs(
    tmp_path: Path,
) -> None:
    """read_result (how the fixture takes scripts/test.sh's background run): a result made from
    other inputs, with an arch that did not resolve, or missing an arch is not reused (the
    test then resolves itself); one that matches is, as written."""
    from tests.gpu_resolution import RESULT_FILE, _inputs

    good = {a: {"rc": 0, "log": "", "report": {"install": []}} for a in ARCHES}

    def written(doc: object) -> dict | None:
        (tmp_path / RESULT_FILE).write_text(json.dumps(doc))
        return read_result(tmp_path)

    assert read_result(tmp_path) is None  # nothing written
    assert written({"inputs": _inputs(), "arches": good}) == good
    stale = {**_inputs(), "requirements": [*read_requirements("gpu"), "extra-package==1"]}
    assert written({"inputs": stale, "arches": good}) is None
    assert written({"inputs": {**_inputs(), "pip": "23.2.1"}, "arches": good}) is None
    assert (
        written({"inputs": _inputs(), "arches": {**good, "aarch64": {**good["aarch64"], "rc": 1}}})
        is None
    )
    assert (
        written(
            {"inputs": _inputs(), "arches": {**good, "x86_64": {**good["x86_64"], "report": None}}}
        )
        is None
    )
    assert written({"inputs": _inputs(), "arches": {"x86_64": good["x86_64"]}}) is None
    assert written(good) is None  # the old format (no inputs)
    assert written(["not", "a", "dict"]) is None
