"""The backend's ways in: the entry point and backend="fluxcompile", enable()/disable() with a user's own
pre-pass, explain(), mode/options, the pass's uuid, and the config with its environment overrides."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from helpers import fresh_compiles

import fluxcompile
from fluxcompile.backend import disable, enable
from fluxcompile.config import Config
from fluxcompile.fx_passes import FluxcompilePass
from fluxcompile.testing.numerics import assert_close


def test_entry_point_is_registered():
    eps = importlib.metadata.entry_points(group="torch_dynamo_backends")
    assert any(ep.name == "fluxcompile" and ep.value == "fluxcompile.backend:fluxcompile_backend" for ep in eps)


def test_backend_name_resolves_in_a_fresh_process():
    # As a user would: no import of fluxcompile, just the string.
    code = "import torch._dynamo as d; print(d.lookup_backend('fluxcompile').__module__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "fluxcompile.backend"


def _tp_mlp(x, w1, w2, group):
    h = funcol.all_gather_tensor(x, 0, group)
    y = torch.relu(h @ w1) @ w2
    return funcol.reduce_scatter_tensor(y, "sum", 0, group)


def compile_ways() -> dict[str, object]:
    """The same function through backend="fluxcompile" (with mode/options) and through enable()."""
    group = dist.group.WORLD
    torch.manual_seed(dist.get_rank())
    x, w1, w2 = torch.randn(6, 16), torch.randn(16, 32), torch.randn(32, 16)
    ref = _tp_mlp(x, w1, w2, group)
    seen = []
    result = {}
    with fresh_compiles():
        with fluxcompile.collect_reports() as rep:
            out = torch.compile(_tp_mlp, backend="fluxcompile", options={"max_autotune": False})(x, w1, w2, group)
        assert_close(out, ref, 1e-5, "backend='fluxcompile'")
        result["backend"] = [e.fused_op for e in rep.entries()]

        torch._dynamo.reset()
        with torch._inductor.config.patch(post_grad_custom_pre_pass=lambda g: seen.append(len(g.nodes))):
            enable()
            enable()  # idempotent
            try:
                current = torch._inductor.config.post_grad_custom_pre_pass
                assert isinstance(current, FluxcompilePass) and len(current.previous) == 1
                assert current.uuid() is None, "a user pass without uuid must turn the graph cache off"
                with fluxcompile.collect_reports() as rep:
                    out = torch.compile(_tp_mlp)(x, w1, w2, group)  # plain inductor
            finally:
                disable()
            assert not isinstance(torch._inductor.config.post_grad_custom_pre_pass, FluxcompilePass)
        assert_close(out, ref, 1e-5, "enable()")
        result["enable"] = [e.fused_op for e in rep.entries()]
        result["user_pass_ran"] = bool(seen)

        torch._dynamo.reset()
        result["explain"] = str(fluxcompile.explain(_tp_mlp, x, w1, w2, group))
    return result


def test_compile_ways(ranks):
    r = ranks(2).run(compile_ways)[0]
    assert r["backend"] == ["all_gather_matmul", "matmul_reduce_scatter"]
    assert r["enable"] == ["all_gather_matmul", "matmul_reduce_scatter"]
    assert r["user_pass_ran"]
    assert "fluxcompile.all_gather_matmul" in r["explain"] and "fluxcompile.matmul_reduce_scatter" in r["explain"]


def _gather_flags(graph: torch.fx.Graph) -> list[tuple[bool, bool]]:
    """(return_A, whether anything reads result 0) of each fluxcompile.all_gather_matmul of a post-grad graph."""
    op = torch.ops.fluxcompile.all_gather_matmul.default
    return [
        (n.kwargs.get("return_A", True), any(u.args[1] == 0 for u in n.users))
        for n in graph.nodes
        if n.op == "call_function" and n.target is op
    ]


def return_A_from_users() -> dict[str, object]:
    """The rewrite sets all_gather_matmul's return_A from the gathered tensor's users: an inference graph reads
    only the products; a training forward also saves the gathered tensor for the backward (w1's gradient), and
    the backward's gathered output gradient also feeds w2's gradient. Results and gradients match eager."""
    group = dist.group.WORLD
    torch.manual_seed(dist.get_rank())
    x, w1, w2 = torch.randn(6, 16), torch.randn(16, 32), torch.randn(32, 16)
    graphs: list[list[tuple[bool, bool]]] = []
    options = {"post_grad_custom_post_pass": lambda g: graphs.append(_gather_flags(g))}
    result = {}
    with fresh_compiles():
        torch._dynamo.reset()
        with torch.no_grad():
            out = torch.compile(_tp_mlp, backend="fluxcompile", options=options)(x, w1, w2, group)
        assert_close(out, _tp_mlp(x, w1, w2, group), 1e-5, "inference")
        result["inference"] = list(graphs)

        graphs.clear()
        torch._dynamo.reset()
        params = [t.clone().requires_grad_() for t in (x, w1, w2)]
        eager = [t.clone().requires_grad_() for t in (x, w1, w2)]
        out = torch.compile(_tp_mlp, backend="fluxcompile", options=options)(*params, group)
        ref = _tp_mlp(*eager, group)
        assert_close(out, ref, 1e-5, "training forward")
        grad = torch.randn_like(ref)
        out.backward(grad)
        ref.backward(grad)
        for name, a, b in zip(("x", "w1", "w2"), params, eager):
            assert_close(a.grad, b.grad, 1e-5, f"gradient of {name}")
        result["training"] = list(graphs)
    return result


def test_return_A_from_users(ranks):
    for r in ranks(2).run(return_A_from_users):
        # One graph without grad: only the mm reads the gathered tensor, so it is not returned (nothing reads it).
        assert r["inference"] == [[(False, False)]], r
        # The forward saves the gathered x for w1's gradient; the backward's gathered output gradient feeds the
        # input-gradient mm and, as the right operand, w2's gradient: both return it and read it.
        assert r["training"] == [[(True, True)], [(True, True)]], r


def test_uuid_follows_config():
    p = FluxcompilePass()
    before = p.uuid()
    assert before is not None and p.uuid() == before
    with fluxcompile.config.patch(min_k=4096):
        assert p.uuid() != before
    assert p.uuid() == before


def test_config_env_overrides():
    cfg = Config()
    cfg.load_env(
        {
            "FLUXCOMPILE_MATMUL_ALL_REDUCE": "0",
            "FLUXCOMPILE_MIN_K": "1024",
            "FLUXCOMPILE_IMPLEMENTATIONS": "reference, cutlass",
            "FLUXCOMPILE_AUTOTUNE": "off",
        }
    )
    assert cfg.matmul_all_reduce is False and cfg.min_k == 1024 and cfg.autotune is False
    assert cfg.implementations == ("reference", "cutlass")
    with pytest.raises(ValueError, match="FLUXCOMPILE_MIN_K"):
        Config().load_env({"FLUXCOMPILE_MIN_K": "big"})
    with pytest.raises(ValueError, match="FLUXCOMPILE_ALL_GATHER_MATMUL"):
        Config().load_env({"FLUXCOMPILE_ALL_GATHER_MATMUL": "maybe"})
    with pytest.raises(AttributeError, match="no option"):
        cfg.min_kk = 3


def test_config_env_read_at_import():
    env = {**os.environ, "FLUXCOMPILE_MIN_N": "77"}
    code = "import fluxcompile; print(fluxcompile.config.min_n)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.strip() == "77"


def test_uuid_covers_the_registered_cuda_implementations(monkeypatch):
    """Generated code calls the fused ops' CUDA implementations directly: a graph compiled where they were
    registered must not be replayed from the cache where the lowerings failed to load."""
    from fluxcompile.fx_passes import graph_pass

    p = FluxcompilePass()
    before = p.uuid()
    assert "all_gather_matmul" in graph_pass.cuda_implementations()
    monkeypatch.setattr(graph_pass, "cuda_implementations", lambda: "")
    assert p.uuid() != before


def test_uuid_covers_the_registered_choices(monkeypatch):
    """A graph compiled against a choice that is gone (retired, renamed) is never replayed from Inductor's cache:
    the compiled site would name a choice no longer offered."""
    from fluxcompile.lowerings import choices

    p = FluxcompilePass()
    before = p.uuid()
    assert "all_gather_matmul:" in choices.registered_names() and "reference" in choices.registered_names()
    ops = dict(choices._REGISTRY)
    monkeypatch.setitem(choices._REGISTRY, "all_gather_matmul", {"reference": ops["all_gather_matmul"]["reference"]})
    assert p.uuid() != before


@pytest.mark.parametrize(
    ("var", "value", "accepted"),
    [
        ("FLUXCOMPILE_MIN_M", "abc", "expected an integer"),
        ("FLUXCOMPILE_IMPLEMENTATIONS", "cublas-pipelined", "valid: triton_ag, triton_rs, decode, gemv_peers"),
        ("FLUXCOMPILE_IMPLEMENTATIONS", "+moe,cutlass", "not both"),
        ("FLUXCOMPILE_WAIT_TIMEOUT_S", "soon", "expected a number"),
        ("FLUXCOMPILE_WATCHDOG_TIMEOUT_S", "-1", "expected a value >= 0"),
        ("FLUXCOMPILE_LOG", "loud", "expected one of"),
    ],
)
def test_bad_environment_is_one_line_naming_the_variable(var, value, accepted):
    env = {**os.environ, var: value}
    out = subprocess.run([sys.executable, "-c", "import fluxcompile"], capture_output=True, text=True, env=env)
    assert out.returncode != 0
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr  # no import traceback
    assert lines[0].startswith(f"fluxcompile: {var}={value!r}") and accepted in lines[0], lines[0]


def test_config_checks_values_set_in_code():
    cfg = fluxcompile.config
    with pytest.raises(ValueError, match=r"unknown 'nonsense'; valid: .*cublas_pipelined.*reference"):
        cfg.implementations = ("nonsense",)
    with pytest.raises(ValueError, match="min_k='x': expected an integer"):
        cfg.min_k = "x"
    with pytest.raises(ValueError, match="expected True or False"):
        cfg.autotune = "yes"
    with pytest.raises(ValueError, match=">= 0"):
        cfg.wait_timeout_s = -1.0
    assert cfg.implementations == Config().implementations and cfg.min_k == 1  # failed sets change nothing
    with cfg.patch(wait_timeout_s=5):
        assert cfg.wait_timeout_s == 5.0 and isinstance(cfg.wait_timeout_s, float)


def test_unknown_variable_is_reported(caplog):
    with caplog.at_level("WARNING", logger="fluxcompile.config"):
        Config().load_env({"FLUXCOMPILE_MIN_KK": "3", "FLUXCOMPILE_TEST_SEED": "1"})
    assert "FLUXCOMPILE_MIN_KK: no such option" in caplog.text and "TEST_SEED" not in caplog.text


def test_settings_that_change_choices_are_in_the_autotune_key():
    """A winner tuned with a family off must not be reused with it on (and so on for every field marked tuning)."""
    from fluxcompile.config import _TUNING

    names = {f.name for f in _TUNING}
    assert {"implementations", "autotune", "symm_mem_backend"} <= names
    before = fluxcompile.config.tuning_fingerprint()
    with fluxcompile.config.patch(implementations=("+triton_ag",)):
        assert fluxcompile.config.tuning_fingerprint() != before
    with fluxcompile.config.patch(wait_timeout_s=1.0, watchdog_timeout_s=1.0):  # bounds, not choices
        assert fluxcompile.config.tuning_fingerprint() == before



def test_only_config_reads_the_environment():
    """Every setting is a Config field: no other module of the package reads the environment."""
    import pathlib
    import re

    root = pathlib.Path(fluxcompile.__file__).parent
    readers = [
        f"{path.relative_to(root)}:{n}"
        for path in root.rglob("*.py")
        if path.name != "config.py"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"os\.environ|os\.getenv|getenv\(", line)
    ]
    assert readers == []
