"""New nodes of the rewrites name the FX nodes behind their symbolic sizes: no raw SymInt reaches
``Graph.create_node`` (torch warns about those), and the sizes they compute equal the ones they replace."""

from __future__ import annotations

import warnings

import pytest
import torch
from test_moe_patterns import A2AMM, MMA2A, moe_case
from torch.fx import Node
from torch.fx.experimental.proxy_tensor import make_fx

from fluxcompile.fx_passes.graph_utils import call, val

aten = torch.ops.aten


def _rows_from_splits(splits: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    a, b = splits.tolist()  # unbacked sizes, as the split sizes of a dropless MoE exchange
    torch._check(a >= 0)
    torch._check(b >= 0)
    return x.new_zeros(a + b, 4)


def _raw_symint_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if "SymInt" in str(w.message)]


@pytest.mark.parametrize("route", ["materialize_symints", "defining nodes"])
def test_call_names_the_nodes_behind_symbolic_sizes(monkeypatch, route):
    gm = make_fx(_rows_from_splits, tracing_mode="symbolic")(torch.tensor([2, 3]), torch.zeros(1))
    graph = gm.graph
    if route == "defining nodes":  # a torch without materialize_symints, or bindings naming renamed symbols
        monkeypatch.delattr(torch.fx.Graph, "materialize_symints", raising=False)
        for node in graph.nodes:
            node.meta.pop("unbacked_bindings", None)
    out = graph.output_node()
    x = next(n for n in graph.nodes if n.op == "placeholder" and n.name.startswith("x"))
    rows = val(out.args[0]).shape[0]
    assert isinstance(rows, torch.SymInt) and len(rows.node.expr.free_symbols) == 2
    with warnings.catch_warnings(record=True) as caught, graph.inserting_before(out):
        warnings.simplefilter("always")
        made = call(graph, aten.new_zeros.default, (x, [rows, 2]))
    assert not _raw_symint_warnings(caught)
    size = made.args[1][0]
    assert isinstance(size, Node) and val(size).node.expr == rows.node.expr
    out.args = (made,)
    gm.recompile()
    splits = torch.randint(0, 9, (2,))
    assert gm(splits, torch.zeros(1)).shape == (int(splits.sum()), 2)


def moe_case_warnings(form: str) -> tuple[dict, float, str, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        counts, err, report = moe_case(form)
    return counts, err, report, _raw_symint_warnings(caught)


def test_dropless_moe_rewrite_passes_no_raw_symint(ranks):
    # The combine's output rows are a sum of unbacked split sizes: its fused op names the nodes computing them.
    for counts, err, report, raw in ranks(2).run(moe_case_warnings, "dropless"):
        assert counts == {"forward": {A2AMM: 1, MMA2A: 1}, "backward": {A2AMM: 1, MMA2A: 1}}, report
        assert err <= 1e-2, report
        assert raw == [], raw
