"""``config.implementations`` by family: every registered choice has one family, each switch of the previous release
is one family, a family the config does not enable declines with what enables it; the one in-kernel wait bound
``wait_timeout_s`` and the watchdog's ``watchdog_timeout_s``; the old names, still accepted with one warning."""

from __future__ import annotations

import sys

import pytest

import fluxcompile  # registers the choices
from fluxcompile.config import EXPERIMENTAL, IMPLEMENTATIONS, OLD_BOUNDS, OLD_FAMILIES, OLD_SWITCHES, Config, config
from fluxcompile.lowerings import choices_for
from fluxcompile.lowerings.choices import _REGISTRY, Choice

assert fluxcompile
config_module = sys.modules["fluxcompile.config"]  # the attribute fluxcompile.config is the Config instance

# The family of every registered choice (names unchanged: caches, reports and compiled choices use them).
FAMILY_OF = {
    ("all_gather_matmul", "triton:"): "triton_ag",
    ("all_gather_matmul", "cublas_pipelined:stages"): "ag_stages",
    ("matmul_reduce_scatter", "triton:"): "triton_rs",
    ("matmul_reduce_scatter", "cublas_pipelined:stages"): "rs_stages",
    ("matmul_all_reduce", "triton:"): "decode",
    ("matmul_all_reduce", "cuda:"): "decode",
    ("all_reduce_rmsnorm", "triton:"): "decode",
    ("all_reduce_rmsnorm", "cuda:"): "decode",
    ("all_to_all_matmul", "triton:"): "moe",
    ("all_to_all_matmul", "cutlass:"): "moe",
    ("matmul_all_to_all", "triton:"): "moe",
    ("all_to_all_matmul", "vdev"): "moe",
    ("matmul_all_to_all", "vdev"): "moe",
    ("embedding_bag_all_to_all", "triton:"): "dlrm",
    ("embedding_bag_all_to_all", "put:"): "dlrm",
    ("all_to_all_embedding_bag_backward", "triton"): "dlrm",
    ("all_to_all_embedding_bag_backward", "put"): "dlrm",
    ("matmul_reduce_scatter", "cutlass:"): "rs_ring",
}


@pytest.fixture
def warned(monkeypatch):
    """A fresh record of the deprecation lines (each is logged once per process)."""
    monkeypatch.setattr(config_module, "_warned", set())


def _expected_family(op: str, name: str) -> str:
    for (o, prefix), family in FAMILY_OF.items():
        if o == op and name.startswith(prefix):
            return family
    return name.partition(":")[0]


def test_every_registered_choice_has_one_listed_family():
    seen = set()
    for op, choices in _REGISTRY.items():
        if op.startswith("test_"):
            continue
        for name, choice in choices.items():
            assert choice.family == _expected_family(op, name), (op, name, choice.family)
            assert choice.family in IMPLEMENTATIONS, (op, name)
            seen.add(choice.family)
    # Every family but the condition "gemv_peers" has choices (cutlass/triton ones only where their modules load).
    assert {"decode", "cublas_pipelined", "ag_stages", "rs_stages", "torch_symm_mem", "reference"} <= seen
    assert set(EXPERIMENTAL) < set(IMPLEMENTATIONS) and not set(OLD_FAMILIES) & set(IMPLEMENTATIONS)


def test_each_old_switch_is_one_family():
    assert set(OLD_SWITCHES.values()) | set(EXPERIMENTAL) == {
        "decode", "gemv_peers", "schedules", "cutlass", "dlrm", "triton_ag", "triton_rs", "ag_stages", "rs_stages",
        "moe", "rs_ring",
    }  # fmt: skip
    fields = {f for f in Config.__dataclass_fields__ if f.startswith("experimental_")}
    assert fields == {f"experimental_{family}" for family in EXPERIMENTAL}  # only the families off by default


def test_default_order_is_the_order_of_the_previous_release():
    """Within an op the candidates keep their order (the autotuner's tie-break, the pick with autotuning off)."""
    names = [c.name for c in choices_for("matmul_all_reduce")]
    kinds = [n.partition(":")[0] for n in names]
    assert kinds == sorted(kinds, key=["triton", "cuda", "torch_symm_mem", "schedules", "reference"].index)
    assert names.index("torch_symm_mem:one_shot") < names.index("torch_symm_mem:two_shot")
    for op in ("all_gather_matmul", "matmul_reduce_scatter"):
        names = [c.name for c in choices_for(op)]
        stages = [i for i, n in enumerate(names) if ":stages" in n]
        pipelined = [i for i, n in enumerate(names) if n.startswith("cublas_pipelined")]
        assert stages == pipelined[-len(stages) :], names  # the stages right after the other pipelined choices


def test_a_family_not_enabled_declines_with_what_enables_it():
    assert config.family_declines("cutlass") is None and config.family_declines("reference") is None
    assert config.family_declines("triton_ag") == "experimental: FLUXCOMPILE_EXPERIMENTAL_TRITON_AG=1 enables it"
    with config.patch(experimental_triton_ag=True):
        assert config.family_declines("triton_ag") is None
    left_out = tuple(f for f in IMPLEMENTATIONS if f != "cutlass")
    with config.patch(implementations=left_out):
        why = config.family_declines("cutlass")
        assert why == "switched off: config.implementations (FLUXCOMPILE_IMPLEMENTATIONS) leaves out 'cutlass'"
        choice = Choice("cutlass:x", print, lambda *a: None, family="cutlass")
        assert choice.declines(1, 2) == why  # the central check, before the choice's own
        assert not any(c.family == "cutlass" for c in choices_for("all_gather_matmul"))  # not offered
    with config.patch(implementations=("reference",)):
        assert Choice("reference", print, symmetric_memory=False).declines() is None


def test_old_family_names_expand(warned, caplog):
    with caplog.at_level("WARNING", logger="fluxcompile.config"):
        with config.patch(implementations=("cuda", "reference", "triton", "decode")):
            expanded = ("decode", "gemv_peers", "reference", "triton_ag", "triton_rs", "moe", "dlrm")
            assert config.implementations == expanded
        cfg = Config()
        cfg.load_env({"FLUXCOMPILE_IMPLEMENTATIONS": "triton,reference"})
        assert cfg.implementations == ("triton_ag", "triton_rs", "decode", "moe", "dlrm", "reference")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines  # one line per old name
    assert "'cuda' is deprecated" in lines[0] and "decode, gemv_peers" in lines[0]
    with pytest.raises(ValueError, match="names old families"):
        config_module.register_family("triton")


@pytest.mark.parametrize(("old", "family"), sorted(OLD_SWITCHES.items()))
def test_old_switches_set_the_family(warned, caplog, old, family):
    var = "FLUXCOMPILE_" + old.upper()
    cfg = Config()
    with caplog.at_level("WARNING", logger="fluxcompile.config"):
        cfg.load_env({var: "0"})
    assert family not in cfg.implementations
    assert caplog.text.count("deprecated") == 1 and f"{var} is deprecated" in caplog.text
    assert f"{family!r} in FLUXCOMPILE_IMPLEMENTATIONS" in caplog.text
    cfg.load_env({var: "1"})
    assert cfg.implementations == IMPLEMENTATIONS  # back in its place
    # In code: patch restores the field itself; reading answers from implementations.
    with config.patch(**{old: False}):
        assert family not in config.implementations and getattr(config, old) is False
        assert config.family_declines(family).endswith(f"leaves out {family!r}")
    assert config.implementations == IMPLEMENTATIONS and getattr(config, old) is True
    with pytest.raises(ValueError, match="expected True or False"):
        setattr(config, old, "no")


def test_an_old_switch_on_puts_its_family_back_in_order():
    cfg = Config()
    cfg.implementations = ("reference", "cublas_pipelined")
    cfg.experimental_cutlass = True
    assert cfg.implementations == ("reference", "cublas_pipelined", "cutlass")
    cfg.experimental_cutlass = True  # already there: unchanged
    assert cfg.implementations == ("reference", "cublas_pipelined", "cutlass")


def test_wait_bounds():
    cfg = Config()
    assert cfg.wait_timeout_s == 60.0 and cfg.watchdog_timeout_s == 600.0 and cfg.choose_timeout_s == 600.0
    cfg.load_env({"FLUXCOMPILE_WAIT_TIMEOUT_S": "5", "FLUXCOMPILE_WATCHDOG_TIMEOUT_S": "30"})
    assert cfg.wait_timeout_s == 5.0 and cfg.watchdog_timeout_s == 30.0
    from fluxcompile.symm_mem.watchdog import Watchdog

    with config.patch(watchdog_timeout_s=7.0):
        assert Watchdog().timeout_s == 7.0


@pytest.mark.parametrize(("old", "field"), sorted(OLD_BOUNDS.items()))
def test_old_bounds_set_the_new_field(warned, caplog, old, field):
    var = "FLUXCOMPILE_" + old.upper()
    cfg = Config()
    with caplog.at_level("WARNING", logger="fluxcompile.config"):
        cfg.load_env({var: "9"})
    assert getattr(cfg, field) == 9.0
    assert caplog.text.count("deprecated") == 1 and f"FLUXCOMPILE_{field.upper()} is the bound now" in caplog.text
    with config.patch(**{old: 3}):
        assert getattr(config, field) == 3.0 and getattr(config, old) == 3.0
    assert getattr(config, field) == getattr(Config(), field)


def test_old_bounds_in_the_environment_yield_to_the_new_one():
    cfg = Config()
    cfg.load_env({"FLUXCOMPILE_MOE_TIMEOUT_S": "5", "FLUXCOMPILE_DLRM_TIMEOUT_S": "7"})
    assert cfg.wait_timeout_s == 7.0  # of several old bounds, the longest
    cfg = Config()
    cfg.load_env({"FLUXCOMPILE_MOE_TIMEOUT_S": "5", "FLUXCOMPILE_WAIT_TIMEOUT_S": "2"})
    assert cfg.wait_timeout_s == 2.0


def test_old_names_are_not_unknown_options(caplog):
    with caplog.at_level("WARNING", logger="fluxcompile.config"):
        Config().load_env({"FLUXCOMPILE_CUTLASS_TIMEOUT_S": "3", "FLUXCOMPILE_NO_SUCH": "1"})
    assert "ignoring FLUXCOMPILE_NO_SUCH: no such option" in caplog.text
    assert "ignoring FLUXCOMPILE_CUTLASS_TIMEOUT_S" not in caplog.text
    assert "FLUXCOMPILE_CUTLASS_TIMEOUT_S" not in caplog.text.split("options:")[-1]  # the list names the new ones


def test_old_names_stay_out_of_the_fingerprints():
    before = (config.fingerprint(), config.tuning_fingerprint())
    assert "experimental_cutlass" not in before[0] and "signal_timeout_s" not in before[0]
    with config.patch(experimental_cutlass=False):
        assert config.tuning_fingerprint() != before[1]  # a winner tuned with it is not reused without it
    assert (config.fingerprint(), config.tuning_fingerprint()) == before
