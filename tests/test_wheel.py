"""The package as a user installs it: the wheel, in a fresh venv that holds torch alone.

Builds the wheel from a copy of the sources (an in-tree build leaves build/ and *.egg-info in the checkout,
and setuptools' build/lib keeps modules deleted since, which would then ship), makes a venv without system
site-packages, installs the running torch's version (CPU build) and the wheel with its declared
dependencies, and there, outside the checkout: imports fluxcompile with no warning, finds the CUDA sources
(``extensions.CSRC``) inside the installed package, and compiles a sequence-parallel Linear pair on 2 gloo
ranks with backend="fluxcompile", checked against eager and the rewrite report.

Skipped, with pip's message, where no index reachable from here provides that torch (the CPU suite on a
machine without network); every later step failing is a failure.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import venv
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
# What pip says where no index it can reach offers the torch asked for (under a constraints file: a conflict).
NOT_FOUND = ("No matching distribution found", "Could not find a version that satisfies", "ResolutionImpossible")
PIP = ["-m", "pip", "--retries", "1", "--timeout", "60"]  # an unreachable index fails in a minute, not ten

# Runs in the venv, from a folder outside the checkout; writes what it saw to the JSON file named by argv[1].
CHECK = textwrap.dedent(
    """
    import json, logging, os, socket, sys, sysconfig, time, warnings
    from datetime import timedelta
    from pathlib import Path

    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp


    def rank_main(rank, port, out_dir):
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
        import copy

        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        import fluxcompile

        mesh = init_device_mesh("cpu", (2,))
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64, bias=False), torch.nn.Linear(64, 32, bias=False))
        eager = copy.deepcopy(model)
        # Sequence parallel, as torchtitan shards a block: (batch, seq, dim) inputs split along seq.
        plan = {"0": ColwiseParallel(input_layouts=Shard(1)), "1": RowwiseParallel(output_layouts=Shard(1))}
        for m in (model, eager):
            parallelize_module(m, mesh, plan)
        torch.manual_seed(1 + rank)
        x = torch.randn(2, 8, 32)
        with torch.no_grad(), torch._inductor.config.patch(fx_graph_cache=False), fluxcompile.collect_reports() as rep:
            out = torch.compile(model, backend="fluxcompile")(x)
            ref = eager(x)
        err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
        counts = {op: rep.count(op) for op in ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce")}
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"err": err, "counts": counts, "report": str(rep)}))
        dist.destroy_process_group()


    def main():
        out = Path(sys.argv[1])
        seen = []

        class Keep(logging.Handler):
            def emit(self, record):
                seen.append(f"{record.levelname} {record.name}: {record.getMessage()}")

        logging.getLogger("fluxcompile").addHandler(Keep(logging.WARNING))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import fluxcompile
            import fluxcompile.lowerings
            from fluxcompile.kernels import extensions
        seen += [f"{w.category.__name__}: {w.message}" for w in caught
                 if "numpy" in str(w.message).lower() or "fluxcompile" in w.filename]
        site = Path(sysconfig.get_paths()["purelib"]).resolve()
        csrc = Path(extensions.CSRC).resolve()
        result = {
            "in_venv": sys.prefix != sys.base_prefix,
            "site": str(site),
            "fluxcompile": str(Path(fluxcompile.__file__).resolve()),
            "torch": str(Path(torch.__file__).resolve()),
            "csrc": str(csrc),
            "csrc_in_site": csrc.is_relative_to(site),
            "missing": [s for srcs in extensions.SOURCES.values() for s in srcs if not (csrc / s).is_file()],
            "warnings": seen,
        }
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ctx = mp.spawn(rank_main, args=(port, str(out.parent)), nprocs=2, join=False)
        deadline = time.monotonic() + 240
        while not ctx.join(timeout=5):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError("the 2 ranks did not finish within 240 s")
        result["ranks"] = [json.loads((out.parent / f"rank{r}.json").read_text()) for r in range(2)]
        out.write_text(json.dumps(result))


    if __name__ == "__main__":
        main()
    """
)


def run(cmd: list[str], timeout: float, env: dict[str, str], cwd: Path | None = None, torch_step=False) -> str:
    """Run ``cmd`` in its own process group (killed whole on timeout); its output, or the test fails. The
    ``torch_step`` (installing torch, no code of ours) skips instead where no index offers torch or it hangs."""
    p = subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        if torch_step:
            pytest.skip(f"installing torch did not finish in {timeout:.0f} s ({' '.join(cmd[7:])}): {out[-300:]}")
        pytest.fail(f"{' '.join(cmd)} did not finish in {timeout:.0f} s:\n{out[-3000:]}")
    if p.returncode != 0:
        if torch_step and any(s in out for s in NOT_FOUND):
            errors = " ".join(line for line in out.splitlines() if line.startswith("ERROR"))
            pytest.skip(f"no index provides {' '.join(cmd[7:])}: {errors}")
        pytest.fail(f"{' '.join(cmd)} failed ({p.returncode}):\n{out[-3000:]}")
    return out


def clean_env(tmp: Path) -> dict[str, str]:
    """This environment without what would let the checkout or the caller's settings leak into the venv."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "FLUXCOMPILE_", "TORCHINDUCTOR_"))}
    env.update(PYTHONNOUSERSITE="1", TORCHINDUCTOR_CACHE_DIR=str(tmp / "inductor-cache"))
    return env


def torch_requirement() -> tuple[list[str], list[str]]:
    """The running torch's version as a CPU build: the requirement and the pip options it needs."""
    version = torch.__version__
    base, _, local = version.partition("+")
    if local == "cpu":
        return [f"torch=={version}"], []
    # A CUDA build runs this suite: the CPU build of the same release, from PyTorch's CPU index.
    return [f"torch=={base}+cpu"], ["--extra-index-url", "https://download.pytorch.org/whl/cpu"]


def test_wheel_installs_and_compiles_in_a_fresh_venv(tmp_path):
    env = clean_env(tmp_path)
    # A venv holding torch alone. First: it decides whether the test can run here at all (where an index
    # provides torch, what pip fetches later, setuptools and numpy, missing is a failure, not a skip).
    venv_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True, system_site_packages=False).create(venv_dir)
    py = str(venv_dir / "bin" / "python")
    requirement, options = torch_requirement()
    run([py, *PIP, "install", "-q", *options, *requirement], timeout=400, env=env, torch_step=True)

    # The wheel, from a copy of the sources: the top-level files (pyproject.toml, README.md, ...) and the package.
    src = tmp_path / "src"
    src.mkdir()
    for f in ROOT.iterdir():
        if f.is_file():
            shutil.copy2(f, src / f.name)
    shutil.copytree(ROOT / "fluxcompile", src / "fluxcompile", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    run(
        [sys.executable, *PIP, "wheel", "-q", "--no-deps", "-w", str(tmp_path / "dist"), str(src)], timeout=300, env=env
    )
    (wheel,) = (tmp_path / "dist").glob("fluxcompile-*.whl")
    run([py, *PIP, "install", "-q", str(wheel)], timeout=300, env=env)

    script = tmp_path / "check" / "check_install.py"
    script.parent.mkdir()
    script.write_text(CHECK)
    result_file = script.parent / "result.json"
    out = run([py, str(script), str(result_file)], timeout=400, env=env, cwd=script.parent)
    r = json.loads(result_file.read_text())
    where = f"\n(script output:\n{out[-3000:]})"

    assert r["in_venv"], r
    for what in ("fluxcompile", "torch"):
        assert Path(r[what]).is_relative_to(r["site"]), f"{what} imported from {r[what]}, not the venv's {r['site']}"
    assert r["warnings"] == [], f"warnings on import: {r['warnings']}{where}"
    assert r["csrc_in_site"], f"extensions.CSRC = {r['csrc']} is not in the venv's {r['site']}"
    assert r["missing"] == [], f"the wheel lacks csrc files {r['missing']} (CSRC = {r['csrc']})"
    for rank, rr in enumerate(r["ranks"]):
        assert rr["err"] <= 1e-5, f"rank {rank}: relative error {rr['err']:.2e} against eager{where}"
        assert rr["counts"] == {"all_gather_matmul": 1, "matmul_reduce_scatter": 1, "matmul_all_reduce": 0}, (
            f"rank {rank}: {rr['counts']}\n{rr['report']}"
        )


def test_metadata_keeps_the_installed_torch_and_triton():
    """The declared torch range holds the running torch, and the test extra asks for nothing that would replace it
    or its Triton: no torch requirement, a Triton range that the running Triton and the default stack's (3.6.0,
    next to torch 2.13's CPU build) both meet."""
    import importlib.metadata

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    from packaging.requirements import Requirement

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (torch_req,) = [r for r in map(Requirement, project["dependencies"]) if r.name == "torch"]
    running = torch.__version__.partition("+")[0]
    assert torch_req.specifier.contains(running), f"torch {running} is outside the declared {torch_req}"
    extra = [Requirement(r) for r in project["optional-dependencies"]["test"]]
    assert not [r for r in extra if r.name == "torch"], "the test extra must not ask for torch"
    (triton_req,) = [r for r in extra if r.name == "triton"]
    try:
        versions = {"3.6.0", importlib.metadata.version("triton")}
    except importlib.metadata.PackageNotFoundError:
        versions = {"3.6.0"}
    for v in sorted(versions):
        assert triton_req.specifier.contains(v), f"the test extra's {triton_req} would replace Triton {v}"
