"""``config.implementations`` by family: every registered choice has one family, the list alone says what runs (the
families off by default left out of its default, ``+family`` / ``-family`` changing it), a family the config does
not enable declines with what enables it; the one in-kernel wait bound ``wait_timeout_s`` and the watchdog's
``watchdog_timeout_s``; the names that are gone end with one line naming what replaces them."""

from __future__ import annotations

import sys

import pytest

import fluxcompile  # registers the choices
from fluxcompile.config import (
    DEFAULT_IMPLEMENTATIONS,
    IMPLEMENTATIONS,
    OFF_BY_DEFAULT,
    REMOVED,
    REMOVED_FAMILIES,
    RETIRED_FAMILIES,
    Config,
    ConfigError,
    config,
)
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
    ("matmul_all_reduce", "triton"): "decode",
    ("matmul_all_reduce", "cuda:"): "decode",
    ("all_reduce_rmsnorm", "triton"): "decode",
    ("all_reduce_rmsnorm", "cuda:"): "decode",
    ("all_to_all_matmul", "triton"): "moe",
    ("all_to_all_matmul", "cutlass"): "moe",
    ("matmul_all_to_all", "triton"): "moe",
    ("all_to_all_matmul", "vdev"): "moe",
    ("matmul_all_to_all", "vdev"): "moe",
    ("embedding_bag_all_to_all", "triton:"): "dlrm",
    ("embedding_bag_all_to_all", "put:"): "dlrm",
    ("all_to_all_embedding_bag_backward", "triton"): "dlrm",
    ("all_to_all_embedding_bag_backward", "put"): "dlrm",
    ("matmul_reduce_scatter", "cutlass"): "rs_ring",
}


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
    assert set(OFF_BY_DEFAULT) < set(IMPLEMENTATIONS) and not set(REMOVED_FAMILIES) & set(IMPLEMENTATIONS)


def test_one_switch_per_family():
    """``implementations`` alone: no field but it switches a family, and its default is every family but those off
    by default, in order."""
    assert not [f for f in Config.__dataclass_fields__ if f.startswith("experimental_")]
    assert config.implementations == DEFAULT_IMPLEMENTATIONS == tuple(f for f in IMPLEMENTATIONS if f not in OFF_BY_DEFAULT)
    assert set(OFF_BY_DEFAULT) == {"triton_ag", "triton_rs", "ag_stages", "rs_stages", "moe", "rs_ring"}


def test_changes_to_the_default_list():
    with config.patch(implementations=("+moe", "-cutlass", "+rs_ring")):
        want = [f for f in IMPLEMENTATIONS if f not in OFF_BY_DEFAULT or f in ("moe", "rs_ring")]
        assert config.implementations == tuple(f for f in want if f != "cutlass")  # each in its default place
    assert config.implementations == DEFAULT_IMPLEMENTATIONS
    cfg = Config()
    cfg.load_env({"FLUXCOMPILE_IMPLEMENTATIONS": "+triton_ag"})
    assert cfg.family_declines("triton_ag") is None and cfg.implementations.index("triton_ag") == 0
    with pytest.raises(ConfigError, match="not both"):
        cfg.implementations = ("+moe", "reference")
    with pytest.raises(ConfigError, match="unknown 'nope'"):
        cfg.implementations = ("+nope",)


def test_default_order_is_the_order_of_the_previous_release():
    """Within an op the candidates keep their order (the autotuner's tie-break, the pick with autotuning off)."""
    names = [c.name for c in choices_for("matmul_all_reduce")]
    kinds = [n.partition(":")[0] for n in names]
    assert kinds == sorted(kinds, key=["triton", "cuda", "torch_symm_mem", "schedules", "reference"].index)
    assert names.index("torch_symm_mem:one_shot") < names.index("torch_symm_mem:two_shot")
    for op in ("all_gather_matmul", "matmul_reduce_scatter"):
        with config.patch(implementations=("+ag_stages", "+rs_stages")):
            names = [c.name for c in choices_for(op)]
        stages = [i for i, n in enumerate(names) if ":stages" in n]
        pipelined = [i for i, n in enumerate(names) if n.startswith("cublas_pipelined")]
        assert stages == pipelined[-len(stages) :], names  # the stages right after the other pipelined choices


def test_a_family_not_enabled_declines_with_what_enables_it():
    assert config.family_declines("cutlass") is None and config.family_declines("reference") is None
    assert config.family_declines("triton_ag") == (
        "off by default: adding 'triton_ag' to config.implementations (FLUXCOMPILE_IMPLEMENTATIONS=+triton_ag) enables it"
    )
    with config.patch(implementations=("+triton_ag",)):
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


def test_removed_family_names_say_what_they_stood_for():
    for name, stood in REMOVED_FAMILIES.items():
        with pytest.raises(ConfigError, match=f"the family {name!r} is no longer a name: .*{', '.join(stood)}"):
            config.implementations = (name, "reference")
        with pytest.raises(ConfigError, match="FLUXCOMPILE_IMPLEMENTATIONS='triton,reference'"):
            Config().load_env({"FLUXCOMPILE_IMPLEMENTATIONS": "triton,reference"})
        with pytest.raises(ValueError, match="cannot name a family"):
            config_module.register_family(name)
    assert config.implementations == DEFAULT_IMPLEMENTATIONS


def test_retired_families_say_why():
    for name, why in RETIRED_FAMILIES.items():
        for names in ((name, "reference"), (f"+{name}",)):
            with pytest.raises(ConfigError, match=f"the family {name!r} is retired: no benchmark row picked it"):
                config.implementations = names
        with pytest.raises(ConfigError, match=f"FLUXCOMPILE_IMPLEMENTATIONS='{name}'"):
            Config().load_env({"FLUXCOMPILE_IMPLEMENTATIONS": name})
        with pytest.raises(ValueError, match="cannot name a family"):
            config_module.register_family(name)
        assert why and not any(c.family == name for op in ("all_gather_matmul",) for c in choices_for(op))
    assert config.implementations == DEFAULT_IMPLEMENTATIONS


@pytest.mark.parametrize("old", sorted(REMOVED))
def test_removed_options_end_with_what_replaces_them(old):
    """In the environment (the import's one line) and in code (set, read or patched): one line naming the
    replacement."""
    var = "FLUXCOMPILE_" + old.upper()
    instead = REMOVED[old]
    with pytest.raises(ConfigError) as env:
        Config().load_env({var: "1"})
    with pytest.raises(ConfigError) as code:
        setattr(config, old, True)
    with pytest.raises(AttributeError) as read:
        getattr(config, old)
    with pytest.raises(AttributeError):
        with config.patch(**{old: True}):
            pass
    for e in (env, code, read):
        assert "\n" not in str(e.value) and "is no longer an option" in str(e.value)
    if instead.startswith("family:"):
        family = instead.partition(":")[2]
        sign = "+" if family in OFF_BY_DEFAULT else "-"
        assert str(env.value).endswith(f"FLUXCOMPILE_IMPLEMENTATIONS={sign}{family}")
        assert str(code.value).endswith(f"config.implementations = ({sign + family!r},)")
    else:
        assert f"FLUXCOMPILE_{instead.upper()} replaces it" in str(env.value)
        assert f"config.{instead} replaces it" in str(code.value)
    assert config.implementations == DEFAULT_IMPLEMENTATIONS


def test_wait_bounds():
    cfg = Config()
    assert cfg.wait_timeout_s == 60.0 and cfg.watchdog_timeout_s == 600.0 and cfg.choose_timeout_s == 600.0
    cfg.load_env({"FLUXCOMPILE_WAIT_TIMEOUT_S": "5", "FLUXCOMPILE_WATCHDOG_TIMEOUT_S": "30"})
    assert cfg.wait_timeout_s == 5.0 and cfg.watchdog_timeout_s == 30.0
    from fluxcompile.symm_mem.watchdog import Watchdog

    with config.patch(watchdog_timeout_s=7.0):
        assert Watchdog().timeout_s == 7.0


def test_the_fingerprints_name_no_removed_option():
    before = (config.fingerprint(), config.tuning_fingerprint())
    assert not [old for old in REMOVED if old in before[0]]
    with config.patch(implementations=("-cutlass",)):
        assert config.tuning_fingerprint() != before[1]  # a winner tuned with it is not reused without it
    assert (config.fingerprint(), config.tuning_fingerprint()) == before
